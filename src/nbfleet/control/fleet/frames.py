"""Reading and writing the few kernel messages the cell gate handles itself.

The gateway relays frames untouched; only a GPU workspace's frames are opened,
and only as far as needed: a client's ``execute_request`` (to hold it and to
write its binding), and the kernel's ``execute_reply`` (to release the GPUs).
Both WebSocket framings are spoken (see ``agent/wire.py``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nbfleet.agent.wire import V1_PROTOCOL, WireError, pack_v1, unpack_v1
from nbfleet.protocol.gpu import BINDING_KEY, CellBinding

Frame = str | bytes

#: How our agent ends every legacy JSON frame on the shell channel (``agent/wire.py``),
#: so replies are found without parsing every output frame.
_SHELL_SUFFIX = '"channel":"shell"}'


@dataclass(slots=True)
class ClientRequest:
    """A client's message, opened: enough to hold it, answer it or rewrite it."""

    channel: str
    msg_type: str
    header: dict[str, Any]
    parts: list[bytes] | None  # v1: the four JSON parts and buffers, untouched
    buffers: list[bytes]
    message: dict[str, Any] | None  # legacy: the whole message
    protocol: str | None

    @property
    def msg_id(self) -> str:
        return str(self.header.get("msg_id", ""))

    @property
    def content(self) -> dict[str, Any]:
        if self.message is not None:
            content = self.message.get("content")
        else:
            assert self.parts is not None
            content = _loads(self.parts[3])
        return content if isinstance(content, dict) else {}

    @property
    def bound_host(self) -> str | None:
        """The host named by the binding in its metadata (the gate's: a client's own
        never survives ``with_binding``), or None."""
        if self.message is not None:
            metadata = self.message.get("metadata")
        else:
            assert self.parts is not None
            metadata = _loads(self.parts[2])
        binding = metadata.get(BINDING_KEY) if isinstance(metadata, dict) else None
        host = binding.get("host_id") if isinstance(binding, dict) else None
        return host if isinstance(host, str) else None

    def with_binding(self, binding: CellBinding | None) -> Frame:
        """The frame to forward, with our binding (or none) in its metadata; a
        binding the client wrote itself never survives."""
        if self.message is not None:
            metadata = dict(self.message.get("metadata") or {})
            metadata.pop(BINDING_KEY, None)
            if binding is not None:
                metadata[BINDING_KEY] = binding.model_dump(mode="json")
            # The channel it was read as, written out: a client may have left it out.
            return json.dumps({**self.message, "metadata": metadata, "channel": self.channel})
        assert self.parts is not None
        metadata = _loads(self.parts[2])
        metadata = dict(metadata) if isinstance(metadata, dict) else {}
        metadata.pop(BINDING_KEY, None)
        if binding is not None:
            metadata[BINDING_KEY] = binding.model_dump(mode="json")
        parts = [self.parts[0], self.parts[1], _dumps(metadata), self.parts[3]]
        return pack_v1(self.channel, parts, self.buffers)


def open_client_frame(frame: Frame, protocol: str | None) -> ClientRequest | None:
    """The message in a client's frame, or None when it is not one we can read
    (it is then forwarded as it is and the agent judges it)."""
    try:
        if protocol == V1_PROTOCOL:
            if not isinstance(frame, bytes):
                return None
            channel, parts, buffers = unpack_v1(frame)
            header = _loads(parts[0])
            if not isinstance(header, dict):
                return None
            return ClientRequest(channel, str(header.get("msg_type", "")), header, parts,
                                 buffers, None, protocol)
        if not isinstance(frame, str):
            return None  # legacy binary frames carry buffers (comms), never a cell
        message = json.loads(frame)
    except (WireError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(message, dict) or not isinstance(message.get("header"), dict):
        return None
    header = message["header"]
    # A missing channel is shell, as the agent and jupyter_server take it; any other
    # name is the client's to get right (the agent refuses it).
    named = message.get("channel")
    return ClientRequest("shell" if named is None else str(named),
                         str(header.get("msg_type", "")), header, None, [], message, protocol)


def execute_reply_parent(frame: Frame, protocol: str | None) -> str | None:
    """The request id an ``execute_reply`` from the kernel answers, else None."""
    reply = execute_reply(frame, protocol)
    return reply[0] if reply is not None else None


def execute_reply(frame: Frame, protocol: str | None) -> tuple[str, int | None] | None:
    """(the request id, its execution count) of an ``execute_reply`` from the kernel,
    else None."""
    try:
        if protocol == V1_PROTOCOL:
            if not isinstance(frame, bytes) or len(frame) < 8:
                return None
            channel, parts, _ = unpack_v1(frame)
            if channel != "shell":
                return None
            header, parent = _loads(parts[0]), _loads(parts[1])
            if not isinstance(header, dict) or header.get("msg_type") != "execute_reply":
                return None
            content = _loads(parts[3])
        else:
            if not isinstance(frame, str) or not frame.endswith(_SHELL_SUFFIX):
                return None
            message = json.loads(frame)
            header, parent = message.get("header"), message.get("parent_header")
            content = message.get("content")
    except (WireError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict) or header.get("msg_type") != "execute_reply":
        return None
    if not isinstance(parent, dict):
        return None
    msg_id = parent.get("msg_id")
    if not isinstance(msg_id, str):
        return None
    count = content.get("execution_count") if isinstance(content, dict) else None
    return msg_id, count if isinstance(count, int) and not isinstance(count, bool) else None


def reply_frame(request: ClientRequest, channel: str, msg_type: str,
                content: dict[str, Any], metadata: dict[str, Any] | None = None) -> Frame:
    """A message of our own, as if the kernel answered ``request``."""
    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "nbfleet-gate",
              "username": "nbfleet", "date": datetime.now(UTC).isoformat(), "version": "5.3"}
    if request.protocol == V1_PROTOCOL:
        parts = [_dumps(header), _dumps(request.header), _dumps(metadata or {}), _dumps(content)]
        return pack_v1(channel, parts, [])
    return json.dumps({"header": header, "msg_id": header["msg_id"], "msg_type": msg_type,
                       "parent_header": request.header, "metadata": metadata or {},
                       "content": content, "buffers": [], "channel": channel},
                      separators=(",", ":"))  # as the agent writes them: see _SHELL_SUFFIX


def _loads(raw: bytes) -> Any:
    return json.loads(raw) if raw else {}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()
