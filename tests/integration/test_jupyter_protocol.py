"""What real Jupyter clients (JupyterLab behind ``jupyter server --gateway-url``,
nbclient and papermill through its gateway kernel client, Kernel and Enterprise
Gateway clients) need from nbfleet's kernel protocol, beyond the basics that
``test_gateway`` covers."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from fastapi import FastAPI

from nbfleet.agent.kernel_process import Client, KernelProcess
from nbfleet.agent.runtimes import RuntimeManager
from nbfleet.agent.wire import KernelMessage, parse_client_frame
from nbfleet.control.fleet.frames import open_client_frame
from nbfleet.model.errors import Conflict
from nbfleet.protocol.gpu import BINDING_KEY, CellBinding
from nbfleet.sdk.kernel_socket import KernelSocket
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles
from nbfleet.web.problems import install_problem_handlers, problem
from tests.support.cluster import Cluster, create_running, start_kernel, token_of, wait_state
from tests.support.credit_api import CREDIT, grant, new_tenant

pytestmark = pytest.mark.timeout(180)

HOSTILE_ENV = {"LD_PRELOAD": "/nonexistent/evil.so", "PYTHONSTARTUP": "/nonexistent/x.py",
               "BASH_ENV": "/nonexistent/x.sh", "kernel_lower": "x",
               "KERNEL_HUGE": "x" * 1_000_000,
               **{f"KERNEL_MANY_{i}": "m" for i in range(1000)}}
#: Prints what the kernel's environment holds of the variables above.
SHOW_ENV = ("import os, json; print(json.dumps({k: os.environ.get(k) for k in "
            "['KERNEL_FOO', 'LD_PRELOAD', 'PYTHONSTARTUP', 'BASH_ENV', 'kernel_lower', "
            "'KERNEL_HUGE']} | {'many': sum(k.startswith('KERNEL_MANY_') for k in os.environ)}))")


def header(msg_type: str) -> dict[str, Any]:
    return {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "s",
            "username": "u", "version": "5.3", "date": datetime.now(UTC).isoformat()}


def execute_content(code: str) -> dict[str, Any]:
    return {"code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}


def assert_only_kernel_foo(shown: dict[str, Any]) -> None:
    assert shown["KERNEL_FOO"] == "bar baz"
    assert shown["LD_PRELOAD"] is None and shown["PYTHONSTARTUP"] is None
    assert shown["BASH_ENV"] is None and shown["kernel_lower"] is None
    assert shown["KERNEL_HUGE"] is None
    assert shown["many"] <= 31  # 32 entries at most, KERNEL_FOO among them


# ------------------------------------- buffered output and connections that leave
def unstarted_kernel(tmp_path: Path) -> KernelProcess:
    """A kernel whose relaying is tested without its process: what it says itself
    (``announce``) is buffered and handed over like kernel output."""
    return KernelProcess(uuid.uuid4().hex, "ws_t", "python3", str(tmp_path), {},
                         str(tmp_path / "conn"))


def texts(client: Client) -> list[str]:
    seen = []
    while not client.queue.empty():
        message = client.queue.get_nowait()
        if isinstance(message, KernelMessage):
            seen.append(json.loads(message.content_raw)["text"])
    return seen


@pytest.mark.no_db
async def test_a_connection_that_does_not_stay_leaves_the_buffer_to_the_next(
        tmp_path: Path) -> None:
    kernel = unstarted_kernel(tmp_path)
    kernel.announce("restored: x, y\n")
    kernel.announce("output while away\n")
    brief = kernel.attach()
    assert texts(brief) == ["restored: x, y\n", "output while away\n"]
    kernel.announce("said while only it listened\n")
    kernel.detach(brief)  # closed at once, as jupyter_server's first socket is
    kernel.announce("said with nobody there\n")
    stays = kernel.attach()
    await asyncio.sleep(0.05)
    assert texts(stays) == ["restored: x, y\n", "output while away\n",
                            "said while only it listened\n", "said with nobody there\n"]
    kernel.confirm(stays)  # it stayed: the next connection gets nothing old
    kernel.detach(stays)
    assert texts(kernel.attach()) == []


@pytest.mark.no_db
async def test_output_after_a_reader_is_dropped_waits_for_the_next_one(
        tmp_path: Path) -> None:
    """Found in review: a client dropped for not reading stays attached until its
    connection ends, and counted as the one that took the output, so what came
    next reached nobody."""
    kernel = KernelProcess(uuid.uuid4().hex, "ws_t", "python3", str(tmp_path), {},
                           str(tmp_path / "conn"), output_buffer_bytes=1 << 20)
    stuck = kernel.attach()
    kernel.confirm(stuck)
    for _ in range(3):  # 3 MiB to a client that reads nothing: over its 2 MiB bound
        kernel.announce("x" * (1 << 20))
    assert stuck.closed and stuck in kernel.clients
    kernel.announce("after the drop\n")
    fresh = kernel.attach()
    assert texts(fresh)[-1:] == ["after the drop\n"]


@pytest.mark.no_db
async def test_a_connection_that_stays_a_second_or_speaks_keeps_what_it_was_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbfleet.agent.kernel_process as kernel_process

    monkeypatch.setattr(kernel_process, "CONFIRM_AFTER_S", 0.2)
    kernel = unstarted_kernel(tmp_path)
    kernel.announce("once\n")
    first = kernel.attach()
    await asyncio.sleep(0.4)  # stayed
    assert first.confirmed
    kernel.detach(first)
    assert texts(first) == ["once\n"] and texts(kernel.attach()) == []


@pytest.mark.no_db
async def test_a_probe_is_not_staying_and_a_request_is(tmp_path: Path) -> None:
    """JupyterLab asks for kernel info on every socket it opens, the one it closes
    at once too; a connection that asks for work has stayed."""
    kernel = unstarted_kernel(tmp_path)
    kernel.announce("buffered\n")

    def frame(msg_type: str) -> Any:
        return parse_client_frame(json.dumps({"header": header(msg_type), "content": {}}), None)

    brief = kernel.attach()
    kernel.send_from_client(brief, frame("kernel_info_request"))
    kernel.send_from_client(brief, frame("comm_info_request"))
    assert not brief.confirmed
    kernel.detach(brief)
    worker = kernel.attach()
    assert texts(worker) == ["buffered\n"]
    kernel.send_from_client(worker, frame("execute_request"))
    assert worker.confirmed
    kernel.detach(worker)
    assert texts(kernel.attach()) == []


@pytest.mark.no_db
async def test_overlapping_connections_each_get_what_no_one_that_stayed_has_seen(
        tmp_path: Path) -> None:
    """jupyter_server may open the next socket before the first one is closed."""
    kernel = unstarted_kernel(tmp_path)
    kernel.announce("buffered\n")
    brief = kernel.attach()
    second = kernel.attach()  # attached while the first has not stayed
    kernel.detach(brief)
    kernel.announce("live\n")
    assert texts(second) == ["buffered\n", "live\n"]
    kernel.confirm(second)
    kernel.detach(second)
    assert texts(kernel.attach()) == []


def test_buffered_output_survives_a_connection_closed_at_once(shared_cluster: Cluster) -> None:
    """Through the gateway, as JupyterLab behind jupyter_server connects: a first
    socket opened and closed at once, then the one that stays."""
    client = shared_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    url, token = shared_cluster.channels_url(ws, kernel), token_of(client)

    async def scenario() -> list[str]:
        sock = await KernelSocket.connect(url, token)
        request = sock.message("execute_request", execute_content(
            "import time\ntime.sleep(1.5)\nprint('while away')"), "shell")
        await sock.send(request)
        while (await sock.receive())["msg_type"] != "execute_input":
            pass
        await sock.close()
        await asyncio.sleep(3)  # the cell ends with nobody connected
        for _ in range(2):  # each asks for kernel info, as JupyterLab's sockets do
            brief = await websockets.connect(url, additional_headers={
                "Authorization": f"token {token}"}, open_timeout=30)
            await brief.send(json.dumps({"channel": "shell", "header": header(
                "kernel_info_request"), "parent_header": {}, "metadata": {}, "content": {}}))
            await brief.close()
        sock = await KernelSocket.connect(url, token)
        try:
            result = await sock.collect(request["header"]["msg_id"], timeout=15)
            return [o["content"]["text"] for o in result.outputs if o["msg_type"] == "stream"]
        finally:
            await sock.close()

    assert "while away\n" in asyncio.run(scenario())


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _output_while_away(cluster: Cluster, code: str) -> tuple[list[str], dict[str, Any], float]:
    """Run ``code`` with nobody connected once it started; then connect again and
    collect its output. Also: how much the agent's peak memory grew meanwhile (MiB)."""
    client = cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    url, token = cluster.channels_url(ws, kernel), token_of(client)
    agent_pid = cluster.agents["agent1"].pid

    async def scenario() -> tuple[list[str], dict[str, Any]]:
        sock = await KernelSocket.connect(url, token)
        request = sock.message("execute_request", execute_content(code), "shell")
        await sock.send(request)
        while (await sock.receive())["msg_type"] != "execute_input":
            pass
        await sock.close()
        async with httpx.AsyncClient(base_url=cluster.url, headers={
                "Authorization": f"token {token}"}) as api:
            for _ in range(240):  # until the cell is done, with nobody connected
                await asyncio.sleep(0.5)
                state = (await api.get(f"/v1/workspaces/{ws}/api/kernels/{kernel}")).json()
                if state["execution_state"] == "idle":
                    break
        sock = await KernelSocket.connect(url, token)
        try:
            result = await sock.collect(request["header"]["msg_id"], timeout=60)
        finally:
            await sock.close()
        return ([o["content"]["text"] for o in result.outputs if o["msg_type"] == "stream"],
                result.reply or {})

    before = _peak_rss_kib(agent_pid)
    texts, reply = asyncio.run(scenario())
    return texts, reply, (_peak_rss_kib(agent_pid) - before) / 1024


def test_output_printed_with_no_client_is_kept_up_to_the_bound_and_the_rest_is_said(
        shared_cluster: Cluster) -> None:
    """40 MiB printed while nobody is connected (1 MiB every 0.2 s): the agent keeps
    the newest 16 MiB (--output-buffer), and the next client is told first, in the
    cell's output, how much was dropped; then it gets the rest and the reply."""
    texts, reply, _ = _output_while_away(shared_cluster, (
        "import sys, time\ntime.sleep(1.5)\n"
        "for _ in range(40):\n    sys.stdout.write('x' * ((1 << 20) - 1) + '\\n')\n"
        "    time.sleep(0.2)\nprint('the end')"))
    assert reply.get("status") == "ok", reply
    assert "were dropped while no client was connected" in texts[0], texts[0][:300]
    dropped = re.search(r"\] ([0-9.]+) MiB of output \((\d+) messages\)", texts[0])
    assert dropped is not None and float(dropped[1]) >= 20, texts[0]
    assert texts[-1].endswith("the end\n")
    assert 12 << 20 < sum(len(text) for text in texts[1:]) <= 16 << 20


def test_a_flood_of_output_costs_the_agent_little_memory(shared_cluster: Cluster) -> None:
    """256 MiB printed in a blink with nobody connected: the kernel sends at most
    2 MiB of each flush (and says what it cut), so the agent never holds the flood:
    before, it held all of it, and its peak grew by twice the output."""
    texts, reply, grown_mib = _output_while_away(shared_cluster, (
        "import sys, time\ntime.sleep(1.5)\nline = 'x' * 65535 + '\\n'\n"
        "for _ in range(4096):\n    sys.stdout.write(line)\nprint('the end')"))
    assert reply.get("status") == "ok", reply
    assert any(re.match(r"\[nbfleet\] [0-9.]+ MiB of output were cut here", t)
               for t in texts), [t[:100] for t in texts]
    assert "".join(texts).endswith("the end\n")
    assert grown_mib < 64, f"the agent's peak memory grew {grown_mib:.0f} MiB"


# ----------------------------------------------------------------- restarts
def test_a_requested_restart_sends_no_restarting_status(shared_cluster: Cluster) -> None:
    """jupyter_server sends ``restarting`` only when its auto-restarter brings back
    a kernel that died; JupyterLab shows "the kernel appears to have died" for it.
    (A death still says so: test_kernel_process.)"""
    client = shared_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    url, token = shared_cluster.channels_url(ws, kernel), token_of(client)

    async def scenario() -> tuple[list[str], str]:
        sock = await KernelSocket.connect(url, token)
        try:
            await sock.execute("x = 1")
            restarted = await asyncio.to_thread(
                client.post, f"/v1/workspaces/{ws}/api/kernels/{kernel}/restart")
            assert restarted.status_code == 200, restarted.text
            probe = sock.message("execute_request", execute_content(
                "print('x' in dir())"), "shell")
            await sock.send(probe)
            states, out = [], ""
            while True:  # every status since the restart, up to the probe's idle
                msg = await sock.receive(30)
                if msg["msg_type"] == "status":
                    states.append(msg["content"]["execution_state"])
                    if (msg["parent_header"].get("msg_id") == probe["header"]["msg_id"]
                            and states[-1] == "idle"):
                        return states, out
                elif msg["msg_type"] == "stream":
                    out += msg["content"]["text"]
        finally:
            await sock.close()

    states, out = asyncio.run(scenario())
    assert out == "False\n"  # it did restart
    assert "restarting" not in states and "dead" not in states


# --------------------------------------------------- frames without a channel
async def execute_without_channel(url: str, token: str, code: str) -> tuple[dict[str, Any], str]:
    """An execute_request as jupyter_server's gateway kernel client sends it: no
    ``channel``. Returns its reply and its output."""
    async with websockets.connect(url, additional_headers={
            "Authorization": f"token {token}"}, open_timeout=30) as sock:
        request = {"header": header("execute_request"), "parent_header": {},
                   "metadata": {}, "content": execute_content(code)}
        await sock.send(json.dumps(request))
        reply: dict[str, Any] | None = None
        out = ""
        while reply is None:
            msg = json.loads(await asyncio.wait_for(sock.recv(), 60))
            if msg["parent_header"].get("msg_id") != request["header"]["msg_id"]:
                continue
            if msg["msg_type"] == "stream":
                out += msg["content"]["text"]
            if msg["msg_type"] == "execute_reply":
                assert msg["channel"] == "shell"
                reply = msg["content"]
        return reply, out


def test_a_frame_without_a_channel_is_a_shell_request(shared_cluster: Cluster) -> None:
    """jupyter_server's gateway kernel client (nbclient, papermill) sends no
    ``channel``; jupyter_server takes that as shell."""
    client = shared_cluster.new_user()
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    reply, out = asyncio.run(execute_without_channel(
        shared_cluster.channels_url(ws, kernel), token_of(client), "print(6 * 7)"))
    assert reply["status"] == "ok" and out == "42\n"


def test_a_gpu_cell_without_a_channel_gets_its_gpu(shared_cluster: Cluster) -> None:
    """The same through a GPU workspace's cell gate, which holds the cell for its
    GPU and writes the binding before the agent sees it."""
    tenant = new_tenant(shared_cluster)
    grant(shared_cluster, tenant, 1000 * CREDIT)
    client = tenant.client
    created = client.post("/v1/workspaces", json={
        "name": "gpu", "resources": {"gpus": 1, "gpu_types": ["A100-80GB"]}})
    assert created.status_code == 201, created.text
    ws = created.json()["id"]
    try:
        wait_state(client, ws, "running")
        kernel = start_kernel(client, ws)
        reply, out = asyncio.run(execute_without_channel(
            shared_cluster.channels_url(ws, kernel), token_of(client),
            "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"))
        assert reply["status"] == "ok", reply
        assert out.strip() not in ("", "unset"), out  # it ran bound to a GPU
    finally:
        client.delete(f"/v1/workspaces/{ws}")
        wait_state(client, ws, "deleted")


@pytest.mark.no_db
def test_the_gpu_gate_reads_a_frame_without_a_channel_as_shell() -> None:
    frame = json.dumps({"header": header("execute_request"), "parent_header": {},
                        "metadata": {BINDING_KEY: {"forged": True}},
                        "content": execute_content("1")})
    request = open_client_frame(frame, None)
    assert request is not None
    assert (request.channel, request.msg_type) == ("shell", "execute_request")
    cell = CellBinding(task_id="k/m", host_id="h", gpu_indices=(0,), gpu_type="A100-80GB")
    forwarded = json.loads(request.with_binding(cell))
    assert forwarded["channel"] == "shell"  # the agent gets it named
    assert forwarded["metadata"][BINDING_KEY]["task_id"] == "k/m"
    empty = open_client_frame(json.dumps({"channel": "", "header": header("execute_request")}),
                              None)
    assert empty is not None and empty.channel == ""  # not gated; the agent refuses it


# ------------------------------------------------------------ KERNEL_* env
def test_kernel_variables_of_a_start_request_reach_the_kernel(shared_cluster: Cluster) -> None:
    """As Kernel Gateway and Enterprise Gateway clients send them; nothing else does."""
    client = shared_cluster.new_user()
    ws = create_running(client)
    created = client.post(f"/v1/workspaces/{ws}/api/kernels", json={
        "name": "python3", "env": {"KERNEL_FOO": "bar baz", **HOSTILE_ENV}})
    assert created.status_code == 201, created.text
    url = shared_cluster.channels_url(ws, created.json()["id"])

    async def scenario() -> str:
        sock = await KernelSocket.connect(url, token_of(client))
        try:
            return (await sock.execute(SHOW_ENV)).stdout
        finally:
            await sock.close()

    assert_only_kernel_foo(json.loads(asyncio.run(scenario())))


@pytest.fixture
async def warm_manager(tmp_path: Path) -> AsyncIterator[RuntimeManager]:
    sockets = tempfile.mkdtemp(prefix="nbf-", dir="/tmp")  # IPC paths must stay short
    runtimes = RuntimeManager(str(tmp_path / "agent"),
                              WorkspaceFiles(BlobStore(str(tmp_path / "blobs"))), sockets,
                              warm_pool=1)
    runtimes.pool.refill_delay_s = 0.0
    runtimes.pool.start()
    yield runtimes
    await runtimes.shutdown()
    shutil.rmtree(sockets, ignore_errors=True)


async def run_cell(kernel: KernelProcess, code: str) -> str:
    client = kernel.attach()
    try:
        request = parse_client_frame(json.dumps({
            "channel": "shell", "header": header("execute_request"), "parent_header": {},
            "metadata": {}, "content": execute_content(code)}), None)
        msg_id = request.msg_id
        kernel.send_from_client(client, request)
        out = ""
        # Until the reply and the idle status: the reply comes on the shell channel,
        # the output on iopub, and nothing orders the two (the kernel's idle status
        # follows its output on iopub).
        replied = idle = False
        while not (replied and idle):
            message = await asyncio.wait_for(client.queue.get(), 60)
            assert message is not None
            msg = json.loads(message.legacy_frame())
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out += msg["content"]["text"]
            elif msg["msg_type"] == "status":
                idle = idle or msg["content"]["execution_state"] == "idle"
            elif msg["msg_type"] == "execute_reply":
                assert msg["content"]["status"] == "ok", msg["content"]
                replied = True
        return out
    finally:
        kernel.detach(client)


@pytest.mark.no_db
async def test_kernel_variables_reach_warm_and_cold_kernels_and_survive_a_restart(
        warm_manager: RuntimeManager) -> None:
    """The agent filters again (defense in depth): a hostile env handed straight to
    it reaches no kernel, claimed from the warm pool or started cold.

    A kernel claimed from the warm pool is active from its claim, not from the
    pool's start: it is never older than its workspace."""
    runtimes = warm_manager
    for _ in range(600):
        if runtimes.pool.ready:
            break
        await asyncio.sleep(0.1)
    assert runtimes.pool.ready, "no warm kernel came up"
    await asyncio.sleep(1.5)  # the warm kernel ages in the pool
    await runtimes.ensure("ws_env", 1, [])
    env = {"KERNEL_FOO": "bar baz", **HOSTILE_ENV}
    claimed_at = datetime.now(UTC)
    warm = await runtimes.add_kernel("ws_env", 1, "k_warm", "python3", env=dict(env))
    assert runtimes.pool.hits == 1 and warm.id == "k_warm"
    assert warm.last_activity >= claimed_at
    assert warm.model().idle_s < 1.0
    assert_only_kernel_foo(json.loads(await run_cell(warm, SHOW_ENV)))
    await warm.restart()
    assert_only_kernel_foo(json.loads(await run_cell(warm, SHOW_ENV)))

    cold = await runtimes.add_kernel("ws_env", 1, "k_cold", "python3", env=dict(env))
    assert runtimes.pool.hits == 1  # the runtime had a kernel: started cold
    assert_only_kernel_foo(json.loads(await run_cell(cold, SHOW_ENV)))
    assert "KERNEL_FOO" not in json.loads(await run_cell(
        await runtimes.add_kernel("ws_env", 1, "k_plain", "python3"),
        "import os, json; print(json.dumps(dict(os.environ)))"))


# ------------------------------------------------------------ error bodies
@pytest.mark.no_db
async def test_problems_carry_message_and_reason_for_jupyter_server() -> None:
    """jupyter_server's gateway client reads only ``message`` and ``reason``."""
    app = FastAPI()
    install_problem_handlers(app)

    @app.get("/conflict")
    async def conflict() -> None:
        raise Conflict("the workspace is suspended; resume it first", current_state="x")

    @app.get("/needs/{number}")
    async def needs(number: int) -> None:
        return None

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = (await http.get("/conflict")).json()
        assert body == {"type": "https://nbfleet.dev/problems/conflict", "title": "Conflict",
                        "status": 409, "detail": "the workspace is suspended; resume it first",
                        "instance": "/conflict", "current_state": "x",
                        "message": "the workspace is suspended; resume it first",
                        "reason": "Conflict"}
        invalid = (await http.get("/needs/x")).json()
        assert invalid["message"] == invalid["detail"] and invalid["reason"] == invalid["title"]
        missing = (await http.get("/nowhere")).json()
        assert (missing["status"], missing["reason"]) == (404, "Not found")


@pytest.mark.no_db
def test_a_problems_own_reason_is_kept() -> None:
    body = json.loads(bytes(problem(402, "Payment required", "over budget",
                                    reason="budget_exceeded").body))
    assert body["reason"] == "budget_exceeded" and body["message"] == "over budget"
