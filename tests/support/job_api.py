"""Real nbfleet processes for the GPU job tests: a control plane, agents with
virtual GPUs, the ``nbfleet-fakegen`` binary registered, tenants with credits."""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.cluster import Cluster, wait_until
from tests.support.credit_api import CREDIT, Tenant, grant, new_tenant, verified

FAKEGEN = str(Path(__file__).with_name("nbfleet-fakegen").resolve())
COMMAND = [sys.executable, FAKEGEN]
TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "dead_lettered"}

#: Fast failure handling for tests: lost after 3 s of silence, 0.5 s kill grace,
#: retries after at most 0.2 s, and no rate limit for bulk submissions.
CONTROL_ARGS = ("--rate-limit", "0", "--job-heartbeat-timeout", "3", "--job-kill-grace", "0.5",
                "--job-retry-backoff", "0.2", "--job-dispatch-interval", "0.2",
                "--gpu-prices", "default=1,A100-80GB=2,H100-80GB=4")
AGENT_ARGS = ("--job-heartbeat", "0.3")


@contextlib.contextmanager
def job_cluster(root: Path, gpus: str = "4xA100-80GB", agents: int = 1,
                control_args: tuple[str, ...] = ()) -> Iterator[Cluster]:
    from tests.conftest import fresh_database

    with fresh_database(root) as url:
        cluster = Cluster(root, url, gpus=gpus)
        try:
            cluster.start_control(args=(*CONTROL_ARGS, *control_args))
            for index in range(agents):
                cluster.start_agent(f"agent{index + 1}", args=AGENT_ARGS)
            register(cluster, "fakegen", "1.0", COMMAND)
            yield cluster
        finally:
            cluster.stop()


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def register(cluster: Cluster, name: str, version: str, command: list[str],
             **extra: Any) -> dict[str, Any]:
    response = cluster.admin().post("/v1/admin/binaries", json={
        "name": name, "version": version, "command": command, **extra})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def funded_tenant(cluster: Cluster, credits: int = 1000, project: str = "p") -> Tenant:
    tenant = new_tenant(cluster, project=project)
    grant(cluster, tenant, credits * CREDIT)
    return tenant


def submit(client: httpx.Client, behavior: str = "success", duration: float = 0.2,
           **fields: Any) -> dict[str, Any]:
    args = {"behavior": behavior, "duration": duration, "prompt": "a cat",
            **fields.pop("args", {})}
    body = {"binary": "fakegen", "args": args, "timeout_s": 60, "idle_timeout_s": 5, **fields}
    response = client.post("/v1/jobs", json=body, headers=key())
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def wait_job(client: httpx.Client, job_id: str, timeout: float = 60.0,
             states: set[str] = TERMINAL) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        body: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        return body if body["state"] in states else None

    result: dict[str, Any] = wait_until(done, timeout, 0.1, f"{job_id} to end")
    return result


def wait_all(client: httpx.Client, job_ids: list[str], timeout: float = 180.0
             ) -> dict[str, dict[str, Any]]:
    """Every job's final view, listing (not one GET each) until all have ended."""
    deadline = time.monotonic() + timeout
    wanted = set(job_ids)
    while True:
        seen: dict[str, dict[str, Any]] = {}
        before: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 500, **({"before": before} if before else {})}
            page = client.get("/v1/jobs", params=params).json()
            seen.update({job["id"]: job for job in page["items"] if job["id"] in wanted})
            before = page["next"]
            if not before:
                break
        if all(seen.get(j, {}).get("state") in TERMINAL for j in wanted):
            return seen
        if time.monotonic() > deadline:
            stuck = {j: seen.get(j, {}).get("state") for j in wanted
                     if seen.get(j, {}).get("state") not in TERMINAL}
            raise TimeoutError(f"{len(stuck)} jobs never ended: {list(stuck.items())[:10]}")
        time.sleep(0.5)


#: Re-exported for the job tests, so they import their helpers from one place.
__all__ = [
    "AGENT_ARGS",
    "CONTROL_ARGS",
    "CREDIT",
    "FAKEGEN",
    "Tenant",
    "funded_tenant",
    "job_cluster",
    "key",
    "register",
    "submit",
    "verified",
    "wait_all",
    "wait_job",
]
