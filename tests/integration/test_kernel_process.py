"""The agent's kernel wrapper against a real ipykernel, without HTTP in between."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from nbfleet.agent.kernel_process import Client, KernelProcess
from nbfleet.agent.slots import kernel_env
from nbfleet.agent.wire import ClientMessage, parse_client_frame

#: Runs no DB: the PostgreSQL pass of `make test` skips it.
pytestmark = pytest.mark.no_db

def execute_request(code: str) -> ClientMessage:
    return parse_client_frame(json.dumps({
        "channel": "shell",
        "header": {"msg_id": uuid.uuid4().hex, "msg_type": "execute_request", "session": "t",
                   "username": "t", "version": "5.3", "date": "2026-01-01T00:00:00Z"},
        "parent_header": {}, "metadata": {},
        "content": {"code": code, "silent": False, "store_history": True,
                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
    }), None)


async def reply_to(client: Client, msg_id: str) -> list[dict[str, Any]]:
    """Frames for ``msg_id`` up to and including its execute_reply."""
    seen: list[dict[str, Any]] = []
    while True:
        message = await asyncio.wait_for(client.queue.get(), 30)
        assert message is not None
        msg = json.loads(message.legacy_frame())
        if msg["parent_header"].get("msg_id") == msg_id:
            seen.append(msg)
            if msg["msg_type"] == "execute_reply":
                return seen


@pytest.fixture
async def kernel(tmp_path: Path):  # type: ignore[no-untyped-def]
    workdir = tmp_path / "files"
    workdir.mkdir()
    process = KernelProcess(str(uuid.uuid4()), "ws_test", "python3", str(workdir),
                            kernel_env(str(tmp_path)), str(tmp_path / "conn"))
    nudges = 0
    original = process._send_internal

    def counting(msg_type: str) -> None:
        nonlocal nudges
        nudges += 1
        original(msg_type)

    process._send_internal = counting  # type: ignore[method-assign]
    await process.start()
    process.nudges = nudges  # type: ignore[attr-defined]
    yield process
    await process.shutdown()


async def test_start_up_does_not_flood_the_kernel(kernel: KernelProcess) -> None:
    # Regression: the readiness loop once sent hundreds of kernel_info_requests,
    # and a user's first cell queued behind them for a minute on a busy host.
    assert 1 <= kernel.nudges <= 10  # type: ignore[attr-defined]
    assert kernel.execution_state == "idle"
    assert os.path.exists(kernel.manager.connection_file)


async def test_replies_go_to_the_asker_and_iopub_to_everyone(kernel: KernelProcess) -> None:
    asker, watcher = kernel.attach(), kernel.attach()
    request = execute_request("print('hello')")
    kernel.send_from_client(asker, request)
    frames = await reply_to(asker, request.msg_id)
    assert frames[-1]["content"]["status"] == "ok"
    watcher_frames = []
    while not watcher.queue.empty():
        queued = watcher.queue.get_nowait()
        assert queued is not None
        watcher_frames.append(json.loads(queued.legacy_frame()))
    kinds = {m["msg_type"] for m in watcher_frames}
    assert "stream" in kinds and "execute_reply" not in kinds


async def test_output_is_buffered_until_a_client_attaches(kernel: KernelProcess) -> None:
    client = kernel.attach()
    request = execute_request("import time; time.sleep(0.5); print('late')")
    kernel.send_from_client(client, request)
    kernel.detach(client)
    await asyncio.sleep(2)
    later = kernel.attach()
    frames = await reply_to(later, request.msg_id)
    assert any(m["msg_type"] == "stream" and m["content"]["text"] == "late\n" for m in frames)


async def test_restart_wipes_state(kernel: KernelProcess) -> None:
    client = kernel.attach()
    first = execute_request("value = 3")
    kernel.send_from_client(client, first)
    await reply_to(client, first.msg_id)
    await kernel.restart()
    second = execute_request("value")
    kernel.send_from_client(client, second)
    frames = await reply_to(client, second.msg_id)
    assert frames[-1]["content"]["ename"] == "NameError"
    for _ in range(100):  # the idle status follows the reply; it must not stay "restarting"
        if kernel.execution_state == "idle":
            break
        await asyncio.sleep(0.05)
    assert kernel.execution_state == "idle"


async def test_a_kernel_that_dies_is_restarted_and_clients_are_told(kernel: KernelProcess) -> None:
    client = kernel.attach()
    old_pid = kernel.manager.provisioner.pid  # type: ignore[union-attr]
    kernel.send_from_client(client, execute_request("import os; os._exit(1)"))
    states: list[str] = []
    while "restarting" not in states:  # clients are told, as jupyter_server does
        message = await asyncio.wait_for(client.queue.get(), 30)
        assert message is not None
        if message.msg_type == "status":
            states.append(json.loads(message.content_raw)["execution_state"])
    for _ in range(300):
        if kernel.execution_state == "idle":
            break
        await asyncio.sleep(0.05)
    assert kernel.execution_state == "idle"
    assert kernel.manager.provisioner.pid != old_pid  # type: ignore[union-attr]
    probe = execute_request("print('back')")
    kernel.send_from_client(client, probe)
    frames = await reply_to(client, probe.msg_id)
    assert frames[-1]["content"]["status"] == "ok"


async def test_requests_without_replies_do_not_grow_memory(
    kernel: KernelProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """comm messages (widgets) get no reply, so their routing entries must be bounded."""
    import nbfleet.agent.kernel_process as kernel_process

    monkeypatch.setattr(kernel_process, "REQUESTER_LIMIT", 3)
    client = kernel.attach()
    for _ in range(10):
        comm = parse_client_frame(json.dumps({
            "channel": "shell",
            "header": {"msg_id": uuid.uuid4().hex, "msg_type": "comm_msg", "session": "t",
                       "username": "t", "version": "5.3", "date": "2026-01-01T00:00:00Z"},
            "parent_header": {}, "metadata": {},
            "content": {"comm_id": "nope", "data": {}}}), None)
        kernel.send_from_client(client, comm)
    assert len(kernel._requesters) == 3
    probe = execute_request("print('alive')")
    kernel.send_from_client(client, probe)
    frames = await reply_to(client, probe.msg_id)
    assert frames[-1]["content"]["status"] == "ok"
