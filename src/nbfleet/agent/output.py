"""What the agent holds of a kernel's output for its clients, bounded in bytes.

Output sent while no client is connected waits for the next one (a user who
closed the tab sees what the cell printed meanwhile). That wait lives in the
agent's own memory, outside the kernel's cgroup limit, so it is bounded in bytes
as well as in messages: a cell printing 1 GiB with nobody connected must cost the
host at most the bound, not the gigabyte. What goes over it is dropped, oldest
output first, and the next client is told how much was dropped, in the output of
the cell that printed it.

A connected client that stops reading is bounded the same way: past the bound it
is disconnected (it reconnects, as Jupyter clients do) instead of queueing without
end.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import uuid
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime

from nbfleet.agent.wire import KernelMessage
from nbfleet.model.limits import format_size, parse_size

log = logging.getLogger(__name__)

#: Output kept per kernel for the next client (``--output-buffer``).
DEFAULT_OUTPUT_BUFFER = "16MiB"
DEFAULT_OUTPUT_BUFFER_BYTES = parse_size(DEFAULT_OUTPUT_BUFFER)
#: Below this a single plot would not fit.
MIN_OUTPUT_BUFFER_BYTES = 1 << 20
#: Messages kept, whatever their size (status messages are small, but many).
MESSAGE_LIMIT = 10_000
#: Messages a connected client may lag behind before it is disconnected.
CLIENT_QUEUE_LIMIT = 10_000


def size_of(message: KernelMessage) -> int:
    return sum(map(len, message.parts)) + sum(map(len, message.buffers))


def jupyter_time(moment: datetime) -> str:
    """The timestamp format jupyter_server's models use."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def agent_header(msg_type: str) -> dict[str, str]:
    return {
        "msg_id": uuid.uuid4().hex,
        "msg_type": msg_type,
        "session": "nbfleet-agent",
        "username": "nbfleet",
        "date": jupyter_time(datetime.now(UTC)),
        "version": "5.3",
    }


def agent_message(msg_type: str, content: dict[str, object],
                  parent: bytes = b"{}") -> KernelMessage:
    """An iopub message of the agent's own; ``parent``: the raw parent header of
    the cell it belongs to (a frontend shows it in that cell's output)."""
    header = agent_header(msg_type)
    parts = [json.dumps(header).encode(), parent, b"{}", json.dumps(content).encode()]
    return KernelMessage("iopub", header["msg_id"], msg_type, None, parts)


def _droppable(message: KernelMessage) -> bool:
    """Output, the bulk of what a cell sends: never a reply (a client waits for
    it) nor a status (it says whether the kernel is busy)."""
    return message.channel == "iopub" and message.msg_type != "status"


class Backlog:
    """Messages no client that stayed has taken yet, oldest first.

    Output and the rest (replies, statuses) are kept apart, each in order with a
    sequence number, so that dropping the oldest output is O(1) whatever a kernel
    sends: a scan for it would cost the agent's one event loop 10,000 steps a
    message once a kernel had filled the backlog with statuses."""

    def __init__(self, max_bytes: int = DEFAULT_OUTPUT_BUFFER_BYTES,
                 max_messages: int = MESSAGE_LIMIT) -> None:
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self._output: deque[tuple[int, KernelMessage, int]] = deque()
        self._kept: deque[tuple[int, KernelMessage, int]] = deque()
        self._seq = 0
        self.bytes = 0
        self.dropped_messages = 0
        self.dropped_bytes = 0
        #: The raw parent header of the last dropped output: the notice goes there.
        self._dropped_parent = b"{}"

    def __len__(self) -> int:
        return len(self._output) + len(self._kept)

    def __iter__(self) -> Iterator[KernelMessage]:
        return (message for _, message, _ in heapq.merge(self._output, self._kept,
                                                         key=lambda entry: entry[0]))

    def append(self, message: KernelMessage) -> None:
        size = size_of(message)
        self._seq += 1
        (self._output if _droppable(message) else self._kept).append(
            (self._seq, message, size))
        self.bytes += size
        while len(self) and (self.bytes > self.max_bytes or len(self) > self.max_messages):
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """The oldest output goes first; a reply or a status only once no output is
        left to drop (a kernel can send huge ones too)."""
        _, message, size = (self._output or self._kept).popleft()
        self.bytes -= size
        self.dropped_messages += 1
        self.dropped_bytes += size
        if len(message.parts) > 1 and message.parts[1] not in (b"", b"{}"):
            self._dropped_parent = message.parts[1]

    def notice(self) -> KernelMessage | None:
        """What a client is told first when output was dropped; None if none was."""
        if not self.dropped_messages:
            return None
        text = (f"[nbfleet] {format_size(self.dropped_bytes)} of output "
                f"({self.dropped_messages} messages) were dropped while no client was "
                f"connected: at most {format_size(self.max_bytes)} is kept for the "
                f"next one.\n")
        return agent_message("stream", {"name": "stderr", "text": text},
                             self._dropped_parent)

    def clear(self) -> None:
        """A client that stayed took everything, the notice included."""
        self._output.clear()
        self._kept.clear()
        self.bytes = 0
        self.dropped_messages = self.dropped_bytes = 0
        self._dropped_parent = b"{}"


class Client:
    """One attached WebSocket: a queue bounded in messages and bytes, drained by
    the connection's writer (:meth:`take`).

    ``protocol`` is the WebSocket subprotocol it negotiated (None for legacy JSON);
    each message is rendered in it only when the writer sends it.
    """

    def __init__(self, protocol: str | None = None,
                 max_bytes: int = DEFAULT_OUTPUT_BUFFER_BYTES) -> None:
        self.protocol = protocol
        self.queue: asyncio.Queue[KernelMessage | None] = asyncio.Queue(CLIENT_QUEUE_LIMIT)
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.closed = False
        #: False until the connection sends a request (not a mere probe) or stays
        #: CONFIRM_AFTER_S open.
        self.confirmed = False
        #: Confirms it after CONFIRM_AFTER_S (cancelled when it closes first).
        self.confirm_timer: asyncio.TimerHandle | None = None

    def offer(self, message: KernelMessage) -> None:
        if self.closed:
            return
        size = size_of(message)
        # One message larger than the bound still goes to a client that has caught up.
        if self.queued_bytes and self.queued_bytes + size > self.max_bytes:
            log.warning("dropping a client that stopped reading (%s queued)",
                        format_size(self.queued_bytes))
            self.close()
            return
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            log.warning("dropping a client that stopped reading")
            self.close()
            return
        self.queued_bytes += size

    async def take(self) -> KernelMessage | None:
        """The next message to send; None once the client is closed."""
        message = await self.queue.get()
        if message is not None:
            self.queued_bytes -= size_of(message)
        return message

    def close(self) -> None:
        if self.confirm_timer is not None:
            self.confirm_timer.cancel()
            self.confirm_timer = None
        if not self.closed:
            self.closed = True
            if self.queue.full():  # dropped for not reading: what it left is nobody's
                while not self.queue.empty():
                    self.queue.get_nowait()
                self.queued_bytes = 0
            self.queue.put_nowait(None)
