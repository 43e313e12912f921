"""``web.browser``: what is redacted from log lines, through the real loggers and
the real websockets library (its handshake lines at debug level), and the
``Secure`` cookie rule."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator

import pytest
import websockets

from nbfleet.web.browser import (
    SECURE_COOKIES,
    SECURE_COOKIES_DEFAULT,
    SERVER_LOGGERS,
    cookies_secure,
    redact,
    redact_server_logs,
)


@pytest.mark.parametrize(("line", "expected"), [
    ('"GET /v1/workspaces?token=nbf_s3cret HTTP/1.1" 401',
     '"GET /v1/workspaces?token=[redacted] HTTP/1.1" 401'),
    ("/w/ws_1/api/kernels/k/channels?session_id=x&token=nbf_s3cret&y=1",
     "/w/ws_1/api/kernels/k/channels?session_id=x&token=[redacted]&y=1"),
    ("/files/a.csv?_xsrf=abc123&TOKEN=nbf_s3cret",
     "/files/a.csv?_xsrf=[redacted]&TOKEN=[redacted]"),
    ("/t/dXNlcjp3czox.0a1b2c/v1/workspaces/ws_1/api/kernels/k/channels",
     "/t/[redacted]/v1/workspaces/ws_1/api/kernels/k/channels"),
    ('"WebSocket /t/dXNlcjp3czox.0a1b2c/w/ws_1/api/kernels/k/channels" 404',
     '"WebSocket /t/[redacted]/w/ws_1/api/kernels/k/channels" 404'),
    # Not credentials: left as they are.
    ("/w/ws_1/api/contents/t/notes.txt?tokens=3&notoken=4",
     "/w/ws_1/api/contents/t/notes.txt?tokens=3&notoken=4"),
])
def test_credentials_in_urls_are_redacted(line: str, expected: str) -> None:
    assert redact(line) == expected


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """Everything the server loggers write, at debug level, with the filters on."""
    redact_server_logs()
    redact_server_logs()  # idempotent: one filter per logger
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    saved = {}
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        saved[name] = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    yield stream
    for name in SERVER_LOGGERS:
        logging.getLogger(name).removeHandler(handler)
        logging.getLogger(name).setLevel(saved[name])


def test_uvicorns_lines_are_redacted(captured: io.StringIO) -> None:
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5",
                                             "GET", "/v1/x?token=nbf_s3cret", "1.1", 401)
    logging.getLogger("uvicorn.error").info('%s - "WebSocket %s" [accepted]', "127.0.0.1:5",
                                            "/w/ws/api/events/subscribe?token=nbf_s3cret")
    text = captured.getvalue()
    assert "nbf_s3cret" not in text and text.count("token=[redacted]") == 2


def test_websocket_handshake_headers_are_redacted(captured: io.StringIO) -> None:
    """The control plane's client sends the cluster secret to agents, browsers send
    session cookies: at debug level the websockets library logs each header."""
    async def talk() -> None:
        async def echo(socket: websockets.ServerConnection) -> None:
            await socket.send(await socket.recv())

        async with websockets.serve(echo, "127.0.0.1", 0,
                                    logger=logging.getLogger("websockets.server")) as server:
            port = server.sockets[0].getsockname()[1]
            async with websockets.connect(
                    f"ws://127.0.0.1:{port}/ws?token=nbf_query",
                    additional_headers={"Authorization": "Bearer cluster-s3cret",
                                        "Cookie": "nbfleet_session=sess-s3cret"}) as client:
                await client.send("hello")
                assert await client.recv() == "hello"

    asyncio.run(talk())
    text = captured.getvalue()
    assert "> Authorization: [redacted]" in text  # sent, by the client
    assert "< authorization: [redacted]" in text.lower()  # received, by the server
    assert "cookie: [redacted]" in text.lower()
    for secret in ("cluster-s3cret", "sess-s3cret", "nbf_query"):
        assert secret not in text
    assert "hello" in text  # the rest of the handshake and frames are still there


def test_cookies_are_secure_over_https_or_always() -> None:
    assert SECURE_COOKIES_DEFAULT in SECURE_COOKIES
    assert cookies_secure("auto", "https") and not cookies_secure("auto", "http")
    assert cookies_secure("always", "http") and cookies_secure("always", "https")
