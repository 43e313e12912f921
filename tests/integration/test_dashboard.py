"""The web dashboard on a real control plane and agent: signing in, the cookies,
every page, a workspace's whole life through the forms, keyset pages over many
workspaces, the REST and gateway APIs by cookie, and signing out."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from nbfleet.db.engine import Database
from nbfleet.db.ids import new_id
from nbfleet.db.tables import Org, Project, User, WebSession, Workspace
from tests.support.cluster import Cluster, wait_until

PAGE = 50


def browser(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, follow_redirects=False, timeout=60.0)


def sign_in(client: httpx.Client, token: str, next_url: str = "/") -> httpx.Response:
    page = client.get("/ui/login")
    assert page.status_code == 200
    found = re.search(r'name="_xsrf" value="([^"]+)"', page.text)
    assert found is not None
    return client.post("/ui/login", data={"_xsrf": found.group(1), "token": token,
                                          "next": next_url})


def new_user(cluster: Cluster, org: str | None = None) -> tuple[str, str]:
    """A user of its own tenant: (token, org name)."""
    org = org or f"o{uuid.uuid4().hex[:8]}"
    created = cluster.admin().post("/v1/admin/users", json={
        "name": f"u{uuid.uuid4().hex[:8]}", "org": org, "project": "p"})
    created.raise_for_status()
    return str(created.json()["token"]), org


@pytest.fixture
def user(shared_cluster: Cluster) -> Iterator[tuple[httpx.Client, str]]:
    """A signed-in browser and its user's org."""
    token, org = new_user(shared_cluster)
    with browser(shared_cluster) as client:
        assert sign_in(client, token).status_code == 303
        yield client, org


def xsrf(client: httpx.Client) -> str:
    return str(client.cookies["_xsrf"])


def state_of(client: httpx.Client, workspace_id: str) -> str | None:
    items = client.get("/ui/api/workspaces").json()["items"]
    return next((item["state"] for item in items if item["id"] == workspace_id), None)


def test_sign_in_sets_the_session_cookies(shared_cluster: Cluster) -> None:
    token, _ = new_user(shared_cluster)
    with browser(shared_cluster) as client:
        assert client.get("/").headers["location"] == "/ui/login"
        wrong = sign_in(client, "nbf_" + "x" * 43)
        assert wrong.status_code == 401 and "invalid token" in wrong.text
        response = sign_in(client, token, "/ui/jobs")
        assert response.status_code == 303 and response.headers["location"] == "/ui/jobs"
        cookies = {c.split("=", 1)[0]: c.lower()
                   for c in response.headers.get_list("set-cookie")}
        session_cookie, xsrf_cookie = cookies["nbfleet_session"], cookies["_xsrf"]
        assert "httponly" in session_cookie and "httponly" not in xsrf_cookie
        for cookie in (session_cookie, xsrf_cookie):
            assert "samesite=lax" in cookie and "path=/" in cookie
            assert "max-age=43200" in cookie and "secure" not in cookie  # plain http here
        assert client.get("/ui/jobs").status_code == 200


def test_every_page_renders_from_local_assets(shared_cluster: Cluster,
                                              user: tuple[httpx.Client, str]) -> None:
    client, _ = user
    with browser(shared_cluster) as admin:
        assert sign_in(admin, shared_cluster.admin_token).status_code == 303
        pages = [(client, "/"), (client, "/ui/workspaces/new"), (client, "/ui/credits"),
                 (client, "/ui/credits?scope=org"), (client, "/ui/jobs"),
                 (admin, "/ui/admin/fleet"), (admin, "/ui/admin/users"),
                 (admin, "/ui/admin/orgs"), (admin, "/ui/admin/grants"), (admin, "/")]
        for who, path in pages:
            page = who.get(path)
            assert page.status_code == 200, (path, page.text[:500])
            assert page.headers["content-type"].startswith("text/html")
            assert "<h1>" in page.text and 'lang="en"' in page.text
            links = re.findall(r'(?:src|href|action)="([^"]*)"', page.text)
            assert links and all(link.startswith(("/", "#")) for link in links), (path, links)
        fleet = admin.get("/ui/admin/fleet").text
        assert "A100-80GB" in fleet  # the agent's GPUs
        for asset in set(re.findall(r'(/ui/static/[^"?]+)', page.text)):
            served = client.get(asset)
            assert served.status_code == 200 and "http" not in served.text, asset
    assert client.get("/ui/nothing-here").status_code == 404


def test_a_workspace_lives_through_the_forms(shared_cluster: Cluster,
                                             user: tuple[httpx.Client, str]) -> None:
    client, _ = user
    form = client.get("/ui/workspaces/new").text
    key = re.search(r'name="key" value="([^"]+)"', form)
    assert key is not None
    fields = {"_xsrf": xsrf(client), "key": key.group(1), "name": "from-the-browser",
              "gpus": "", "gpu_types": ""}
    created = client.post("/ui/workspaces", data=fields)
    assert created.status_code == 303
    workspace_id = created.headers["location"].split("/")[-1].split("?")[0]
    again = client.post("/ui/workspaces", data=fields)  # a double submit: the same one
    assert again.headers["location"] == created.headers["location"]
    wait_until(lambda: state_of(client, workspace_id) == "running", 60, what="running")

    # The REST API by cookie: files go in, the page lists them, downloads come back.
    put = client.put(f"/v1/workspaces/{workspace_id}/files/notes/hello.txt",
                     content=b"hello", headers={"X-XSRFToken": xsrf(client)})
    assert put.status_code == 200, put.text
    page = client.get(f"/ui/workspaces/{workspace_id}")
    assert "notes/hello.txt" in page.text and f"/w/{workspace_id}/lab" in page.text
    download = client.get(f"/ui/workspaces/{workspace_id}/files/notes/hello.txt")
    assert download.content == b"hello"
    assert download.headers["content-disposition"] == "attachment; filename*=UTF-8''hello.txt"
    specs = client.get(f"/v1/workspaces/{workspace_id}/api/kernelspecs")
    assert specs.status_code == 200 and specs.json()["kernelspecs"]

    for action, settled in (("suspend", "suspended"), ("resume", "running")):
        done = client.post(f"/ui/workspaces/{workspace_id}/{action}",
                           data={"_xsrf": xsrf(client), "back": "/"})
        assert done.status_code == 303 and done.headers["location"] == f"/?done={action}"
        assert client.get(done.headers["location"]).status_code == 200
        wait_until(lambda: state_of(client, workspace_id) == settled, 60,  # noqa: B023
                   what=settled)
    deleted = client.post(f"/ui/workspaces/{workspace_id}/delete", data={"_xsrf": xsrf(client)})
    assert deleted.status_code == 303
    wait_until(lambda: state_of(client, workspace_id) is None, 60, what="deleted")
    assert workspace_id not in client.get("/").text


def test_a_refused_request_shows_the_form_again(user: tuple[httpx.Client, str]) -> None:
    client, _ = user
    refused = client.post("/ui/workspaces", data={
        "_xsrf": xsrf(client), "key": uuid.uuid4().hex, "name": "too-big", "gpus": "64",
        "gpu_types": "Z9-1GB"})
    assert refused.status_code == 422
    assert "cannot be satisfied" in refused.text and 'value="too-big"' in refused.text
    assert client.post("/ui/workspaces", data={"_xsrf": xsrf(client), "name": "x",
                                               "gpus": "two"}).status_code == 422


def add_workspaces(cluster: Cluster, org: str, count: int) -> list[str]:
    """``count`` suspended workspaces written straight into the DB (no reconciling)."""
    db = Database(cluster.db_url)
    try:
        with db.transaction() as session:
            org_id, project_id, user_id = session.execute(
                select(Org.id, Project.id, User.id).join(Project, Project.org_id == Org.id)
                .join(User, User.project_id == Project.id).where(Org.name == org)).one()
            now = db.now(session)
            ids = []
            for number in range(count):
                ws = Workspace(id=new_id("ws"), org_id=org_id, project_id=project_id,
                               owner_id=user_id, name=f"bulk-{number}", state="suspended",
                               desired_state="suspended", generation=1, pending=False,
                               attempts=0, resources=None, created_at=now, updated_at=now)
                session.add(ws)
                ids.append(ws.id)
        return sorted(ids)
    finally:
        db.dispose()


def links(page: str, rel: str) -> list[str]:
    return re.findall(rf'<a href="([^"]+)" rel="{rel}">', page)


def test_workspaces_are_listed_in_keyset_pages(shared_cluster: Cluster,
                                               user: tuple[httpx.Client, str]) -> None:
    client, org = user
    ids = add_workspaces(shared_cluster, org, 2 * PAGE + 20)
    seen: list[str] = []
    url: str | None = "/"
    pages: list[str] = []
    while url is not None:
        page = client.get(url.replace("&amp;", "&"))
        assert page.status_code == 200
        pages.append(page.text)
        seen += re.findall(r'data-ws-state="([^"]+)"', page.text)
        following = links(page.text, "next")
        url = following[0] if following else None
    assert seen == ids and len(pages) == 3
    assert [len(re.findall(r'data-ws-state="', p)) for p in pages] == [PAGE, PAGE, 20]
    # Back from the last page: the previous one is the middle one.
    previous = links(pages[2], "prev")
    assert previous and re.findall(r'data-ws-state="([^"]+)"',
                                   client.get(previous[0]).text) == ids[PAGE:2 * PAGE]
    poll = client.get(f"/ui/api/workspaces?after={ids[PAGE - 1]}").json()["items"]
    assert [item["id"] for item in poll] == ids[PAGE:2 * PAGE]


def test_sign_out_revokes_the_session(shared_cluster: Cluster) -> None:
    token, _ = new_user(shared_cluster)
    with browser(shared_cluster) as client:
        assert sign_in(client, token).status_code == 303
        cookies: dict[str, Any] = dict(client.cookies)
        out = client.post("/ui/logout", data={"_xsrf": cookies["_xsrf"]})
        assert out.status_code == 303 and out.headers["location"] == "/ui/login?done=signed-out"
        assert "signed out" in client.get(out.headers["location"]).text
        assert "nbfleet_session" not in client.cookies
    with browser(shared_cluster) as replay:
        for name, value in cookies.items():
            replay.cookies.set(name, value)
        assert replay.get("/").status_code == 303
        assert replay.get("/v1/workspaces").status_code == 401
    db = Database(shared_cluster.db_url)
    try:
        with db.transaction(write=False) as session:
            revoked = session.execute(select(WebSession.revoked_at).where(
                WebSession.revoked_at.is_not(None))).scalars().all()
        assert revoked
    finally:
        db.dispose()
