"""A minimal Jupyter kernel WebSocket client (legacy JSON framing).

Enough to run cells and read their outputs through ``/api/kernels/{id}/channels``;
real notebook UIs and jupyter_server work unchanged against the same endpoint.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import websockets

from nbfleet.agent.wire import V1_PROTOCOL, pack_v1, unpack_v1


@dataclass
class CellResult:
    reply: dict[str, Any]
    outputs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.reply.get("status"))

    @property
    def stdout(self) -> str:
        return "".join(
            o["content"]["text"] for o in self.outputs
            if o["msg_type"] == "stream" and o["content"].get("name") == "stdout"
        )

    @property
    def error_name(self) -> str | None:
        return self.reply.get("ename") if self.status == "error" else None

    def data(self, mime: str = "text/plain") -> list[str]:
        return [o["content"]["data"][mime] for o in self.outputs
                if o["msg_type"] in ("execute_result", "display_data")
                and mime in o["content"].get("data", {})]


class KernelSocket:
    """``v1=True`` asks for ``v1.kernel.websocket.jupyter.org`` (binary frames)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.session = uuid.uuid4().hex
        self.v1 = connection.subprotocol == V1_PROTOCOL

    @classmethod
    async def connect(cls, url: str, token: str | None = None, v1: bool = False) -> KernelSocket:
        headers = {"Authorization": f"token {token}"} if token else {}
        connection = await websockets.connect(
            url, additional_headers=headers, max_size=None, compression=None, open_timeout=30,
            subprotocols=[V1_PROTOCOL] if v1 else None,  # type: ignore[list-item]
        )
        return cls(connection)

    def message(self, msg_type: str, content: dict[str, Any], channel: str) -> dict[str, Any]:
        msg_id = uuid.uuid4().hex
        return {
            "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                       "username": "nbfleet", "version": "5.3",
                       "date": datetime.now(UTC).isoformat()},
            "parent_header": {}, "metadata": {}, "content": content, "buffers": [],
            "channel": channel,
        }

    async def send(self, msg: dict[str, Any]) -> None:
        if not self.v1:
            await self.connection.send(json.dumps(msg))
            return
        parts = [json.dumps(msg[name]).encode()
                 for name in ("header", "parent_header", "metadata", "content")]
        await self.connection.send(pack_v1(msg["channel"], parts, []))

    async def receive(self, timeout: float = 60.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            raw = await self.connection.recv()
        if not self.v1:
            message: dict[str, Any] = json.loads(raw)
            return message
        channel, parts, buffers = unpack_v1(raw)
        header, parent, metadata, content = (json.loads(part) for part in parts)
        return {"channel": channel, "header": header, "parent_header": parent,
                "metadata": metadata, "content": content, "buffers": buffers,
                "msg_id": header.get("msg_id"), "msg_type": header.get("msg_type")}

    async def execute(self, code: str, timeout: float = 60.0,
                      wait_for_idle: bool = True) -> CellResult:
        """Run ``code``; return its reply and iopub outputs once the kernel is idle."""
        request = self.message("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}, "shell")
        await self.send(request)
        return await self.collect(request["header"]["msg_id"], timeout, wait_for_idle)

    async def collect(self, msg_id: str, timeout: float = 60.0,
                      wait_for_idle: bool = True) -> CellResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        reply: dict[str, Any] | None = None
        outputs: list[dict[str, Any]] = []
        idle = not wait_for_idle
        while reply is None or not idle:
            msg = await self.receive(max(0.01, deadline - loop.time()))
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["channel"] == "shell":
                reply = msg["content"]
            elif msg["msg_type"] == "status":
                idle = idle or msg["content"]["execution_state"] == "idle"
            elif msg["channel"] == "iopub" and msg["msg_type"] != "execute_input":
                outputs.append(msg)
        return CellResult(reply, outputs)

    async def close(self) -> None:
        await self.connection.close()
