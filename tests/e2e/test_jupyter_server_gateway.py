"""A real ``jupyter server --gateway-url`` drives kernels in an nbfleet workspace.

This is the integration users actually run (JupyterLab, VS Code and nbclient all sit
behind jupyter_server's GatewayClient), so it goes through jupyter_server's REST and
WebSocket proxies rather than calling nbfleet's gateway directly.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nbformat
import pytest
import websockets
from nbformat.v4 import new_code_cell, new_notebook

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.e2e.conftest import JupyterServer, attach_log, jupyter_server
from tests.support.cluster import Cluster, create_running

pytestmark = pytest.mark.timeout(180)

CELLS = ["x = 21", "print(x * 2)", "import os; print(sorted(os.listdir('.')))"]
SLEEP_CELL = "import time; y = 7; time.sleep(60)"


@dataclass(frozen=True)
class Tenant:
    client: httpx.Client
    token: str
    workspace_id: str

    @property
    def gateway(self) -> str:
        return f"/v1/workspaces/{self.workspace_id}"

    def nbfleet_kernel_ids(self) -> list[str]:
        response = self.client.get(f"{self.gateway}/api/kernels")
        response.raise_for_status()
        return [k["id"] for k in response.json()]


def token_of(client: httpx.Client) -> str:
    return client.headers["Authorization"].split(" ", 1)[1]


@pytest.fixture
def tenant(cluster: Cluster, request: pytest.FixtureRequest) -> Tenant:
    for name in ("control", "agent1"):
        attach_log(request, cluster.logs / f"{name}.log")
    client = cluster.new_user()
    return Tenant(client, token_of(client), create_running(client))


@pytest.fixture
def jupyter(cluster: Cluster, tenant: Tenant, tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[JupyterServer]:
    root = tmp_path / "jupyter"
    attach_log(request, root / "jupyter-server.log")
    with jupyter_server(root, cluster.url + tenant.gateway, tenant.token) as server:
        yield server


def put_demo_notebook(tenant: Tenant) -> None:
    cells = [new_code_cell(source) for source in CELLS]  # type: ignore[no-untyped-call]
    notebook = new_notebook(cells=cells)  # type: ignore[no-untyped-call]
    text: str = nbformat.writes(notebook)  # type: ignore[no-untyped-call]
    response = tenant.client.put(f"{tenant.gateway}/files/demo.ipynb", content=text.encode())
    assert response.status_code == 200, response.text


def read_code_cells(tenant: Tenant) -> list[str]:
    """The notebook as nbfleet stored it, not the local copy: proves the round trip."""
    response = tenant.client.get(f"{tenant.gateway}/files/demo.ipynb")
    response.raise_for_status()
    notebook = nbformat.reads(response.text, as_version=4)  # type: ignore[no-untyped-call]
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


async def connect(server: JupyterServer, kernel_id: str) -> KernelSocket:
    url = f"{server.ws_url}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    return await KernelSocket.connect(url, server.token)


async def wait_started(sock: KernelSocket, msg_id: str, timeout: float = 30.0) -> None:
    """Until the kernel echoes ``execute_input`` for ``msg_id``: the cell is running."""
    deadline = time.monotonic() + timeout
    while True:
        msg = await sock.receive(max(0.01, deadline - time.monotonic()))
        if (msg.get("parent_header", {}).get("msg_id") == msg_id
                and msg.get("msg_type") == "execute_input"):
            return


async def ws_refusal(url: str, token: str) -> int:
    """The HTTP status with which the kernel socket's handshake was refused."""
    with pytest.raises(websockets.InvalidStatus) as refused:
        sock = await KernelSocket.connect(url, token)
        await sock.close()
    return refused.value.response.status_code


async def test_jupyter_server_runs_a_notebook_through_nbfleet(
    tenant: Tenant, jupyter: JupyterServer
) -> None:
    put_demo_notebook(tenant)
    async with jupyter.client() as js:
        specs = (await js.get("/api/kernelspecs")).json()
        assert "python3" in specs["kernelspecs"], specs

        started = await js.post("/api/kernels", json={"name": "python3"})
        assert started.status_code == 201, started.text
        kernel_id = started.json()["id"]
        assert kernel_id in tenant.nbfleet_kernel_ids()
        assert (await js.get(f"/api/kernels/{kernel_id}")).json()["id"] == kernel_id

        sock = await connect(jupyter, kernel_id)
        try:
            # The notebook's cells, in order.
            results = [await sock.execute(source, timeout=60) for source in read_code_cells(tenant)]
            assert [r.status for r in results] == ["ok"] * len(CELLS), [r.reply for r in results]
            assert results[1].stdout == "42\n"
            assert "demo.ipynb" in results[2].stdout, results[2].stdout

            # Interrupt a long cell: KeyboardInterrupt soon, and the namespace survives.
            request = sock.message("execute_request", {
                "code": SLEEP_CELL, "silent": False, "store_history": True,
                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}, "shell")
            msg_id = request["header"]["msg_id"]
            began = time.monotonic()
            await sock.send(request)
            await wait_started(sock, msg_id)
            await asyncio.sleep(0.3)  # let time.sleep() begin; an earlier SIGINT is fine too
            interrupted = await js.post(f"/api/kernels/{kernel_id}/interrupt")
            assert interrupted.status_code == 204, interrupted.text
            result = await sock.collect(msg_id, timeout=30)
            assert result.status == "error" and result.error_name == "KeyboardInterrupt", \
                result.reply
            assert time.monotonic() - began < 30
            kept = await sock.execute("print(x, y)")
            assert kept.stdout == "21 7\n", kept.reply

            # Restart: the process is new, so its namespace is empty.
            restarted = await js.post(f"/api/kernels/{kernel_id}/restart")
            assert restarted.status_code == 200, restarted.text
            assert restarted.json()["id"] == kernel_id
            wiped = await sock.execute("print(x)")
            assert wiped.status == "error" and wiped.error_name == "NameError", wiped.reply
        finally:
            await sock.close()

        deleted = await js.delete(f"/api/kernels/{kernel_id}")
        assert deleted.status_code == 204, deleted.text
        assert kernel_id not in tenant.nbfleet_kernel_ids()
        assert (await js.get("/api/kernels")).json() == []


async def test_gateway_rejects_bad_tokens_and_other_tenants(
    cluster: Cluster, tenant: Tenant
) -> None:
    started = tenant.client.post(f"{tenant.gateway}/api/kernels", json={"name": "python3"})
    assert started.status_code == 201, started.text
    kernel_id = started.json()["id"]
    api = f"{cluster.url}{tenant.gateway}/api"
    ws_url = cluster.channels_url(tenant.workspace_id, kernel_id)

    # A token nbfleet never issued: 401, whichever scheme Jupyter clients use.
    for scheme in ("token", "Bearer"):
        bad = httpx.get(f"{api}/kernels", headers={"Authorization": f"{scheme} nbf_wrong"})
        assert bad.status_code == 401, bad.text
    assert httpx.get(f"{api}/kernels").status_code == 401

    # Another tenant's valid token: the workspace does not exist for it.
    other = token_of(cluster.new_user(org="other", project="p"))
    for path in ("kernels", "kernelspecs", f"kernels/{kernel_id}"):
        response = httpx.get(f"{api}/{path}", headers={"Authorization": f"token {other}"})
        assert response.status_code == 404, (path, response.text)

    # The socket refuses them at the handshake with the same status as the REST API.
    assert await ws_refusal(ws_url, other) == 404
    assert await ws_refusal(ws_url, "nbf_wrong") == 401

    # The owner still gets through.
    sock = await KernelSocket.connect(ws_url, tenant.token)
    try:
        assert (await sock.execute("print(6 * 7)")).stdout == "42\n"
    finally:
        await sock.close()
