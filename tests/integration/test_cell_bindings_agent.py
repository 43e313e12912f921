"""Per-cell GPU binding through the agent and a real ipykernel with nbfleet's extension.

The agent forwards a cell's binding, remembers it until the cell's reply (or the
kernel's death, restart, suspend or release), lists it on ``GET /bindings`` and
reports its end; the kernel exposes the GPUs to the cell and its subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import types
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from nbfleet.agent.app import create_agent_app
from nbfleet.agent.kernel_process import Client, KernelProcess
from nbfleet.agent.runtimes import RuntimeManager
from nbfleet.agent.service import AgentConfig, AgentService, ControlReporter
from nbfleet.agent.slots import kernel_env
from nbfleet.agent.statesync import SuspendOptions
from nbfleet.agent.wire import V1_PROTOCOL, ClientMessage, parse_client_frame
from nbfleet.protocol.gpu import BINDING_KEY, AgentBindings
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles

#: Runs no DB: the PostgreSQL pass of `make test` skips it.
pytestmark = [pytest.mark.no_db, pytest.mark.timeout(180)]

SECRET = "cluster-secret-for-tests"


def binding(task_id: str, *indices: int) -> dict[str, Any]:
    return {BINDING_KEY: {"task_id": task_id, "host_id": "host_a",
                          "gpu_indices": list(indices), "gpu_type": "A100-80GB"}}


def bound(kernel: KernelProcess, code: str, *indices: int,
          protocol: str | None = None) -> ClientMessage:
    """An execute_request bound as the control plane binds it: its task id is
    ``{kernel id}/{msg_id}``."""
    msg_id = uuid.uuid4().hex
    return execute_request(code, binding(f"{kernel.id}/{msg_id}", *indices), protocol, msg_id)


def task_of(kernel: KernelProcess, request: ClientMessage) -> str:
    return f"{kernel.id}/{request.msg_id}"


def execute_request(code: str, metadata: dict[str, Any] | None = None,
                    protocol: str | None = None, msg_id: str | None = None) -> ClientMessage:
    header = {"msg_id": msg_id or uuid.uuid4().hex, "msg_type": "execute_request", "session": "t",
              "username": "t", "version": "5.3", "date": "2026-01-01T00:00:00Z"}
    content = {"code": code, "silent": False, "store_history": True,
               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
    if protocol == V1_PROTOCOL:
        from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1

        parts = [json.dumps(p).encode() for p in (header, {}, metadata or {}, content)]
        return parse_client_frame(serialize_msg_to_ws_v1(parts, "shell"), V1_PROTOCOL)
    return parse_client_frame(json.dumps({
        "channel": "shell", "header": header, "parent_header": {},
        "metadata": metadata or {}, "content": content,
    }), None)


async def run(kernel: KernelProcess, client: Client, request: ClientMessage,
              settle_s: float = 0.0) -> tuple[dict[str, Any], str]:
    """Send ``request``; (its execute_reply content, its stdout and stderr). Output
    that follows the reply (a subprocess's, relayed from its fd) is collected for
    ``settle_s`` more seconds."""
    kernel.send_from_client(client, request)
    reply: dict[str, Any] | None = None
    out: list[str] = []
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    while deadline is None or loop.time() < deadline:
        try:
            message = await asyncio.wait_for(client.queue.get(),
                                             60 if deadline is None else deadline - loop.time())
        except TimeoutError:
            break
        assert message is not None
        msg = json.loads(message.legacy_frame())
        if msg["parent_header"].get("msg_id") != request.msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "execute_reply":
            reply = msg["content"]
            deadline = loop.time() + settle_s
    assert reply is not None
    return reply, "".join(out)


async def until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[KernelProcess]:
    workdir = tmp_path / "files"
    workdir.mkdir()
    process = KernelProcess(str(uuid.uuid4()), "ws_test", "python3", str(workdir),
                            kernel_env(str(tmp_path)), str(tmp_path / "conn"),
                            extra_arguments=("--ext", "nbfleet.kernel"))
    process.released = []  # type: ignore[attr-defined]
    process.bindings.on_release = process.released.extend  # type: ignore[attr-defined]
    await process.start()
    yield process
    await process.shutdown()


def released(kernel: KernelProcess) -> list[str]:
    return cast(list[str], kernel.released)  # type: ignore[attr-defined]


def agent_app(kernels: dict[str, KernelProcess]) -> httpx.AsyncClient:
    """The agent's real routes over a stand-in service that only holds kernels."""
    service = types.SimpleNamespace(config=types.SimpleNamespace(secret=SECRET),
                                    runtimes=types.SimpleNamespace(kernels=kernels, runtimes={}))
    app = create_agent_app(cast(AgentService, service))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")


@pytest.mark.parametrize("protocol", [None, V1_PROTOCOL])
async def test_a_bound_cell_and_its_subprocess_see_their_gpus(
    kernel: KernelProcess, protocol: str | None
) -> None:
    client = kernel.attach(protocol)
    request = bound(
        kernel, "import os, subprocess\n"
        "print('cell', os.environ['CUDA_VISIBLE_DEVICES'], os.environ['NVIDIA_VISIBLE_DEVICES'])\n"
        "print('captured', subprocess.run(['sh', '-c', 'echo $CUDA_VISIBLE_DEVICES'],"
        " capture_output=True, text=True).stdout.strip())\n"
        "subprocess.run(['sh', '-c', 'echo raw $CUDA_VISIBLE_DEVICES'])\n",
        1, 3, protocol=protocol)
    reply, out = await run(kernel, client, request, settle_s=1.0)
    assert reply["status"] == "ok", out
    assert "cell 1,3 1,3\n" in out and "captured 1,3\n" in out
    assert "raw 1,3\n" in out  # the subprocess's own stdout, relayed by ipykernel
    assert released(kernel) == [task_of(kernel, request)] and len(kernel.bindings) == 0
    # Put back after the cell: the next, unbound, cell sees the kernel's own value.
    reply, out = await run(kernel, client, execute_request(
        "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"))
    assert out == "None\n"


async def test_a_binding_is_listed_while_its_cell_runs_and_reported_after(
    kernel: KernelProcess
) -> None:
    client = kernel.attach()
    request = bound(
        kernel, "import time\nfrom nbfleet.kernel import current_binding\n"
        "print(current_binding().task_id, current_binding().gpu_indices)\ntime.sleep(2)", 0)
    task = task_of(kernel, request)
    async with agent_app({kernel.id: kernel}) as http:
        kernel.send_from_client(client, request)
        await asyncio.sleep(0.5)
        response = await http.get("/agent/v1/bindings",
                                  headers={"Authorization": f"Bearer {SECRET}"})
        assert response.status_code == 200
        listed = AgentBindings.model_validate(response.json()).bindings
        assert [(a.kernel_id, a.msg_id, a.binding.task_id, a.binding.gpu_indices)
                for a in listed] == [(kernel.id, request.msg_id, task, (0,))]
        assert 0.3 < listed[0].age_s < 30
        assert released(kernel) == []
        assert (await http.get("/agent/v1/bindings")).status_code == 401
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["msg_type"] != "execute_reply":
            message = await asyncio.wait_for(client.queue.get(), 30)
            assert message is not None
            frames.append(json.loads(message.legacy_frame()))
        assert any(f["msg_type"] == "stream" and f["content"]["text"] == f"{task} (0,)\n"
                   for f in frames)
        assert released(kernel) == [task]
        response = await http.get("/agent/v1/bindings",
                                  headers={"Authorization": f"Bearer {SECRET}"})
        assert response.json() == {"bindings": []}


async def test_a_kernel_killed_mid_cell_releases_its_binding(kernel: KernelProcess) -> None:
    client = kernel.attach()
    request = bound(kernel, "import time; time.sleep(60)", 2)
    kernel.send_from_client(client, request)
    await until(lambda: kernel.execution_state == "busy")
    assert len(kernel.bindings) == 1
    os.kill(kernel.manager.provisioner.pid, signal.SIGKILL)  # type: ignore[union-attr]
    await until(lambda: released(kernel) == [task_of(kernel, request)])
    assert len(kernel.bindings) == 0


async def test_a_restart_mid_cell_releases_its_binding(kernel: KernelProcess) -> None:
    client = kernel.attach()
    request = bound(kernel, "import time; time.sleep(60)", 2)
    kernel.send_from_client(client, request)
    await until(lambda: kernel.execution_state == "busy")
    await kernel.restart()
    assert released(kernel) == [task_of(kernel, request)] and len(kernel.bindings) == 0


async def test_cells_without_a_binding_leave_nothing_tracked(kernel: KernelProcess) -> None:
    client = kernel.attach()
    reply, out = await run(kernel, client, execute_request(
        "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))", {"cellId": "c1"}))
    assert reply["status"] == "ok" and out == "None\n"
    assert len(kernel.bindings) == 0 and released(kernel) == []


@pytest.mark.parametrize("raw", [
    "0,1",
    {"task_id": "t", "host_id": "h", "gpu_indices": "0,1"},
    {"task_id": "t", "host_id": "h", "gpu_indices": [True, False]},
    {"task_id": "t", "host_id": "h", "gpu_indices": list(range(200_000))},
    {"task_id": ["t"], "host_id": "h", "gpu_indices": [0]},
])
async def test_a_malformed_binding_neither_crashes_nor_binds(
    kernel: KernelProcess, raw: object
) -> None:
    client = kernel.attach()
    reply, out = await run(kernel, client, execute_request(
        "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))", {BINDING_KEY: raw}))
    # The kernel says why on the cell's stderr; the cell runs unbound.
    assert reply["status"] == "ok" and out.endswith("None\n"), out
    assert len(kernel.bindings) == 0 and released(kernel) == []


async def test_a_binding_a_client_forged_for_another_cell_is_never_tracked(
    kernel: KernelProcess
) -> None:
    """A client (a notebook without GPUs talks to its kernel directly) writes a
    binding naming another tenant's cell: the agent must not track it, or its
    reply would end, and release, that other cell's GPUs."""
    client = kernel.attach()
    forged = execute_request("import time; time.sleep(1)", binding("k_other/m_other", 0))
    kernel.send_from_client(client, forged)
    await until(lambda: kernel.execution_state == "busy")
    assert len(kernel.bindings) == 0
    await until(lambda: kernel.execution_state == "idle")
    assert released(kernel) == []


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[tuple[RuntimeManager, list[str]]]:
    reported: list[str] = []
    sockets = tempfile.mkdtemp(prefix="nbf-", dir="/tmp")  # IPC paths must stay short
    runtimes = RuntimeManager(str(tmp_path / "agent"),
                              WorkspaceFiles(BlobStore(str(tmp_path / "blobs"))), sockets,
                              on_released=reported.extend)
    yield runtimes, reported
    await runtimes.shutdown()
    shutil.rmtree(sockets, ignore_errors=True)


@pytest.mark.parametrize("how", ["suspend", "release"])
async def test_suspending_or_releasing_a_runtime_reports_its_bound_cells(
    manager: tuple[RuntimeManager, list[str]], how: str
) -> None:
    runtimes, reported = manager
    placed = await runtimes.ensure("ws_gpu", 1, [("k_gpu", "python3")])
    kernel = placed.runtime.kernels["k_gpu"]
    client = kernel.attach()
    request = bound(kernel, "import time; time.sleep(60)", 0, 1)
    kernel.send_from_client(client, request)
    await until(lambda: kernel.execution_state == "busy")
    if how == "suspend":
        saved = await runtimes.suspend("ws_gpu", 2, SuspendOptions("interrupt", 0.0))
        assert saved is not None
    else:
        assert await runtimes.release("ws_gpu", 2, sync=False)
    await until(lambda: task_of(kernel, request) in reported)
    assert reported == [task_of(kernel, request)]  # once, whichever way it ended
    assert "k_gpu" not in runtimes.kernels and len(kernel.bindings) == 0


async def test_the_agent_service_drains_releases_to_the_control_plane(tmp_path: Path) -> None:
    """Runtimes -> the service's queue -> ``POST /internal/agents/{id}/released``,
    retried after a failure, with the agent running as it does in production."""
    posts: list[dict[str, Any]] = []
    failures = 1

    def control(request: httpx.Request) -> httpx.Response:
        nonlocal failures
        if request.url.path == "/internal/agents":
            return httpx.Response(200, json={"blobs_url": str(tmp_path / "blobs")})
        if request.url.path.endswith("/released"):
            if failures:
                failures -= 1
                return httpx.Response(503)
            posts.append(json.loads(request.content))
            return httpx.Response(204)
        return httpx.Response(200, json={})

    service = AgentService(AgentConfig(control_url="http://control", secret=SECRET,
                                       state_dir=str(tmp_path / "agent"), warm_pool=0,
                                       sandbox="none"))
    http = httpx.AsyncClient(transport=httpx.MockTransport(control), base_url="http://control")
    service._http = http
    service.reporter = ControlReporter(http, service.agent_id, service.boot_id)
    async with service.running():
        service.manager.on_released(["task_a", "task_b"])
        await until(lambda: bool(posts), timeout_s=10)
    assert posts == [{"agent_id": service.agent_id, "task_ids": ["task_a", "task_b"],
                      "held": []}]
