"""A kernel keeps its identity across suspend, as a real ``jupyter server
--gateway-url`` sees it.

jupyter_server's gateway client forgets a kernel for good the moment the gateway
stops listing it or its id answers 404 ("possibly culled"), and the notebook's next
cell then runs in a new, empty kernel. Through jupyter_server, a suspended
workspace's kernel must stay listed, and a connection to it must resume the
workspace and run on the restored variables.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.e2e.conftest import JupyterServer, attach_log, jupyter_server
from tests.support.cluster import Cluster, create_running, token_of

pytestmark = [pytest.mark.timeout(360), pytest.mark.db_agnostic]

#: How long the kernel stays suspended while jupyter_server keeps polling it.
SUSPENDED_FOR_S = 8.0


async def connect(server: JupyterServer, kernel_id: str) -> KernelSocket:
    url = f"{server.ws_url}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    return await KernelSocket.connect(url, server.token)


async def ws_refusal(url: str, token: str) -> int:
    """The HTTP status with which the kernel socket's handshake was refused."""
    with pytest.raises(websockets.InvalidStatus) as refused:
        sock = await KernelSocket.connect(url, token)
        await sock.close()
    return refused.value.response.status_code


async def listed(js: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """jupyter_server's kernels by id (each GET refreshes them from the gateway)."""
    response = await js.get("/api/kernels")
    assert response.status_code == 200, response.text
    return {k["id"]: k for k in response.json()}


def workspace_state(client: httpx.Client, workspace_id: str) -> str:
    return str(client.get(f"/v1/workspaces/{workspace_id}").json()["state"])


async def test_a_suspended_kernel_stays_in_jupyter_server_and_resumes_on_connect(
    shared_cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    for name in ("control", "agent1"):
        attach_log(request, shared_cluster.logs / f"{name}.log")
    owner = shared_cluster.new_user()
    workspace_id = create_running(owner)
    gateway = f"/v1/workspaces/{workspace_id}"
    root = tmp_path / "jupyter"
    attach_log(request, root / "jupyter-server.log")

    with jupyter_server(root, shared_cluster.url + gateway, token_of(owner)) as server:
        async with server.client() as js:
            # As JupyterLab does: a session for a notebook, which starts its kernel.
            created = await js.post("/api/sessions", json={
                "path": "counter.ipynb", "name": "counter.ipynb", "type": "notebook",
                "kernel": {"name": "python3"}})
            assert created.status_code == 201, created.text
            session_id = created.json()["id"]
            kernel_id = created.json()["kernel"]["id"]

            sock = await connect(server, kernel_id)
            try:
                defined = await sock.execute("counter = 41", timeout=60)
                assert defined.status == "ok", defined.reply
            finally:
                await sock.close()

            suspended = owner.post(f"{gateway}/suspend", params={"wait": 60})
            assert suspended.status_code == 200, suspended.text
            assert suspended.json()["state"] == "suspended", suspended.json()

            # nbfleet lists the kernel as suspended, and so does jupyter_server.
            direct = owner.get(f"{gateway}/api/kernels").json()
            assert [(k["id"], k["execution_state"]) for k in direct] == [
                (kernel_id, "suspended")]
            kernels = await listed(js)
            assert list(kernels) == [kernel_id], kernels
            assert kernels[kernel_id]["execution_state"] == "suspended"
            one = await js.get(f"/api/kernels/{kernel_id}")
            assert one.status_code == 200 and one.json()["id"] == kernel_id, one.text

            # Another tenant can neither see the resting kernel nor wake it.
            await assert_hidden_from_another_tenant(shared_cluster, workspace_id, kernel_id)
            assert workspace_state(owner, workspace_id) == "suspended"

            # Some seconds later jupyter_server has not dropped it, nor the session
            # that holds it; and listing it woke nothing.
            await asyncio.sleep(SUSPENDED_FOR_S)
            kernels = await listed(js)
            assert list(kernels) == [kernel_id], kernels
            sessions = (await js.get("/api/sessions")).json()
            assert [(s["id"], s["kernel"]["id"]) for s in sessions] == [
                (session_id, kernel_id)], sessions
            assert workspace_state(owner, workspace_id) == "suspended"
            assert "not present in the list of kernels" not in server.log.read_text(
                errors="replace")

            # Connecting through jupyter_server resumes the workspace; the cell waits
            # for it and runs on the restored variable.
            sock = await connect(server, kernel_id)
            try:
                result = await sock.execute("counter + 1", timeout=150)
                assert result.status == "ok", result.reply
                assert result.data() == ["42"], result.outputs
            finally:
                await sock.close()
            assert workspace_state(owner, workspace_id) == "running"
            kernels = await listed(js)
            assert list(kernels) == [kernel_id], kernels
            assert kernels[kernel_id]["execution_state"] != "suspended"

            deleted = await js.delete(f"/api/sessions/{session_id}")
            assert deleted.status_code == 204, deleted.text
            assert owner.get(f"{gateway}/api/kernels").json() == []


async def assert_hidden_from_another_tenant(cluster: Cluster, workspace_id: str,
                                            kernel_id: str) -> None:
    """Every kernel route answers 404 to another tenant, on both of the workspace's
    Jupyter surfaces, and none of its attempts resumes the workspace."""
    intruder = cluster.new_user(org="other", project="p")
    token = token_of(intruder)
    for base in (f"/v1/workspaces/{workspace_id}", f"/w/{workspace_id}"):
        api = f"{base}/api/kernels"
        for method, path in (("GET", api), ("GET", f"{api}/{kernel_id}"),
                             ("POST", f"{api}/{kernel_id}/restart"),
                             ("POST", f"{api}/{kernel_id}/interrupt"),
                             ("DELETE", f"{api}/{kernel_id}"),
                             ("POST", api)):
            response = intruder.request(method, path, json={} if method == "POST" else None)
            assert response.status_code == 404, (method, path, response.text)
        ws_url = f"{cluster.url}{api}/{kernel_id}/channels".replace("http", "ws", 1)
        assert await ws_refusal(ws_url, token) == 404
