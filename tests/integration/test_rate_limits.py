"""Per-token rate limits on a real control plane, and the CLI refusing a bad one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.cluster import NBFLEET, Cluster


def test_a_token_over_its_limit_gets_429_and_others_are_served(
    tmp_path: Path, db_url: str,
) -> None:
    cluster = Cluster(tmp_path, db_url)
    try:
        cluster.start_control(args=("--rate-limit", "5/second"))
        alice, bob = cluster.new_user(), cluster.new_user()

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=cluster.url, headers=alice.headers,
                                         timeout=30) as client:
                return await asyncio.gather(*(client.get("/v1/workspaces") for _ in range(8)))

        responses = asyncio.run(burst())
        served = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 429]
        assert (len(served), len(refused)) == (5, 3), [r.status_code for r in responses]
        assert sorted(int(r.headers["RateLimit-Remaining"]) for r in served) == [0, 1, 2, 3, 4]
        assert all(r.headers["RateLimit-Policy"] == "5;w=1" for r in responses)
        retry_after = max(int(r.headers["Retry-After"]) for r in refused)
        for response in refused:
            assert response.headers["content-type"] == "application/problem+json"
            assert response.json()["title"] == "Too many requests"
            assert "rate limit 5 per 1 second" in response.json()["detail"]
            assert response.headers["Retry-After"] == "1"
            assert response.headers["RateLimit-Limit"] == "5"
            assert response.headers["RateLimit-Remaining"] == "0"

        other = bob.get("/v1/workspaces")  # another token has its own budget
        assert other.status_code == 200
        assert other.headers["RateLimit-Remaining"] == "4"
        assert cluster.admin().get("/healthz").status_code == 200

        # The platform's own callers (agents metering a whole host with the cluster
        # secret) are not limited: a host's usage must never be refused.
        secret = (cluster.home / "cluster-secret").read_text().strip()
        internal = [httpx.get(f"{cluster.url}/v1/credits/holds/hold_none",
                              headers={"Authorization": f"Bearer {secret}"})
                    for _ in range(8)]
        assert [r.status_code for r in internal] == [404] * 8
        assert all("RateLimit-Limit" not in r.headers for r in internal)

        time.sleep(retry_after)
        again = alice.get("/v1/workspaces")
        assert again.status_code == 200, again.text
        assert again.json()["items"] == []
    finally:
        cluster.stop()


def test_control_refuses_a_bad_rate_limit(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["COLUMNS"] = "200"
    for args, message in [
        (("--rate-limit", "bogus"), "--rate-limit: invalid rate limit 'bogus'"),
        (("--rate-limit", "0/second"), "every amount must be at least 1"),
        (("--rate-limit-storage", "nowhere://x"), "--rate-limit-storage: invalid rate limit"),
    ]:
        result = subprocess.run(
            [*NBFLEET, "control", "--home", str(tmp_path / "home"), "--port", "0", *args],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, (message, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "home").exists()  # refused before touching any state
