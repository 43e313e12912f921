"""The /v1 rate limit middleware on a tiny app: headers, 429s, keys, exempt paths."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest
from fastapi import FastAPI

from nbfleet.web.ratelimit import (
    ApiRateLimit,
    RateLimitMiddleware,
    caller_key,
    parse_rate,
    rate_limit,
)


def make_client(rate: str) -> httpx.AsyncClient:
    app = FastAPI()

    @app.get("/v1/things")
    def things() -> dict[str, bool]:
        return {"ok": True}

    for path in ("/api/kernels", "/internal/ping", "/healthz", "/metrics", "/docs-like", "/v1"):
        app.add_api_route(path, lambda: {"ok": True})
    limit = rate_limit(rate)
    assert limit is not None
    app.add_middleware(RateLimitMiddleware, limit=limit)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_under_the_limit_headers_count_down() -> None:
    async with make_client("3/second;10/minute") as client:
        remaining = []
        for _ in range(3):
            response = await client.get("/v1/things", headers=bearer("alice"))
            assert response.status_code == 200
            assert response.json() == {"ok": True}
            assert response.headers["RateLimit-Limit"] == "3"
            assert response.headers["RateLimit-Policy"] == "3;w=1, 10;w=60"
            assert 0 <= int(response.headers["RateLimit-Reset"]) <= 1
            remaining.append(int(response.headers["RateLimit-Remaining"]))
        assert remaining == [2, 1, 0]


async def test_over_the_limit_is_a_problem_429_with_retry_after() -> None:
    async with make_client("3/second;10/minute") as client:
        for _ in range(3):
            assert (await client.get("/v1/things", headers=bearer("alice"))).status_code == 200
        refused = await client.get("/v1/things", headers=bearer("alice"))
        assert refused.status_code == 429
        assert refused.headers["content-type"] == "application/problem+json"
        body = refused.json()
        assert body["title"] == "Too many requests"
        assert body["status"] == 429
        assert body["instance"] == "/v1/things"
        assert "rate limit 3 per 1 second exceeded for this token" in body["detail"]
        assert int(refused.headers["Retry-After"]) == 1
        assert refused.headers["RateLimit-Limit"] == "3"
        assert refused.headers["RateLimit-Remaining"] == "0"
        assert int(refused.headers["RateLimit-Reset"]) >= 1
        assert refused.headers["RateLimit-Policy"] == "3;w=1, 10;w=60"


async def test_served_again_after_retry_after_and_refusals_do_not_count() -> None:
    async with make_client("1/second") as client:
        assert (await client.get("/v1/things", headers=bearer("bob"))).status_code == 200
        for _ in range(5):  # hammering while refused must not extend the wait
            refused = await client.get("/v1/things", headers=bearer("bob"))
            assert refused.status_code == 429
        await asyncio.sleep(int(refused.headers["Retry-After"]) + 0.05)
        assert (await client.get("/v1/things", headers=bearer("bob"))).status_code == 200


async def test_the_tightest_item_is_described() -> None:
    async with make_client("100/second;2/minute") as client:
        first = await client.get("/v1/things", headers=bearer("carol"))
        assert (first.headers["RateLimit-Limit"], first.headers["RateLimit-Remaining"]) == \
            ("2", "1")
        await client.get("/v1/things", headers=bearer("carol"))
        refused = await client.get("/v1/things", headers=bearer("carol"))
        assert refused.status_code == 429
        assert "2 per 1 minute" in refused.json()["detail"]
        assert 55 <= int(refused.headers["Retry-After"]) <= 60


async def test_tokens_have_separate_budgets() -> None:
    async with make_client("2/second") as client:
        for _ in range(2):
            assert (await client.get("/v1/things", headers=bearer("alice"))).status_code == 200
        assert (await client.get("/v1/things", headers=bearer("alice"))).status_code == 429
        # Jupyter's scheme names the same caller as Bearer does.
        assert (await client.get("/v1/things", headers={"Authorization": "token alice"})
                ).status_code == 429
        other = await client.get("/v1/things", headers=bearer("bob"))
        assert other.status_code == 200
        assert other.headers["RateLimit-Remaining"] == "1"
        # No token at all: limited by address, apart from every token.
        assert (await client.get("/v1/things")).status_code == 200
        assert (await client.get("/v1/things")).status_code == 200
        anonymous = await client.get("/v1/things")
        assert anonymous.status_code == 429
        assert "for this address" in anonymous.json()["detail"]


@pytest.mark.parametrize("path", ["/api/kernels", "/internal/ping", "/healthz", "/metrics",
                                  "/docs-like", "/v1"])
async def test_paths_outside_v1_are_not_limited(path: str) -> None:
    async with make_client("1/second") as client:
        for _ in range(5):
            response = await client.get(path, headers=bearer("alice"))
            assert response.status_code == 200
            assert "RateLimit-Limit" not in response.headers


def test_keys_hash_the_token_and_fall_back_to_the_address() -> None:
    scope = {"type": "http", "headers": [(b"authorization", b"Bearer s3cret")],
             "query_string": b"", "client": ("10.0.0.7", 5000)}
    assert caller_key(scope) == hashlib.sha256(b"s3cret").hexdigest()
    # The API refuses ?token=, so it names no caller: each new one buys no window.
    assert caller_key({**scope, "headers": [], "query_string": b"token=s3cret"}) == \
        "ip:10.0.0.7"
    assert caller_key({**scope, "headers": []}) == "ip:10.0.0.7"
    assert caller_key({**scope, "headers": [], "client": None}) == "ip:unknown"


@pytest.mark.parametrize("rate", ["bogus", "5/fortnight", "0/second", "-1/second",
                                  "5/second;nonsense", "5/second 10/minute"])
def test_bad_rate_strings_are_refused(rate: str) -> None:
    with pytest.raises(ValueError, match="invalid rate limit"):
        rate_limit(rate)


@pytest.mark.parametrize("rate", ["0", "none", "None", ""])
def test_zero_or_none_turns_limits_off(rate: str) -> None:
    assert parse_rate(rate) == []
    assert rate_limit(rate) is None


def test_bad_storage_is_refused_and_memory_runs_inline() -> None:
    with pytest.raises(ValueError, match="invalid rate limit storage 'bogus://x'"):
        rate_limit("1/second", "bogus://x")
    limit = ApiRateLimit(parse_rate("100/second;3000/minute"))
    assert not limit.blocking
    assert limit.policy == "100;w=1, 3000;w=60"
