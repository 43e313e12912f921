"""The agent's half of per-cell GPU binding without a kernel: what it reads off the
wire, what it remembers, and how it tells the control plane what ended."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1

from nbfleet.agent import bindings
from nbfleet.agent.bindings import KernelBindings, ReleaseQueue, parse_binding
from nbfleet.agent.service import ControlReporter
from nbfleet.agent.wire import V1_PROTOCOL, parse_client_frame
from nbfleet.protocol.gpu import BINDING_KEY, CellBinding, ReleasedCells

BINDING = {"task_id": "task_1", "host_id": "host_a", "gpu_indices": [0, 2],
           "gpu_type": "A100-80GB"}


def frame(msg_type: str, metadata: dict[str, Any], protocol: str | None = None) -> Any:
    header = {"msg_id": "m1", "msg_type": msg_type, "session": "s", "username": "u",
              "version": "5.3", "date": "2026-01-01T00:00:00Z"}
    content = {"code": "1"}
    if protocol == V1_PROTOCOL:
        return serialize_msg_to_ws_v1(
            [json.dumps(part).encode() for part in (header, {}, metadata, content)], "shell")
    return json.dumps({"channel": "shell", "header": header, "parent_header": {},
                       "metadata": metadata, "content": content})


@pytest.mark.parametrize("protocol", [None, V1_PROTOCOL])
def test_an_execute_requests_binding_is_read_in_both_protocols(protocol: str | None) -> None:
    message = parse_client_frame(frame("execute_request", {BINDING_KEY: BINDING}, protocol),
                                 protocol)
    assert message.msg_type == "execute_request"
    assert message.binding == CellBinding(task_id="task_1", host_id="host_a",
                                          gpu_indices=(0, 2), gpu_type="A100-80GB")


@pytest.mark.parametrize("protocol", [None, V1_PROTOCOL])
def test_only_execute_requests_carry_bindings(protocol: str | None) -> None:
    message = parse_client_frame(frame("comm_msg", {BINDING_KEY: BINDING}, protocol), protocol)
    assert message.msg_type == "comm_msg" and message.binding is None
    plain = parse_client_frame(frame("execute_request", {"cellId": "c"}, protocol), protocol)
    assert plain.binding is None


def test_an_escaped_key_is_still_seen() -> None:
    """The kernel's JSON parser reads ``\\u005f`` as ``_``: so must the agent, or the
    kernel would use GPUs the agent does not know are taken."""
    metadata = json.dumps({BINDING_KEY: BINDING}).replace("_binding", "\\u005fbinding")
    assert BINDING_KEY not in metadata and json.loads(metadata) == {BINDING_KEY: BINDING}
    parts = [json.dumps({"msg_id": "m1", "msg_type": "execute_request"}).encode(), b"{}",
             metadata.encode(), b"{}"]
    message = parse_client_frame(serialize_msg_to_ws_v1(parts, "shell"), V1_PROTOCOL)
    assert message.binding is not None


@pytest.mark.parametrize("raw", [
    "x", 7, [1, 2], {"task_id": "t"},
    {**BINDING, "gpu_indices": list(range(10**6))},
    {**BINDING, "gpu_indices": ["0"]},
    {**BINDING, "gpu_indices": [True]},
    {**BINDING, "gpu_indices": [2**70]},
    {**BINDING, "gpu_indices": {"0": 1}},
    {**BINDING, "task_id": ["t"]},
    {**BINDING, "task_id": "t" * 10_000},
    {**BINDING, "host_id": None},
])
def test_a_malformed_binding_is_logged_and_ignored(
    raw: object, caplog: pytest.LogCaptureFixture
) -> None:
    message = parse_client_frame(frame("execute_request", {BINDING_KEY: raw}), None)
    assert message.binding is None and message.msg_id == "m1"  # still forwarded
    assert "malformed GPU binding" in caplog.text


def test_bad_metadata_json_in_v1_is_no_binding() -> None:
    parts = [json.dumps({"msg_id": "m1", "msg_type": "execute_request"}).encode(), b"{}",
             b'{"nbfleet_binding": ', b"{}"]
    message = parse_client_frame(serialize_msg_to_ws_v1(parts, "shell"), V1_PROTOCOL)
    assert message.binding is None


def test_parse_binding_keeps_a_good_one() -> None:
    assert parse_binding(None) is None
    assert parse_binding({"task_id": "t", "host_id": "h"}) == CellBinding(task_id="t",
                                                                            host_id="h")


def cell(task_id: str) -> CellBinding:
    return CellBinding(task_id=task_id, host_id="h", gpu_indices=(0,))


def test_kernel_bindings_end_by_reply_or_all_at_once() -> None:
    released: list[str] = []
    tracked = KernelBindings()
    tracked.on_release = released.extend
    tracked.start("m1", cell("t1"))
    tracked.start("m2", cell("t2"))
    tracked.start("m3", cell("t3"))
    assert [a.binding.task_id for a in tracked.active("k1")] == ["t1", "t2", "t3"]
    assert all(a.kernel_id == "k1" and a.age_s >= 0 for a in tracked.active("k1"))
    tracked.end("m2")
    tracked.end("m2")  # a second reply: nothing more
    tracked.end("unknown")
    tracked.end(None)
    assert released == ["t2"]
    tracked.end_all(keep=["m3"])
    assert released == ["t2", "t1"] and len(tracked) == 1
    tracked.end_all()
    assert released == ["t2", "t1", "t3"] and len(tracked) == 0


def test_a_reused_msg_id_releases_the_first_task() -> None:
    released: list[str] = []
    tracked = KernelBindings()
    tracked.on_release = released.extend
    tracked.start("m1", cell("t1"))
    tracked.start("m1", cell("t2"))
    assert released == ["t1"] and [a.binding.task_id for a in tracked.active("k")] == ["t2"]


def test_kernel_bindings_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bindings, "KERNEL_LIMIT", 3)
    released: list[str] = []
    tracked = KernelBindings()
    tracked.on_release = released.extend
    for index in range(5):
        tracked.start(f"m{index}", cell(f"t{index}"))
    assert len(tracked) == 3 and released == ["t0", "t1"]


def test_a_failing_release_callback_does_not_break_the_kernel() -> None:
    tracked = KernelBindings()

    def broken(task_ids: list[str]) -> None:
        raise RuntimeError("boom")

    tracked.on_release = broken
    tracked.start("m1", cell("t1"))
    tracked.end("m1")  # logged, not raised
    assert len(tracked) == 0


async def test_release_queue_batches_and_retries_until_taken(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bindings, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(bindings, "BATCH_LIMIT", 3)
    sent: list[list[str]] = []
    failures = 2

    async def send(task_ids: list[str], held: list[str]) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise httpx.ConnectError("control plane down")
        sent.append(task_ids)

    queue = ReleaseQueue()
    drain = asyncio.create_task(queue.drain_forever(send))
    queue.put(["t1", "t2"])
    queue.put(["t2", "t3", "t4"])  # deduplicated
    for _ in range(200):
        if not len(queue):
            break
        await asyncio.sleep(0.01)
    assert sent == [["t1", "t2", "t3"], ["t4"]]
    queue.put(["t5"])  # a later release wakes the idle drainer
    for _ in range(200):
        if sent[-1] == ["t5"]:
            break
        await asyncio.sleep(0.01)
    assert sent[-1] == ["t5"]
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drain


def test_release_queue_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bindings, "PENDING_LIMIT", 3)
    queue = ReleaseQueue()
    queue.put(["a", "b", "c", "d", "e"])
    assert queue.pending() == ["c", "d", "e"]


async def test_the_reporter_posts_released_cells_and_treats_404_as_done() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    statuses = [204, 404, 422, 503]

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(statuses.pop(0))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle),
                                 base_url="http://control") as http:
        reporter = ControlReporter(http, "host_1", "boot_1")
        await reporter.released(["t1", "t2"], [])
        await reporter.released(["t3"], [])  # 404: nothing to do, not retried
        await reporter.released(["t4"], [])  # refused as malformed: retrying cannot help
        with pytest.raises(httpx.HTTPStatusError):
            await reporter.released(["t5"], [])  # anything else: raised, so retried
    assert seen[0] == ("/internal/agents/host_1/released",
                       ReleasedCells(agent_id="host_1", task_ids=["t1", "t2"]).model_dump())
    assert [body["task_ids"] for _, body in seen] == [["t1", "t2"], ["t3"], ["t4"], ["t5"]]


async def test_a_hold_is_reported_then_its_release_which_a_hold_never_undoes() -> None:
    sent: list[tuple[list[str], list[str]]] = []
    gate = asyncio.Event()

    async def send(task_ids: list[str], held: list[str]) -> None:
        sent.append((task_ids, held))
        await gate.wait()

    queue = ReleaseQueue()
    queue.hold(["t1"])
    queue.put(["t2"])
    sending = asyncio.create_task(queue.send_once(send))
    await asyncio.sleep(0)
    queue.put(["t1"])  # t1's GPU closed while its hold was being reported
    queue.hold(["t2"])  # a late hold never turns a release back into a hold
    gate.set()
    await sending
    assert sent == [(["t2"], ["t1"])]
    assert queue.pending() == ["t1"], "the release that came during the send stays"
    await queue.send_once(send)
    assert sent[-1] == (["t1"], [])
