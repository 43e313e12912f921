"""The kernel gateway as a Jupyter client sees it."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from datetime import datetime

import httpx
import pytest

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.support.cluster import Cluster, create_running, start_kernel, token_of

JUPYTER_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


@dataclass
class LiveKernel:
    client: httpx.Client
    workspace: str
    kernel: str
    token: str
    url: str


@pytest.fixture
def live_kernel(shared_cluster: Cluster) -> LiveKernel:
    """A new user with a running workspace and a kernel in it."""
    client = shared_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    return LiveKernel(client, ws, kernel, token_of(client), shared_cluster.channels_url(ws, kernel))


def test_kernel_model_matches_jupyter_server(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = create_running(client)
    specs = client.get(f"/v1/workspaces/{ws}/api/kernelspecs").json()
    assert specs["default"] == "python3"
    assert specs["kernelspecs"]["python3"]["spec"]["language"] == "python"
    assert client.get(f"/v1/workspaces/{ws}/api/kernelspecs/python3").json()["name"] == "python3"
    assert client.get(f"/v1/workspaces/{ws}/api/kernelspecs/cobol").status_code == 404

    created = client.post(f"/v1/workspaces/{ws}/api/kernels", json={"name": "python3"})
    assert created.status_code == 201
    model = created.json()
    assert set(model) == {"id", "name", "last_activity", "execution_state", "connections"}
    uuid_shape = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert re.fullmatch(uuid_shape, model["id"])
    datetime.strptime(model["last_activity"], JUPYTER_TIME)
    assert model["execution_state"] == "idle" and model["connections"] == 0
    assert created.headers["location"].endswith(f"/api/kernels/{model['id']}")
    assert client.post(f"/v1/workspaces/{ws}/api/kernels",
                       json={"name": "cobol"}).status_code == 422

    listed = client.get(f"/v1/workspaces/{ws}/api/kernels").json()
    assert [k["id"] for k in listed] == [model["id"]]
    assert client.delete(f"/v1/workspaces/{ws}/api/kernels/{model['id']}").status_code == 204
    assert client.get(f"/v1/workspaces/{ws}/api/kernels/{model['id']}").status_code == 404
    assert client.get(f"/v1/workspaces/{ws}/api/kernels").json() == []


def test_output_produced_while_disconnected_is_delivered_on_reconnect(
    live_kernel: LiveKernel,
) -> None:
    token, url = live_kernel.token, live_kernel.url

    async def scenario() -> list[str]:
        sock = await KernelSocket.connect(url, token)
        request = sock.message("execute_request", {
            "code": "import time\nprint('before')\ntime.sleep(1.5)\nprint('while away')",
            "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}, "shell")
        await sock.send(request)
        while True:  # leave as soon as the cell is running
            msg = await sock.receive()
            if msg["msg_type"] == "execute_input":
                break
        await sock.close()
        await asyncio.sleep(3)  # the cell finishes with nobody connected
        sock = await KernelSocket.connect(url, token)
        try:
            result = await sock.collect(request["header"]["msg_id"], timeout=10)
            assert result.status == "ok"
            return [o["content"]["text"] for o in result.outputs if o["msg_type"] == "stream"]
        finally:
            await sock.close()

    texts = "".join(asyncio.run(scenario()))
    assert "while away" in texts


def test_two_clients_share_a_kernel_and_replies_go_to_the_asker(live_kernel: LiveKernel) -> None:
    client, ws, kernel = live_kernel.client, live_kernel.workspace, live_kernel.kernel
    token, url = live_kernel.token, live_kernel.url

    async def scenario() -> tuple[str, int]:
        first = await KernelSocket.connect(url, token)
        second = await KernelSocket.connect(url, token)
        try:
            await asyncio.sleep(0.2)
            model = client.get(f"/v1/workspaces/{ws}/api/kernels/{kernel}").json()
            result = await first.execute("shared = 'yes'; print(shared)")
            seen = await second.execute("print(shared)")
            return result.stdout + seen.stdout, model["connections"]
        finally:
            await first.close()
            await second.close()

    output, connections = asyncio.run(scenario())
    assert output == "yes\nyes\n"
    assert connections == 2


def test_v1_subprotocol_is_negotiated_end_to_end(live_kernel: LiveKernel) -> None:
    token, url = live_kernel.token, live_kernel.url

    async def scenario() -> tuple[bool, str, bool, str]:
        binary = await KernelSocket.connect(url, token, v1=True)
        legacy = await KernelSocket.connect(url, token)
        try:
            v1_result = await binary.execute("both = 'ok'; print(both)")
            legacy_result = await legacy.execute("print(both)")
            return binary.v1, v1_result.stdout, legacy.v1, legacy_result.stdout
        finally:
            await binary.close()
            await legacy.close()

    assert asyncio.run(scenario()) == (True, "ok\n", False, "ok\n")


def test_no_kernel_starts_in_a_workspace_being_deleted(shared_cluster: Cluster) -> None:
    """A suspended workspace is resumed by a kernel start (test_kernel_identity); a
    deleted one is not brought back by it."""
    client = shared_cluster.new_user()
    ws = create_running(client)
    client.delete(f"/v1/workspaces/{ws}")
    refused = client.post(f"/v1/workspaces/{ws}/api/kernels", json={})
    assert refused.status_code == 404
    assert client.get(f"/v1/workspaces/{ws}").json()["desired_state"] == "deleted"


def test_bad_frames_do_not_break_the_socket(live_kernel: LiveKernel) -> None:

    async def scenario() -> str:
        sock = await KernelSocket.connect(live_kernel.url, live_kernel.token)
        try:
            await sock.connection.send("{not json")
            await sock.connection.send('{"channel": "iopub", "header": {"msg_id": "x"}}')
            await sock.connection.send('{"channel": "shell", "header": {}}')
            await sock.connection.send(b"\x00\x01")
            return (await sock.execute("print('still fine')")).stdout
        finally:
            await sock.close()

    assert asyncio.run(scenario()) == "still fine\n"
