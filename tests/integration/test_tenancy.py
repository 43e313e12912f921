"""Tenants never see each other's resources: every such request answers 404."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import stat

import pytest
from sqlalchemy import create_engine, text
from websockets.exceptions import InvalidStatus

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.support.cluster import Cluster, create_running, run_cell, start_kernel, token_of


def test_cross_tenant_requests_answer_404(shared_cluster: Cluster) -> None:
    alice = shared_cluster.new_user(org="alpha", project="p1")
    mallory = shared_cluster.new_user(org="beta", project="p1")
    same_org_other_project = shared_cluster.new_user(org="alpha", project="p2")
    ws = create_running(alice)
    alice.put(f"/v1/workspaces/{ws}/files/secret.txt", content=b"s3cret")
    kernel = start_kernel(alice, ws)

    probes = [
        ("GET", f"/v1/workspaces/{ws}"),
        ("GET", f"/v1/workspaces/{ws}/events"),
        ("POST", f"/v1/workspaces/{ws}/suspend"),
        ("POST", f"/v1/workspaces/{ws}/resume"),
        ("DELETE", f"/v1/workspaces/{ws}"),
        ("GET", f"/v1/workspaces/{ws}/files"),
        ("GET", f"/v1/workspaces/{ws}/files/secret.txt"),
        ("PUT", f"/v1/workspaces/{ws}/files/secret.txt"),
        ("DELETE", f"/v1/workspaces/{ws}/files/secret.txt"),
        ("GET", f"/v1/workspaces/{ws}/api/kernels"),
        ("POST", f"/v1/workspaces/{ws}/api/kernels"),
        ("GET", f"/v1/workspaces/{ws}/api/kernels/{kernel}"),
        ("DELETE", f"/v1/workspaces/{ws}/api/kernels/{kernel}"),
        ("POST", f"/v1/workspaces/{ws}/api/kernels/{kernel}/interrupt"),
        ("POST", f"/v1/workspaces/{ws}/api/kernels/{kernel}/restart"),
        ("GET", f"/v1/workspaces/{ws}/api/kernelspecs"),
    ]
    for outsider in (mallory, same_org_other_project):
        for method, path in probes:
            response = outsider.request(method, path, content=b"x" if method == "PUT" else None)
            assert response.status_code == 404, (method, path, response.status_code)
            assert ws in response.json()["detail"]  # the same answer as a missing workspace
        assert outsider.get("/v1/workspaces").json()["items"] == []
    missing = mallory.get("/v1/workspaces/ws_doesnotexist")
    assert missing.status_code == 404
    assert missing.json()["title"] == mallory.get(f"/v1/workspaces/{ws}").json()["title"]

    # The kernel socket refuses the outsider too, and the owner still gets in.
    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(KernelSocket.connect(shared_cluster.channels_url(ws, kernel),
                                         token_of(mallory)))
    assert refused.value.response.status_code == 404
    assert json.loads(refused.value.response.body)["title"] == "Not found"
    assert run_cell(shared_cluster, alice, ws, kernel, "print('in')").stdout == "in\n"
    assert alice.get(f"/v1/workspaces/{ws}/files/secret.txt").content == b"s3cret"


def test_admin_routes_are_invisible_to_users(shared_cluster: Cluster) -> None:
    user = shared_cluster.new_user()
    assert user.get("/v1/admin/agents").status_code == 404
    created = user.post("/v1/admin/users", json={"name": "x", "org": "o", "project": "p"})
    assert created.status_code == 404


def test_tokens_are_stored_hashed(shared_cluster: Cluster) -> None:
    user = shared_cluster.new_user()
    token = token_of(user)
    engine = create_engine(shared_cluster.db_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        rows = [r[0] for r in conn.execute(text("SELECT token_hash FROM api_tokens"))]
    engine.dispose()
    assert rows and all(len(r) == 64 for r in rows)
    assert token not in rows and shared_cluster.admin_token not in rows
    mode = stat.S_IMODE(os.stat(shared_cluster.home / "admin-token").st_mode)
    assert mode == 0o600


def test_kernels_do_not_see_control_plane_secrets(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client)
    secret = (shared_cluster.home / "cluster-secret").read_text().strip()
    env = run_cell(shared_cluster, client, ws, start_kernel(client, ws),
                   "import os; print(repr(dict(os.environ)))").stdout
    names = {name for name in ast.literal_eval(env) if "NBFLEET" in name}
    # Only what the state-capture extension needs: its own directory, its warm imports.
    assert names <= {"NBFLEET_STATE_DIR", "NBFLEET_PREIMPORT"}, names
    assert "NBFLEET_CLUSTER_SECRET" not in env and "NBFLEET_DB" not in env
    assert secret not in env


def test_kernels_cannot_read_the_host_or_other_workspaces(shared_cluster: Cluster) -> None:
    """The sandbox: no control-plane secrets, DB or other tenants' runtimes in view."""
    inventory = shared_cluster.admin().get("/v1/admin/agents").json()["items"][0]["inventory"]
    if inventory["sandbox"] != "bwrap":
        if os.environ.get("CI"):
            pytest.fail("CI must run kernels in the bubblewrap sandbox")
        pytest.skip("bubblewrap is not available on this machine")
    alice = shared_cluster.new_user(org="sbx-a", project="p")
    bob = shared_cluster.new_user(org="sbx-b", project="p")
    ws_alice, ws_bob = create_running(alice), create_running(bob)
    bob.put(f"/v1/workspaces/{ws_bob}/files/bob-secret.txt", content=b"bob's data")
    kernel = start_kernel(alice, ws_alice)
    start_kernel(bob, ws_bob)
    home = shared_cluster.home
    agent_dir = shared_cluster.root / "agent1"
    probes = {
        "secret": home / "cluster-secret",
        "admin": home / "admin-token",
        "bob": agent_dir / "runtimes" / ws_bob / "files" / "bob-secret.txt",
    }
    code = "\n".join([
        "import os, glob",
        *(f"print({name!r}, os.path.exists({str(path)!r}))" for name, path in probes.items()),
        f"print('runtimes', os.path.exists({str(agent_dir / 'runtimes')!r}))",
        "print('ipc', sorted(glob.glob('/tmp/nbfleet-*/*')))",
        "open('mine.txt', 'w').write('ok'); print('own', open('mine.txt').read())",
        "try:\n    open('/usr/evil', 'w')\nexcept OSError as e:\n    print('rootfs', e.errno)",
    ])

    output = run_cell(shared_cluster, alice, ws_alice, kernel, code).stdout
    lines = dict(line.split(" ", 1) for line in output.splitlines())
    assert lines["secret"] == lines["admin"] == lines["bob"] == "False", lines
    # Not even its own slot: the workspace's directories are bound at fixed paths.
    assert lines["runtimes"] == "False", lines
    assert ws_bob not in lines["ipc"] and lines["own"] == "ok"
    assert lines["rootfs"] == "30"  # EROFS: the root filesystem is read-only
