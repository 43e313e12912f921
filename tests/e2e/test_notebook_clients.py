"""Unpatched notebook clients run notebooks in an nbfleet workspace.

papermill and nbclient execute a notebook through jupyter_server's gateway kernel
client (``GatewayKernelManager`` / ``GatewayKernelClient``), configured only the way
their users configure it: ``JUPYTER_GATEWAY_*`` environment variables. Each runs
against both of a workspace's Jupyter surfaces: the Kernel Gateway API at
``/v1/workspaces/{id}`` and nbfleet's own Lab server at ``/w/{id}``. They run as
subprocesses: ``GatewayClient`` is a process-wide singleton read from the
environment once.

A client in the style of Enterprise Gateway's (raw HTTP and WebSocket) checks the
two liberties such clients take: a kernel-start body without a Content-Type, and
frames without a ``channel`` key.

jupyter_server's ``GatewayKernelClient.start_channels`` (2.21.1) opens the channels
WebSocket with no credentials at all: no Authorization header, no cookie, and a URL
built as ``ws_url + kernels_endpoint + {id}/channels`` that no setting can add a
``?token=`` to. Its REST calls carry ``JUPYTER_GATEWAY_AUTH_TOKEN``; its WebSocket
goes to ``JUPYTER_GATEWAY_WS_URL``, set to a channel ticket's URL
(``POST /v1/workspaces/{id}/channel-tickets``): a setting, not a patch.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
import websockets
from nbformat.v4 import new_code_cell, new_notebook

from tests.e2e.conftest import _isolated_env, attach_log
from tests.support.cluster import Cluster, create_running, token_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.db_agnostic]

#: The two places a workspace serves Jupyter's kernel API.
GATEWAYS = {"kernel-gateway": "/v1/workspaces/{id}", "lab-server": "/w/{id}"}
GATEWAY_MANAGER = "jupyter_server.gateway.managers.GatewayKernelManager"
KERNEL_USERNAME = "notebook-client"
CLIENT_TIMEOUT_S = 240

CELLS = [
    "x = 20\nmarker = open('marker.txt').read().strip()",
    "y = x * 2 + 2\nprint('y =', y)",
    "import pandas as pd\npd.DataFrame({'name': ['x', 'y'], 'value': [x, y]})",
    "import sys\nprint('careful:', y, file=sys.stderr)",
    "import os\nprint(marker, os.environ.get('KERNEL_USERNAME'))",
]

#: Runs in a subprocess: ``tool source target``; the gateway comes from the
#: environment (JUPYTER_GATEWAY_URL, JUPYTER_GATEWAY_AUTH_TOKEN).
RUNNER = f"""
import sys

import nbformat

tool, source, target = sys.argv[1:4]
if tool == "papermill":
    import papermill

    papermill.execute_notebook(source, target, kernel_name="python3",
                               kernel_manager_class={GATEWAY_MANAGER!r},
                               progress_bar=False, start_timeout=120, execution_timeout=120)
else:
    from jupyter_server.gateway.managers import GatewayKernelManager
    from nbclient import NotebookClient

    notebook = nbformat.read(source, as_version=4)
    NotebookClient(notebook, kernel_name="python3", kernel_manager_class=GatewayKernelManager,
                   timeout=120, startup_timeout=120).execute()
    nbformat.write(notebook, target)
"""


@dataclass(frozen=True)
class Tenant:
    client: httpx.Client
    token: str
    workspace_id: str
    #: The content of ``marker.txt``, a file only the workspace has.
    marker: str

    def base(self, gateway: str) -> str:
        return GATEWAYS[gateway].format(id=self.workspace_id)

    def kernel_ids(self) -> list[str]:
        response = self.client.get(f"/v1/workspaces/{self.workspace_id}/api/kernels")
        response.raise_for_status()
        return [k["id"] for k in response.json()]


@pytest.fixture(scope="module")
def tenant(shared_cluster: Cluster) -> Tenant:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    marker = f"only-in-{workspace_id}-{uuid.uuid4().hex[:8]}"
    response = client.put(f"/v1/workspaces/{workspace_id}/files/marker.txt",
                          content=marker.encode())
    assert response.status_code == 200, response.text
    return Tenant(client, token_of(client), workspace_id, marker)


@pytest.fixture(autouse=True)
def cluster_logs(shared_cluster: Cluster, request: pytest.FixtureRequest) -> None:
    for name in ("control", "agent1"):
        attach_log(request, shared_cluster.logs / f"{name}.log")


def write_notebook(path: Path) -> None:
    cells = [new_code_cell(source) for source in CELLS]  # type: ignore[no-untyped-call]
    notebook = new_notebook(cells=cells)  # type: ignore[no-untyped-call]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, str(path))  # type: ignore[no-untyped-call]


def run_client(tool: str, gateway_url: str, token: str, workdir: Path,
               ws_url: str) -> Any:
    """Run ``tool`` on the demo notebook against ``gateway_url``; the executed notebook.

    Its working directory has no ``marker.txt``: a notebook that ran in a local
    kernel instead of nbfleet's fails on the first cell."""
    workdir.mkdir(parents=True)
    source, target = workdir / "in.ipynb", workdir / "out.ipynb"
    write_notebook(source)
    env = {k: v for k, v in _isolated_env(workdir / "jupyter").items()
           if not k.startswith("KERNEL_")}
    # The token goes in the environment, never on a command line.
    env.update(JUPYTER_GATEWAY_URL=gateway_url, JUPYTER_GATEWAY_AUTH_TOKEN=token,
               JUPYTER_GATEWAY_AUTH_SCHEME="token", JUPYTER_GATEWAY_REQUEST_TIMEOUT="60",
               JUPYTER_GATEWAY_WS_URL=ws_url, KERNEL_USERNAME=KERNEL_USERNAME)
    done = subprocess.run([sys.executable, "-c", RUNNER, tool, str(source), str(target)],
                          cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=CLIENT_TIMEOUT_S, check=False)
    code, output = done.returncode, done.stdout + done.stderr
    assert code == 0, (f"{tool} failed against {gateway_url}: {first_error(output)}\n"
                       f"{output[-6000:]}")
    return nbformat.read(str(target), as_version=4)  # type: ignore[no-untyped-call]


def first_error(output: str) -> str:
    """The first exception a traceback names (its tail often shows only the cleanup's)."""
    found = re.search(r"^[\w.]*(?:Error|Exception)\b.*$", output, re.MULTILINE)
    return found.group(0)[:1000] if found else "(no exception named)"


def streams(cell: Any, name: str) -> str:
    return "".join(o["text"] for o in cell.outputs
                   if o["output_type"] == "stream" and o["name"] == name)


@pytest.mark.parametrize("gateway", sorted(GATEWAYS))
@pytest.mark.parametrize("tool", ["papermill", "nbclient"])
def test_notebook_client_runs_a_notebook_in_the_workspace(
    shared_cluster: Cluster, tenant: Tenant, tool: str, gateway: str, tmp_path: Path
) -> None:
    gateway_url = shared_cluster.url + tenant.base(gateway)
    before = tenant.kernel_ids()
    ticket = tenant.client.post(f"/v1/workspaces/{tenant.workspace_id}/channel-tickets")
    assert ticket.status_code == 201, ticket.text
    ws_url = ticket.json()["lab_ws_url" if gateway == "lab-server" else "ws_url"]
    executed = run_client(tool, gateway_url, tenant.token, tmp_path / "run", ws_url)

    cells = executed.cells
    assert [c.source for c in cells] == CELLS
    assert not [o for c in cells for o in c.outputs if o["output_type"] == "error"]
    assert [c.execution_count for c in cells] == [1, 2, 3, 4, 5]
    # A variable defined in one cell is used in the next, which prints.
    assert cells[0].outputs == []
    assert streams(cells[1], "stdout") == "y = 42\n"
    # The rich output: a DataFrame, as HTML and as text.
    [result] = [o for o in cells[2].outputs if o["output_type"] == "execute_result"]
    assert result["data"].keys() >= {"text/html", "text/plain"}, result["data"]
    html = result["data"]["text/html"]
    assert "<table" in html and "<td>42</td>" in html, html
    assert "42" in result["data"]["text/plain"]
    # stderr is kept apart from stdout.
    assert streams(cells[3], "stderr") == "careful: 42\n"
    assert streams(cells[3], "stdout") == ""
    # It ran in this workspace (only it has the marker file), and the start request's
    # KERNEL_* variables reached the kernel.
    assert streams(cells[4], "stdout") == f"{tenant.marker} {KERNEL_USERNAME}\n"
    # The client shut its kernel down when it was done.
    assert tenant.kernel_ids() == before


# --------------------------------------------------- an Enterprise Gateway-style client


def frame(msg_type: str, content: dict[str, Any], session: str) -> dict[str, Any]:
    """A Jupyter message as Enterprise Gateway's clients send it: no ``channel``."""
    return {
        "header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": session,
                   "username": "alice", "version": "5.3",
                   "date": datetime.now(UTC).isoformat()},
        "parent_header": {}, "metadata": {}, "content": content, "buffers": [],
    }


async def execute_without_channel(url: str, token: str, code: str,
                                  expressions: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Send one execute_request without a ``channel`` key; its reply and its stdout."""
    async with websockets.connect(url, additional_headers={"Authorization": f"token {token}"},
                                  open_timeout=30, max_size=None) as sock:
        request = frame("execute_request", {
            "code": code, "silent": False, "store_history": True,
            "user_expressions": expressions, "allow_stdin": False, "stop_on_error": True,
        }, uuid.uuid4().hex)
        assert "channel" not in request
        await sock.send(json.dumps(request))
        msg_id = request["header"]["msg_id"]
        stdout, reply, idle = "", None, False
        while reply is None or not idle:
            msg = json.loads(await asyncio.wait_for(sock.recv(), 60))
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "execute_reply":
                assert msg.get("channel") == "shell", msg
                reply = msg["content"]
            elif msg["msg_type"] == "status":
                idle = msg["content"]["execution_state"] == "idle"
            elif msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                stdout += msg["content"]["text"]
        return reply, stdout


@pytest.mark.parametrize("gateway", sorted(GATEWAYS))
async def test_enterprise_gateway_style_client(shared_cluster: Cluster, tenant: Tenant,
                                               gateway: str) -> None:
    api = f"{shared_cluster.url}{tenant.base(gateway)}/api"
    auth = {"Authorization": f"token {tenant.token}"}
    body = json.dumps({"name": "python3",
                       "env": {"KERNEL_USERNAME": "alice", "LD_PRELOAD": "/evil.so"}})
    async with httpx.AsyncClient(timeout=60.0) as http:
        # Raw bytes: httpx adds no Content-Type, as Enterprise Gateway's client sends none.
        start = http.build_request("POST", f"{api}/kernels", content=body.encode(),
                                   headers=auth)
        assert "content-type" not in start.headers
        started = await http.send(start)
        assert started.status_code == 201, started.text
        kernel = started.json()
        assert kernel["name"] == "python3", kernel
        kernel_id = kernel["id"]
        try:
            assert kernel_id in tenant.kernel_ids()
            ws_url = f"{api}/kernels/{kernel_id}/channels".replace("http", "ws", 1)
            code = ("import os\n"
                    "print(repr(os.environ.get('KERNEL_USERNAME')), "
                    "repr(os.environ.get('LD_PRELOAD')))")
            reply, stdout = await execute_without_channel(
                ws_url, tenant.token, code,
                {"user": "os.environ.get('KERNEL_USERNAME')",
                 "preload": "'LD_PRELOAD' in os.environ"})
            assert reply["status"] == "ok", reply
            assert stdout == "'alice' None\n"
            expressions = {name: value["data"]["text/plain"]
                           for name, value in reply["user_expressions"].items()}
            assert expressions == {"user": "'alice'", "preload": "False"}
            # The LD_PRELOAD named in the request reached no process of the kernel's either.
            reply, stdout = await execute_without_channel(
                ws_url, tenant.token,
                "import subprocess\nprint(subprocess.run(['env'], capture_output=True, "
                "text=True).stdout.count('LD_PRELOAD=/evil.so'))", {})
            assert reply["status"] == "ok" and stdout == "0\n", (reply, stdout)
        finally:
            deleted = await http.delete(f"{api}/kernels/{kernel_id}", headers=auth)
            assert deleted.status_code == 204, deleted.text
        assert kernel_id not in tenant.kernel_ids()

