"""The output the agent keeps for a kernel's clients is bounded in bytes, drops the
oldest output first (never a reply while output is left), and says what it dropped."""

from __future__ import annotations

import asyncio
import json

from nbfleet.agent.output import Backlog, Client, size_of
from nbfleet.agent.wire import KernelMessage

PARENT = json.dumps({"msg_id": "cell-1", "msg_type": "execute_request"}).encode()


def stream(text: str, parent: bytes = PARENT) -> KernelMessage:
    return KernelMessage("iopub", "m", "stream", "cell-1",
                         [b"{}", parent, b"{}", json.dumps({"text": text}).encode()])


def reply(size: int = 0) -> KernelMessage:
    return KernelMessage("shell", "r", "execute_reply", "cell-1",
                         [b"{}", PARENT, b"{}", b'{"status": "ok"}' + b" " * size])


def test_the_backlog_never_holds_more_than_its_bound_in_bytes() -> None:
    backlog = Backlog(max_bytes=100_000)
    chunk = "x" * 1000
    for _ in range(10_000):  # 10 MB printed with nobody connected
        backlog.append(stream(chunk))
    assert backlog.bytes <= 100_000
    assert backlog.bytes == sum(size_of(m) for m in backlog)
    kept = len(backlog)
    assert 90 <= kept < 100  # the newest output, as much as fits
    assert backlog.dropped_messages == 10_000 - kept
    assert backlog.dropped_bytes == (10_000 - kept) * size_of(stream(chunk))


def test_output_is_dropped_before_replies_and_statuses() -> None:
    backlog = Backlog(max_bytes=5_000)
    backlog.append(reply())
    status = KernelMessage("iopub", "s", "status", "cell-1",
                           [b"{}", PARENT, b"{}", b'{"execution_state": "idle"}'])
    backlog.append(status)
    for _ in range(20):
        backlog.append(stream("y" * 1000))
    kept = list(backlog)
    assert kept[0].msg_type == "execute_reply" and kept[1].msg_type == "status"
    assert backlog.bytes <= 5_000


def test_a_reply_alone_larger_than_the_bound_is_dropped_too() -> None:
    """A kernel is user code: it can make any message huge."""
    backlog = Backlog(max_bytes=5_000)
    backlog.append(reply(size=50_000))
    assert len(backlog) == 0 and backlog.bytes == 0 and backlog.dropped_messages == 1


def test_the_notice_goes_to_the_cell_whose_output_was_dropped() -> None:
    backlog = Backlog(max_bytes=3 << 20)
    assert backlog.notice() is None
    for _ in range(5):
        backlog.append(stream("z" * (1 << 20)))
    notice = backlog.notice()
    assert notice is not None and notice.channel == "iopub" and notice.msg_type == "stream"
    assert notice.parts[1] == PARENT  # shown in that cell's output
    text = json.loads(notice.content_raw)["text"]
    assert "were dropped while no client was connected" in text
    assert "3 messages" in text and "3.0 MiB" in text, text
    backlog.clear()  # a client that stayed took it all, the notice included
    assert backlog.notice() is None and backlog.bytes == 0


def test_the_backlog_is_bounded_in_messages_too() -> None:
    backlog = Backlog(max_bytes=1 << 30, max_messages=50)
    for _ in range(500):
        backlog.append(stream("."))
    assert len(backlog) == 50 and backlog.dropped_messages == 450


def test_a_client_that_stops_reading_is_dropped_at_its_bound_in_bytes() -> None:
    async def scenario() -> None:
        client = Client(max_bytes=10_000)
        message = stream("w" * 1000)
        for _ in range(100):
            client.offer(message)
        assert client.closed
        assert client.queued_bytes <= 10_000
        taken = []
        while (got := await client.take()) is not None:
            taken.append(got)
        assert len(taken) == 10_000 // size_of(message)
        assert client.queued_bytes == 0

    asyncio.run(scenario())


def test_a_client_that_reads_gets_everything_and_its_count_comes_back_down() -> None:
    async def scenario() -> None:
        client = Client(max_bytes=10_000)
        message = stream("v" * 1000)
        for _ in range(50):
            client.offer(message)
            assert await client.take() is message
        assert not client.closed and client.queued_bytes == 0

    asyncio.run(scenario())


def test_the_backlog_hands_messages_over_in_the_order_they_came() -> None:
    backlog = Backlog(max_bytes=1 << 20)
    sent = []
    for index in range(30):
        message = reply() if index % 3 == 0 else stream(f"line {index}")
        backlog.append(message)
        sent.append(message)
    assert list(backlog) == sent


def test_a_backlog_full_of_statuses_still_drops_output_first() -> None:
    """Statuses a kernel floods the backlog with are kept over output; once only
    they are left, the oldest of them go (the count bound)."""
    backlog = Backlog(max_bytes=1 << 30, max_messages=100)
    status = KernelMessage("iopub", "s", "status", "cell-1",
                           [b"{}", PARENT, b"{}", b'{"execution_state": "busy"}'])
    for _ in range(99):
        backlog.append(status)
    backlog.append(stream("last words"))
    backlog.append(stream("newer"))  # over the count: the oldest output goes
    kept = list(backlog)
    assert len(kept) == 100 and kept[-1].content_raw == stream("newer").content_raw
    assert sum(m.msg_type == "stream" for m in kept) == 1
    for _ in range(5):
        backlog.append(status)
    assert len(backlog) == 100 and all(m.msg_type == "status" for m in backlog)
