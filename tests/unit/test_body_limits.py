"""BodyLimitMiddleware and the bounded body readers: a request body never costs more
memory than its route's bound, declared length or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from nbfleet.model.errors import ContentTooLarge
from nbfleet.web.bodies import read_bounded, spool
from nbfleet.web.limits import BodyLimit, BodyLimitMiddleware
from nbfleet.web.problems import install_problem_handlers

SMALL = 1000
LARGE = 10_000


class Item(BaseModel):
    text: str


def _app(reads: list[int]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimitMiddleware, default=SMALL,
                       rules=(BodyLimit("PUT", r"/files/.+", LARGE),))
    install_problem_handlers(app)

    @app.post("/json")
    async def json_route(item: Item) -> dict[str, int]:
        return {"length": len(item.text)}

    @app.put("/files/{name}")
    async def stream_route(name: str, request: Request) -> dict[str, int]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            reads.append(len(chunk))
        return {"size": size}

    @app.post("/files/{name}")  # the rule names PUT only: the default bound applies
    async def post_route(name: str, request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    return app


async def _chunks(total: int, size: int = 100) -> AsyncIterator[bytes]:
    for _ in range(total // size):
        yield b"x" * size


def _is_413(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 413, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == 413 and body["title"] == "Content too large"
    assert body["limit"] == limit and str(limit) in body["detail"]


@pytest.fixture
def reads() -> list[int]:
    return []


@pytest.fixture
async def client(reads: list[int]) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=_app(reads))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_bodies_within_their_bound_pass(client: httpx.AsyncClient) -> None:
    response = await client.post("/json", json={"text": "x" * (SMALL - 20)})
    assert response.json() == {"length": SMALL - 20}
    response = await client.put("/files/a", content=b"x" * LARGE)
    assert response.json() == {"size": LARGE}
    response = await client.put("/files/a", content=_chunks(LARGE))
    assert response.json() == {"size": LARGE}


async def test_a_declared_length_over_the_bound_is_refused_unread(
        client: httpx.AsyncClient, reads: list[int]) -> None:
    _is_413(await client.post("/json", content=b"{" * (SMALL + 1),
                              headers={"content-type": "application/json"}), SMALL)
    _is_413(await client.put("/files/a", content=b"x" * (LARGE + 1)), LARGE)
    _is_413(await client.post("/files/a", content=b"x" * (SMALL + 1)), SMALL)
    assert reads == []  # the route never ran


async def test_a_chunked_body_is_counted_as_it_arrives(
        client: httpx.AsyncClient, reads: list[int]) -> None:
    _is_413(await client.post("/json", content=_chunks(2 * SMALL),
                              headers={"content-type": "application/json"}), SMALL)
    _is_413(await client.put("/files/a", content=_chunks(5 * LARGE)), LARGE)
    # The route saw no more than its bound before the refusal.
    assert sum(reads) <= LARGE


async def test_a_bare_asgi_app_is_answered_by_the_middleware() -> None:
    async def bare(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        raise AssertionError("unreachable: the body is too large")

    transport = httpx.ASGITransport(app=BodyLimitMiddleware(bare, default=SMALL))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        _is_413(await http.post("/", content=_chunks(2 * SMALL)), SMALL)


def test_rules_match_method_and_whole_path() -> None:
    middleware = BodyLimitMiddleware(_app([]), default=SMALL, rules=(
        BodyLimit("PUT", r"/files/.+", LARGE), BodyLimit("*", r"/internal/.*", 7)))
    assert middleware.limit_for("PUT", "/files/a/b") == LARGE
    assert middleware.limit_for("GET", "/files/a") == SMALL
    assert middleware.limit_for("PUT", "/x/files/a") == SMALL
    assert middleware.limit_for("POST", "/internal/agents") == 7


async def _stream(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def test_spool_batches_and_stops_at_the_limit() -> None:
    written: list[bytes] = []

    def write(data: Any) -> None:
        written.append(bytes(data))

    size = await spool(_stream([b"ab", b"cd", b"e"]), write, limit=5, what="f", batch=3)
    assert size == 5 and b"".join(written) == b"abcde" and written[0] == b"abcd"
    written.clear()
    with pytest.raises(ContentTooLarge, match="f is larger than 5 bytes"):
        await spool(_stream([b"abc", b"def", b"never read"]), write, limit=5, what="f",
                    batch=100)
    assert written == []  # refused before anything past the limit was handed on


async def test_read_bounded() -> None:
    assert await read_bounded(_stream([b"ab", b"cd"]), 4, "f") == b"abcd"
    with pytest.raises(ContentTooLarge):
        await read_bounded(_stream([b"ab", b"cde"]), 4, "f")
