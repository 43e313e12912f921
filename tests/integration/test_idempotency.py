"""Idempotency-Key semantics under retries and 50 concurrent clients."""

from __future__ import annotations

import asyncio
import uuid

import httpx

from tests.support.cluster import Cluster


def test_fifty_concurrent_creates_with_one_key_create_one_workspace(
    shared_cluster: Cluster,
) -> None:
    client = shared_cluster.new_user(org="idem", project="race")
    key = str(uuid.uuid4())

    async def race() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=shared_cluster.url, headers=client.headers,
                                     timeout=60) as aclient:
            return await asyncio.gather(*(
                aclient.post("/v1/workspaces", json={"name": "raced"},
                             headers={"Idempotency-Key": key})
                for _ in range(50)
            ))

    responses = asyncio.run(race())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {201, 409}, statuses
    created_ids = {r.json()["id"] for r in responses if r.status_code == 201}
    assert len(created_ids) == 1
    for response in responses:
        if response.status_code == 409:
            assert response.json()["idempotency_key"] == key
    listed = client.get("/v1/workspaces").json()["items"]
    assert [w["id"] for w in listed] == list(created_ids)
    # Once the first finished, a retry replays it.
    replay = client.post("/v1/workspaces", json={"name": "raced"}, headers={"Idempotency-Key": key})
    assert replay.status_code == 201
    assert replay.json()["id"] in created_ids
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_replay_and_mismatch(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    headers = {"Idempotency-Key": "create-1"}
    first = client.post("/v1/workspaces", json={"name": "a"}, headers=headers)
    second = client.post("/v1/workspaces", json={"name": "a"}, headers=headers)
    assert first.status_code == second.status_code == 201
    assert first.json() == second.json()
    assert "Idempotent-Replayed" not in first.headers
    different = client.post("/v1/workspaces", json={"name": "b"}, headers=headers)
    assert different.status_code == 422
    assert "different request" in different.json()["detail"]
    # Keys are per caller: another user may use the same key freely.
    other = shared_cluster.new_user()
    assert other.post("/v1/workspaces", json={"name": "a"}, headers=headers).json()["id"] != \
        first.json()["id"]


def test_refusals_are_replayed_too(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    ws = client.post("/v1/workspaces", json={"name": "gone"}).json()["id"]
    client.delete(f"/v1/workspaces/{ws}")
    key = {"Idempotency-Key": "resume-after-delete"}
    first = client.post(f"/v1/workspaces/{ws}/resume", headers=key)
    again = client.post(f"/v1/workspaces/{ws}/resume", headers=key)
    assert first.status_code == again.status_code == 409
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["current_state"] == first.json()["current_state"]


def test_overlong_key_is_refused(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    response = client.post("/v1/workspaces", json={"name": "a"},
                           headers={"Idempotency-Key": "k" * 300})
    assert response.status_code == 422
