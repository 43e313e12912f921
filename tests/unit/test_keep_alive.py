"""The servers keep an idle connection open longer than their clients do.

When uvicorn closed idle connections after 5 s, as httpx's pool expires them, a
request sent on a connection the server was just closing met ECONNRESET (seen in
the 500-jobs test under load). The clients must be the ones to close.
"""

from __future__ import annotations

import asyncio
import socket

from fastapi import FastAPI

from nbfleet.cli.servers import KEEP_ALIVE_S, _Server, uvicorn_config

REQUEST = b"GET /ping HTTP/1.1\r\nHost: test\r\n\r\n"
#: An idle time past httpx's keep-alive expiry (5 s), where both used to give up.
IDLE_S = 6.0


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await asyncio.wait_for(reader.readexactly(length), 5)
    return head.split(b"\r\n")[0]


async def test_an_idle_connection_outlives_the_clients_expiry() -> None:
    assert KEEP_ALIVE_S > IDLE_S
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections wait in the backlog until the server serves
    server = _Server(uvicorn_config(app, "warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        assert await _answer(reader, writer) == b"HTTP/1.1 200 OK"
        await asyncio.sleep(IDLE_S)
        # The same connection, reused as a pool would: still open, and answered.
        assert await _answer(reader, writer) == b"HTTP/1.1 200 OK"
        writer.close()
    finally:
        server.should_exit = True
        await serving
        sock.close()
