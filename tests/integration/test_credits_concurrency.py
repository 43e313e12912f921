"""Holds under 64 concurrent HTTP clients, retried keys, and a lost finish call.

Run on PostgreSQL (``NBFLEET_TEST_PG``) these race for real row locks; on SQLite
the writers queue on the database lock, and the answers must be the same.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.cluster import Cluster, wait_until
from tests.support.credit_api import (
    control_only,
    grant,
    holds_of,
    internal,
    new_tenant,
    release_txns,
    verified,
)

CLIENTS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_only(tmp_path_factory.mktemp("credits-race"), reap_interval=0.2) as running:
        yield running


def _gather(cluster: Cluster, requests: list[tuple[dict[str, Any], dict[str, str]]]
            ) -> list[httpx.Response]:
    """Send every (body, headers) reserve at once, each from its own connection."""
    headers = internal(cluster).headers

    async def one(body: dict[str, Any], extra: dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(base_url=cluster.url, headers=headers,
                                     timeout=120) as client:
            return await client.post("/v1/credits/holds", json=body, headers=extra)

    async def run() -> list[httpx.Response]:
        return list(await asyncio.gather(*(one(body, extra) for body, extra in requests)))

    return asyncio.run(run())


def test_64_clients_race_for_a_wallet_of_ten_holds(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    grant(cluster, tenant, 100)
    responses = _gather(cluster, [
        (tenant.hold_body(f"race-{i}", 10), {"Idempotency-Key": str(uuid.uuid4())})
        for i in range(CLIENTS)])
    statuses = Counter(response.status_code for response in responses)
    assert statuses == {201: 10, 402: 54}, [r.text for r in responses if r.status_code >= 500]
    assert {r.json()["reason"] for r in responses if r.status_code == 402} == {
        "insufficient_credits"}
    balance = tenant.client.get("/v1/credits/balance").json()
    assert (balance["available"], balance["held"]) == (0, 100)
    assert len(holds_of(cluster, tenant)) == 10
    verified(cluster)


def test_retried_keys_never_hold_twice(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    grant(cluster, tenant, 100)
    keys = [str(uuid.uuid4()) for _ in range(CLIENTS)]
    bodies = [tenant.hold_body(f"retry-{i}", 10) for i in range(CLIENTS)]
    # Every client sends once, and the first 16 race a second copy of the same request.
    first = _gather(cluster, [(bodies[i], {"Idempotency-Key": keys[i]}) for i in range(CLIENTS)]
                    + [(bodies[i], {"Idempotency-Key": keys[i]}) for i in range(16)])
    second = _gather(cluster, [(bodies[i], {"Idempotency-Key": keys[i]})
                               for i in range(CLIENTS)])
    answers: dict[int, list[httpx.Response]] = {i: [first[i], second[i]] for i in range(CLIENTS)}
    for i in range(16):
        answers[i].append(first[CLIENTS + i])

    held: set[str] = set()
    for i, responses in answers.items():
        assert {r.status_code for r in responses} <= {201, 402, 409}, [r.text for r in responses]
        final = [r for r in responses if r.status_code != 409]
        assert final, f"client {i} never got an answer"
        assert len({r.status_code for r in final}) == 1, [r.text for r in final]
        if final[0].status_code == 201:
            assert len({r.json()["id"] for r in final}) == 1
            held.add(final[0].json()["id"])
        # One request ran; every other answer was a replay (or 409 while it ran).
        ran = [r for r in final if r.headers.get("Idempotent-Replayed") != "true"]
        assert len(ran) == 1, [dict(r.headers) for r in final]
    assert len(held) == 10
    assert sorted(holds_of(cluster, tenant)) == sorted(held)
    balance = tenant.client.get("/v1/credits/balance").json()
    assert (balance["available"], balance["held"]) == (0, 100)
    verified(cluster)


def test_the_reaper_releases_a_hold_whose_finish_was_lost(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    grant(cluster, tenant, 1000)
    scheduler = internal(cluster)
    reserved = scheduler.post("/v1/credits/holds", json=tenant.hold_body("lost", 400, lease_s=1),
                              headers={"Idempotency-Key": str(uuid.uuid4())})
    assert reserved.status_code == 201, reserved.text
    hold_id = reserved.json()["id"]

    def settled() -> dict[str, Any] | None:
        body: dict[str, Any] = scheduler.get(f"/v1/credits/holds/{hold_id}").json()
        return body if body["state"] == "settled" else None

    reaped = wait_until(settled, 30, 0.1, "the reaper to settle the hold")
    assert (reaped["settled_by"], reaped["settle_reason"]) == ("system:reaper", "lease_expired")
    assert reaped["released"] == 400 and reaped["held"] == 0
    assert release_txns(cluster, hold_id) == 1

    late = scheduler.post(f"/v1/credits/holds/{hold_id}/settle", json={"reason": "finished"},
                          headers={"Idempotency-Key": str(uuid.uuid4())})
    assert late.status_code == 200 and late.json()["replayed"] is True
    assert {k: v for k, v in late.json().items() if k != "replayed"} == reaped
    assert release_txns(cluster, hold_id) == 1
    balance = tenant.client.get("/v1/credits/balance").json()
    assert (balance["available"], balance["held"]) == (1000, 0)
    verified(cluster)
