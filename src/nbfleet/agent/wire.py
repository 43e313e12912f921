"""Jupyter wire format <-> the kernel WebSocket protocols.

Two WebSocket framings are spoken: the legacy JSON one, and
``v1.kernel.websocket.jupyter.org``, whose binary frames carry the message parts as
they are. Kernel messages are relayed on the hot path of every cell, so their
signed JSON parts are never re-encoded: they are checked and then spliced (legacy)
or packed (v1). Only the small header and parent header are parsed, for routing,
and a client's ``execute_request`` metadata, for the cell's GPU binding.
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

from nbfleet.agent.bindings import parse_binding
from nbfleet.protocol.gpu import BINDING_KEY, CellBinding

DELIMITER = b"<IDS|MSG>"
V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"
CLIENT_CHANNELS = ("shell", "control", "stdin")


class WireError(ValueError):
    """A frame that is not a valid, signed Jupyter message."""


@dataclass(slots=True)
class KernelMessage:
    """A message from the kernel: routing fields plus its four JSON parts, untouched."""

    channel: str
    msg_id: str
    msg_type: str
    parent_msg_id: str | None
    parts: list[bytes]  # header, parent_header, metadata, content
    buffers: list[bytes] = field(default_factory=list)
    _legacy: str | bytes | None = None

    @property
    def content_raw(self) -> bytes:
        return self.parts[3]

    def frame(self, protocol: str | None) -> str | bytes:
        return pack_v1(self.channel, self.parts, self.buffers) if protocol == V1_PROTOCOL \
            else self.legacy_frame()

    def legacy_frame(self) -> str | bytes:
        if self._legacy is None:
            header, parent, metadata, content = (part.decode() for part in self.parts)
            text = "".join((
                '{"header":', header,
                ',"msg_id":', json.dumps(self.msg_id),
                ',"msg_type":', json.dumps(self.msg_type),
                ',"parent_header":', parent,
                ',"metadata":', metadata,
                ',"content":', content,
                ',"buffers":[],"channel":"', self.channel, '"}',
            ))
            self._legacy = text if not self.buffers else pack_legacy_binary(
                text.encode(), self.buffers)
        return self._legacy


@dataclass(slots=True)
class ClientMessage:
    """A message from a WebSocket client, serialized and ready to sign.

    ``binding`` is the GPU binding of an ``execute_request`` (None for any other
    message, and for a malformed binding).
    """

    channel: str
    msg_id: str
    parts: list[bytes]
    buffers: list[bytes]
    msg_type: str = ""
    binding: CellBinding | None = None


class WireCodec:
    def __init__(self, key: bytes, signature_scheme: str = "hmac-sha256") -> None:
        if signature_scheme != "hmac-sha256":
            raise WireError(f"unsupported signature scheme {signature_scheme}")
        self._auth = hmac.new(key, digestmod=sha256) if key else None

    def sign(self, parts: list[bytes]) -> bytes:
        if self._auth is None:
            return b""
        mac = self._auth.copy()
        for part in parts:
            mac.update(part)
        return mac.hexdigest().encode()

    def from_kernel(self, channel: str, frames: list[bytes]) -> KernelMessage:
        try:
            start = frames.index(DELIMITER)
        except ValueError as exc:
            raise WireError("no <IDS|MSG> delimiter") from exc
        if len(frames) < start + 6:
            raise WireError("truncated message")
        signature = frames[start + 1]
        parts = frames[start + 2 : start + 6]
        if self._auth is not None and not hmac.compare_digest(signature, self.sign(parts)):
            raise WireError("invalid message signature")
        head = json.loads(parts[0])
        parent = json.loads(parts[1]) if parts[1] != b"{}" else {}
        return KernelMessage(channel, head.get("msg_id", ""), head.get("msg_type", ""),
                             parent.get("msg_id"), parts, frames[start + 6 :])

    def to_kernel(self, message: ClientMessage) -> list[bytes]:
        """Signed wire frames (without routing identities) for a client message."""
        return [DELIMITER, self.sign(message.parts), *message.parts, *message.buffers]

    def internal(self, header: dict[str, Any], content: dict[str, Any]) -> list[bytes]:
        parts = [_dump(header), b"{}", b"{}", _dump(content)]
        return [DELIMITER, self.sign(parts), *parts]


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def parse_client_frame(data: str | bytes, protocol: str | None) -> ClientMessage:
    """Decode a WebSocket frame from a client, in whichever protocol it speaks."""
    channel: object
    metadata: object = None
    if protocol == V1_PROTOCOL:
        if not isinstance(data, bytes):
            raise WireError("the v1 protocol sends binary frames")
        channel, parts, buffers = unpack_v1(data)
        try:
            header = json.loads(parts[0])
        except ValueError as exc:
            raise WireError("header is not JSON") from exc
        if isinstance(header, dict) and header.get("msg_type") == "execute_request":
            # Only a cell pays for parsing its metadata (its GPU binding is there).
            # Not a substring test first: an escaped key would slip past it.
            try:
                metadata = json.loads(parts[2])
            except ValueError:
                metadata = None
    else:
        if isinstance(data, bytes):
            pieces = unpack_legacy_binary(data)
            message = json.loads(pieces[0])
            buffers = pieces[1:]
        else:
            message = json.loads(data)
            buffers = []
        if not isinstance(message, dict):
            raise WireError("a kernel message must be a JSON object")
        # jupyter_server's gateway kernel client (nbclient, papermill) leaves the
        # channel out; the reference servers take a missing one as shell. (A v1
        # frame always names one: there, an empty name is refused.)
        channel = message.get("channel")
        if channel is None:
            channel = "shell"
        header = message.get("header")
        metadata = message.get("metadata")
        parts = [_dump(message.get(name) or {})
                 for name in ("header", "parent_header", "metadata", "content")]
    if not isinstance(channel, str) or channel not in CLIENT_CHANNELS:
        raise WireError(f"cannot send to channel {channel!r}")
    if not isinstance(header, dict) or not header.get("msg_id"):
        raise WireError("message header with a msg_id is required")
    msg_type = header.get("msg_type")
    msg_type = msg_type if isinstance(msg_type, str) else ""
    binding = None
    if msg_type == "execute_request" and isinstance(metadata, dict):
        binding = parse_binding(metadata.get(BINDING_KEY))
    return ClientMessage(channel, str(header["msg_id"]), parts, buffers, msg_type, binding)


def pack_v1(channel: str, parts: list[bytes], buffers: list[bytes]) -> bytes:
    """``v1.kernel.websocket.jupyter.org``: little-endian u64 offsets, then the parts."""
    pieces = [channel.encode(), *parts, *buffers]
    offsets = [8 * (len(pieces) + 2)]
    for piece in pieces:
        offsets.append(offsets[-1] + len(piece))
    head = struct.pack(f"<{len(offsets) + 1}Q", len(offsets), *offsets)
    return head + b"".join(pieces)


def unpack_v1(data: bytes) -> tuple[str, list[bytes], list[bytes]]:
    if len(data) < 8:
        raise WireError("v1 frame too short")
    (count,) = struct.unpack_from("<Q", data, 0)
    if count < 6 or len(data) < 8 * (count + 1):
        raise WireError("bad v1 frame header")
    offsets = struct.unpack_from(f"<{count}Q", data, 8)
    if list(offsets) != sorted(offsets) or offsets[-1] > len(data):
        raise WireError("bad v1 frame offsets")
    pieces = [data[offsets[i] : offsets[i + 1]] for i in range(count - 1)]
    return pieces[0].decode("utf-8", "replace"), pieces[1:5], pieces[5:]


def pack_legacy_binary(json_part: bytes, buffers: list[bytes]) -> bytes:
    """Legacy binary framing (messages with buffers): count, offsets, then the parts."""
    parts = [json_part, *buffers]
    offsets = [4 * (len(parts) + 1)]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + len(part))
    return struct.pack(f"!{len(parts) + 1}I", len(parts), *offsets) + b"".join(parts)


def unpack_legacy_binary(data: bytes) -> list[bytes]:
    if len(data) < 4:
        raise WireError("binary frame too short")
    (count,) = struct.unpack_from("!I", data, 0)
    if count < 1 or len(data) < 4 * (count + 1):
        raise WireError("bad binary frame header")
    offsets = list(struct.unpack_from(f"!{count}I", data, 4))
    offsets.append(len(data))
    return [data[offsets[i] : offsets[i + 1]] for i in range(count)]
