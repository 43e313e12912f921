"""Jupyter wire format <-> the kernel WebSocket protocol (legacy JSON framing).

Kernel messages are relayed on the hot path of every cell, so a message from the
kernel is not re-encoded: its signed JSON frames are checked and spliced into the
WebSocket text as they are. Only the small header and parent header are parsed.
Messages with binary buffers use Jupyter's binary framing (offset table + parts).
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

DELIMITER = b"<IDS|MSG>"


class WireError(ValueError):
    """A frame that is not a valid, signed Jupyter message."""


@dataclass(slots=True)
class KernelMessage:
    """A message from the kernel: parsed header fields plus the ready-to-send frame."""

    msg_id: str
    msg_type: str
    parent_msg_id: str | None
    content_raw: bytes
    frame: str | bytes


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
        header, parent, metadata, content = frames[start + 2 : start + 6]
        buffers = frames[start + 6 :]
        if self._auth is not None and not hmac.compare_digest(
            signature, self.sign([header, parent, metadata, content])
        ):
            raise WireError("invalid message signature")
        head = json.loads(header)
        parent_head = json.loads(parent) if parent != b"{}" else {}
        msg_id = head.get("msg_id", "")
        msg_type = head.get("msg_type", "")
        text = "".join((
            '{"header":', header.decode(),
            ',"msg_id":', json.dumps(msg_id),
            ',"msg_type":', json.dumps(msg_type),
            ',"parent_header":', parent.decode(),
            ',"metadata":', metadata.decode(),
            ',"content":', content.decode(),
            ',"buffers":[],"channel":"', channel, '"}',
        ))
        frame: str | bytes = text if not buffers else pack_binary(text.encode(), buffers)
        return KernelMessage(msg_id, msg_type, parent_head.get("msg_id"), content, frame)

    def to_kernel(self, message: dict[str, Any], buffers: list[bytes]) -> list[bytes]:
        """Serialize a client message into signed wire frames (without routing ids)."""
        parts = [
            _dump(message.get("header") or {}),
            _dump(message.get("parent_header") or {}),
            _dump(message.get("metadata") or {}),
            _dump(message.get("content") or {}),
        ]
        return [DELIMITER, self.sign(parts), *parts, *buffers]


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def parse_client_frame(data: str | bytes) -> tuple[str, dict[str, Any], list[bytes]]:
    """Decode a WebSocket frame from a client into (channel, message, buffers)."""
    if isinstance(data, bytes):
        parts = unpack_binary(data)
        message = json.loads(parts[0])
        buffers = parts[1:]
    else:
        message = json.loads(data)
        buffers = []
    if not isinstance(message, dict):
        raise WireError("a kernel message must be a JSON object")
    channel = message.pop("channel", None)
    if channel not in ("shell", "control", "stdin"):
        raise WireError(f"cannot send to channel {channel!r}")
    header = message.get("header")
    if not isinstance(header, dict) or not header.get("msg_id"):
        raise WireError("message header with a msg_id is required")
    message.pop("buffers", None)
    return channel, message, buffers


def pack_binary(json_part: bytes, buffers: list[bytes]) -> bytes:
    """Jupyter's binary WebSocket framing: count, offsets, then the parts."""
    parts = [json_part, *buffers]
    offsets = [4 * (len(parts) + 1)]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + len(part))
    return struct.pack(f"!{len(parts) + 1}I", len(parts), *offsets) + b"".join(parts)


def unpack_binary(data: bytes) -> list[bytes]:
    if len(data) < 4:
        raise WireError("binary frame too short")
    (count,) = struct.unpack_from("!I", data, 0)
    if count < 1 or len(data) < 4 * (count + 1):
        raise WireError("bad binary frame header")
    offsets = list(struct.unpack_from(f"!{count}I", data, 4))
    offsets.append(len(data))
    return [data[offsets[i] : offsets[i + 1]] for i in range(count)]
