"""nbfleet's own JupyterLab server (``/w/{id}``): the page, the Contents API over
the workspace's durable files, sessions, settings and layouts, as a browser signed in
by cookie uses them, and as another tenant would attack them."""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Any

import httpx
import pytest

from tests.support.cluster import (
    Cluster,
    create_running,
    outcome,
    run_cell,
    token_of,
    wait_state,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

NOTEBOOK = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def browser(cluster: Cluster, client: httpx.Client, workspace_id: str) -> httpx.Client:
    """A cookie-only client, signed in as Jupyter's token login does."""
    jar = httpx.Client(base_url=cluster.url, timeout=60.0)
    response = jar.get(f"/w/{workspace_id}/lab", params={"token": token_of(client)})
    assert response.status_code == 303, response.text
    assert response.headers["location"] == f"/w/{workspace_id}/lab"  # the token is dropped
    cookies = response.headers.get_list("set-cookie")
    session = next(c for c in cookies if c.startswith("nbfleet_session="))
    assert "HttpOnly" in session and "SameSite=lax" in session.replace("Lax", "lax")
    jar.headers["X-XSRFToken"] = jar.cookies["_xsrf"]
    return jar


def page_config(html: str) -> dict[str, Any]:
    match = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                      html, re.S)
    assert match, html[:500]
    config: dict[str, Any] = json.loads(match.group(1))
    return config


def test_the_page_sends_strangers_to_sign_in_and_serves_lab_offline(
        shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    anonymous = httpx.Client(base_url=shared_cluster.url)
    away = anonymous.get(f"/w/{workspace_id}/lab")
    assert away.status_code == 303
    assert away.headers["location"] == f"/ui/login?next=/w/{workspace_id}/lab"
    assert anonymous.get(f"/w/{workspace_id}/api/contents").status_code == 401

    lab = browser(shared_cluster, client, workspace_id)
    page = lab.get(f"/w/{workspace_id}/lab")
    assert page.status_code == 200
    config = page_config(page.text)
    assert config["baseUrl"] == f"/w/{workspace_id}/" and config["token"] == ""
    assert config["terminalsAvailable"] is False
    # Nothing the page loads comes from outside (the machine may be offline).
    assert not re.search(r'(src|href)="https?://', page.text)
    assert "https://" not in json.dumps(config)
    script = re.search(r'src="([^"]+main\.[^"]+\.js[^"]*)"', page.text)
    assert script and lab.get(script.group(1)).status_code == 200
    for extension in config["federated_extensions"]:
        url = f"{config['fullLabextensionsUrl']}/{extension['name']}/{extension['load']}"
        assert lab.get(url).status_code == 200, url


def test_static_files_never_leave_the_frontends_directories(shared_cluster: Cluster) -> None:
    anonymous = httpx.Client(base_url=shared_cluster.url)
    for path in ("/lab-static/../../../../etc/passwd", "/lab-static/%2e%2e/%2e%2e/etc/passwd",
                 "/w/x/lab/extensions/../../../../etc/passwd",
                 "/w/x/lab/api/themes/..%2f..%2f..%2fetc/passwd"):
        response = anonymous.get(path)
        assert response.status_code == 404 and "root:" not in response.text, path


def test_lab_saves_are_workspace_files_and_kernel_files_show_up(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    lab = browser(shared_cluster, client, workspace_id)
    base = f"/w/{workspace_id}/api/contents"
    model = {"type": "notebook", "format": "json", "content": NOTEBOOK}
    # Signed in by cookie, a write without the XSRF header is refused, and changes nothing.
    forged = httpx.Client(base_url=shared_cluster.url, cookies=lab.cookies)
    assert forged.put(f"{base}/a.ipynb", json=model).status_code == 403
    assert lab.get(f"{base}/a.ipynb").status_code == 404

    saved = lab.put(f"{base}/a.ipynb", json=model)
    assert saved.status_code == 201, saved.text
    assert client.get(f"/v1/workspaces/{workspace_id}/files/a.ipynb").status_code == 200
    text = lab.put(f"{base}/notes.txt", json={"type": "file", "format": "text",
                                              "content": "from lab"})
    assert text.status_code == 201
    # The running kernel sees what Lab saved...
    session = lab.post(f"/w/{workspace_id}/api/sessions",
                       content=json.dumps({"path": "a.ipynb", "type": "notebook",
                                           "name": "a.ipynb", "kernel": {"name": "python3"}}),
                       headers={"Content-Type": "text/plain"})  # as JupyterLab sends it
    assert session.status_code == 201, session.text
    kernel_id = session.json()["kernel"]["id"]
    assert outcome(run_cell(shared_cluster, client, workspace_id, kernel_id,
                            "print(open('notes.txt').read())")) == "from lab\n"
    # ...and what the kernel writes appears in Lab's file browser without a suspend.
    run_cell(shared_cluster, client, workspace_id, kernel_id,
             "open('from_kernel.csv', 'w').write('a,b\\n1,2\\n')")

    def listed() -> bool:
        names = [c["name"] for c in lab.get(base).json()["content"]]
        return "from_kernel.csv" in names

    wait_until(listed, timeout=20, interval=0.5, what="a kernel-written file in Lab")
    assert lab.get(f"{base}/from_kernel.csv").json()["content"] == "a,b\n1,2\n"


def test_lab_saves_notebooks_and_uploads_larger_than_other_bodies(
        shared_cluster: Cluster) -> None:
    """Other requests stop at 1 MiB; a notebook with plots, or an upload's chunk
    (base64 in JSON), is larger and must save."""
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    lab = browser(shared_cluster, client, workspace_id)
    image = base64.b64encode(os.urandom(3 * 1024 * 1024)).decode()
    cell = {"cell_type": "code", "source": "plot()", "metadata": {}, "execution_count": 1,
            "outputs": [{"output_type": "display_data", "metadata": {},
                         "data": {"image/png": image}}], "id": "c1"}
    notebook = {**NOTEBOOK, "cells": [cell]}
    saved = lab.put(f"/w/{workspace_id}/api/contents/plots.ipynb",
                    json={"type": "notebook", "format": "json", "content": notebook})
    assert saved.status_code == 201, saved.text[:300]
    assert saved.json()["size"] > 4 * 1024 * 1024
    chunks = [os.urandom(1024 * 1024) for _ in range(3)]
    for number, chunk in zip((1, 2, -1), chunks, strict=True):
        response = lab.put(f"/w/{workspace_id}/api/contents/data.bin", json={
            "type": "file", "format": "base64", "chunk": number,
            "content": base64.b64encode(chunk).decode()})
        assert response.status_code in (200, 201), response.text[:300]
    stored = client.get(f"/v1/workspaces/{workspace_id}/files/data.bin").content
    assert stored == b"".join(chunks)


def test_sessions_are_kept_per_path_and_end_with_their_kernel(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    lab = browser(shared_cluster, client, workspace_id)
    base = f"/w/{workspace_id}/api/sessions"
    body = {"path": "x.ipynb", "type": "notebook", "name": "x.ipynb",
            "kernel": {"name": "python3"}}
    first = lab.post(base, json=body).json()
    again = lab.post(base, json=body).json()
    assert again["id"] == first["id"] and again["kernel"]["id"] == first["kernel"]["id"]
    renamed = lab.patch(f"{base}/{first['id']}", json={"path": "y.ipynb"})
    assert renamed.status_code == 200 and renamed.json()["path"] == "y.ipynb"
    assert [s["path"] for s in lab.get(base).json()] == ["y.ipynb"]
    # A session survives suspend with its kernel; deleting it shuts the kernel down.
    client.post(f"/v1/workspaces/{workspace_id}/suspend", params={"wait": 60})
    listed = lab.get(base).json()
    assert [(s["id"], s["kernel"]["execution_state"]) for s in listed] == [
        (first["id"], "suspended")]
    assert lab.delete(f"{base}/{first['id']}").status_code == 204
    assert lab.get(base).json() == []
    assert client.get(f"/v1/workspaces/{workspace_id}/api/kernels").json() == []
    for bad in (b"[1]", b"{", json.dumps({"path": 3}).encode()):
        response = lab.post(base, content=bad)
        assert response.status_code == 422 and response.json()["detail"], bad


def test_settings_and_layouts_are_each_users_own(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    lab = browser(shared_cluster, client, workspace_id)
    plugin = "@jupyterlab/apputils-extension:themes"
    url = f"/w/{workspace_id}/lab/api/settings/{plugin}"
    assert lab.get(url).json()["raw"] == "{}"
    raw = '{"theme": "JupyterLab Dark"} // mine'
    assert lab.put(url, json={"raw": raw}).status_code == 204
    got = lab.get(url).json()
    assert got["raw"] == raw and got["settings"]["theme"] == "JupyterLab Dark"
    wrong = lab.put(url, json={"raw": '{"theme": 42}'})
    assert wrong.status_code == 422 and "schema" in wrong.json()["detail"]
    assert lab.get(url).json()["raw"] == raw  # the refused write changed nothing
    layout = {"data": {"layout-restorer:data": {}}, "metadata": {"id": "default"}}
    assert lab.put(f"/w/{workspace_id}/lab/api/workspaces/default",
                   json=layout).status_code == 204
    # A teammate in the same project sees the workspace, but not these.
    teammate = shared_cluster.new_user()
    mate = browser(shared_cluster, teammate, workspace_id)
    assert mate.get(url).json()["raw"] == "{}"
    assert mate.get(f"/w/{workspace_id}/lab/api/workspaces/default").json()["data"] == {}


def test_another_tenant_gets_404_everywhere_under_w(shared_cluster: Cluster) -> None:
    owner = shared_cluster.new_user()
    workspace_id = create_running(owner)
    lab = browser(shared_cluster, owner, workspace_id)
    lab.put(f"/w/{workspace_id}/api/contents/secret.txt",
            json={"type": "file", "format": "text", "content": "s3cret"})
    intruder = shared_cluster.new_user(org="evil", project="x")
    base = f"/w/{workspace_id}"
    for method, path, body in [
        ("GET", "/lab", None), ("GET", "/api/contents", None),
        ("GET", "/api/contents/secret.txt", None),
        ("PUT", "/api/contents/x.txt", {"type": "file", "format": "text", "content": "x"}),
        ("DELETE", "/api/contents/secret.txt", None), ("GET", "/api/sessions", None),
        ("POST", "/api/sessions", {"path": "p", "kernel": {"name": "python3"}}),
        ("GET", "/api/kernels", None), ("GET", "/lab/api/settings", None),
        ("GET", "/lab/api/workspaces/default", None), ("GET", "/api/me", None),
    ]:
        response = intruder.request(method, base + path, json=body)
        assert response.status_code == 404, (method, path, response.status_code)
        assert "s3cret" not in response.text
    assert lab.get(f"{base}/api/contents/secret.txt").json()["content"] == "s3cret"


def test_opening_lab_on_a_suspended_workspace_resumes_it_and_says_so(
        shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    client.post(f"/v1/workspaces/{workspace_id}/suspend", params={"wait": 60})
    lab = browser(shared_cluster, client, workspace_id)
    page = lab.get(f"/w/{workspace_id}/lab")
    assert page.status_code == 200 and "Resuming workspace" in page.text
    assert client.get(f"/v1/workspaces/{workspace_id}").json()["desired_state"] == "running"
    wait_state(client, workspace_id, "running")
    assert "Resuming workspace" not in lab.get(f"/w/{workspace_id}/lab").text
