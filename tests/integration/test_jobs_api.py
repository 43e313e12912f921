"""GPU jobs end to end through the API and the CLI: real control plane, real agent,
the real ``nbfleet-fakegen`` binary in its own process group."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

import httpx
import pytest

from tests.support.cluster import Cluster
from tests.support.credit_api import Tenant, verified
from tests.support.job_api import (
    CREDIT,
    funded_tenant,
    job_cluster,
    key,
    register,
    submit,
    wait_all,
    wait_job,
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with job_cluster(tmp_path_factory.mktemp("jobs"), gpus="4xA100-80GB") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def alice(jobs: Cluster) -> Tenant:
    return funded_tenant(jobs)


def outcomes(job: dict[str, Any]) -> list[str | None]:
    return [a["outcome"] for a in job["attempts"]]


def test_a_job_runs_and_its_result_downloads_through_a_signed_url(
        jobs: Cluster, alice: Tenant) -> None:
    job = submit(alice.client, args={"seed": 7}, gpus=2, gpu_types=["H100-80GB", "A100-80GB"])
    assert job["state"] == "queued" and job["id"].startswith("job_")
    done = wait_job(alice.client, job["id"])
    assert done["state"] == "succeeded", done
    (attempt,) = done["attempts"]
    assert attempt["gpu_type"] == "A100-80GB" and len(attempt["gpu_indices"]) == 2
    assert attempt["rate_per_gpu_hour"] == 2 * CREDIT  # repriced from H100's 4 to A100's 2
    logs = alice.client.get(f"/v1/jobs/{job['id']}/logs").text
    assert "progress:" in logs
    assert "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, attempt["gpu_indices"])) in logs
    result = alice.client.get(f"/v1/jobs/{job['id']}/result").json()
    (file,) = result["files"]
    assert file["name"] == "video.mp4"
    data = httpx.get(file["url"]).content  # no token: the URL is the permission
    assert len(data) == file["size"] > 0
    import hashlib
    assert hashlib.sha256(data).hexdigest() == file["sha256"]


def test_a_tampered_or_expired_result_url_is_refused(jobs: Cluster, alice: Tenant) -> None:
    job = wait_job(alice.client, submit(alice.client)["id"])
    (file,) = alice.client.get(f"/v1/jobs/{job['id']}/result").json()["files"]
    url = urlparse(file["url"])
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    base = f"{url.scheme}://{url.netloc}{url.path}"

    def get(path: str = base, **changes: Any) -> httpx.Response:
        return httpx.get(f"{path}?{urlencode({**query, **changes})}")

    assert get().status_code == 200
    assert get(expires=str(int(query["expires"]) + 3600)).status_code == 403
    assert get(signature="0" * 64).status_code == 403
    for garbage in ("é" * 64, "\u0000", "🎉", ""):  # not ASCII hex: 403, never a 500
        refused = get(signature=garbage)
        assert refused.status_code == 403, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
    assert get(base.replace("video.mp4", "other.mp4")).status_code == 403
    assert get(base.replace("/1/", "/2/")).status_code == 403
    past = int(time.time()) - 1
    from nbfleet.jobs.results import sign, signing_key
    secret = (jobs.home / "cluster-secret").read_text().strip()
    stale = sign(signing_key(secret), job["id"], 1, "video.mp4", past)
    expired = get(expires=str(past), signature=stale)
    assert expired.status_code == 403 and "expired" in expired.json()["detail"]


@pytest.mark.parametrize(("behavior", "extra", "state", "outcome"), [
    ("crash", {}, "dead_lettered", "crash"),
    ("hang", {"idle_timeout_s": 1}, "dead_lettered", "hang"),
    ("oom", {"memory_mb": 100}, "dead_lettered", "oom"),
    ("cuda-oom", {}, "dead_lettered", "oom"),
    ("no-output", {}, "dead_lettered", "no_output"),
    ("ignore-sigterm", {"timeout_s": 2, "idle_timeout_s": 2}, "timed_out", "timed_out"),
])
def test_failures_are_classified(jobs: Cluster, alice: Tenant, behavior: str,
                                 extra: dict[str, Any], state: str, outcome: str) -> None:
    job = submit(alice.client, behavior, duration=0.6, max_attempts=1, **extra)
    done = wait_job(alice.client, job["id"])
    assert (done["state"], outcomes(done)) == (state, [outcome]), done
    if behavior == "ignore-sigterm":
        assert done["attempts"][0]["signal"] == 9  # SIGTERM ignored: killed after the grace


def test_retries_keep_every_attempts_reason(jobs: Cluster, alice: Tenant) -> None:
    done = wait_job(alice.client, submit(alice.client, "crash", max_attempts=3)["id"])
    assert done["state"] == "dead_lettered"
    # One host: the poison rule (several hosts) cannot fire, so all 3 attempts run.
    assert outcomes(done) == ["crash", "crash", "crash"]
    assert [a["exit_code"] for a in done["attempts"]] == [3, 3, 3]
    assert "3 of 3 attempts failed" in done["reason"]


def test_cancel_a_queued_and_a_running_job(jobs: Cluster, alice: Tenant) -> None:
    running = submit(alice.client, "hang", idle_timeout_s=60)
    wait_job(alice.client, running["id"], states={"running"})
    cancelled = alice.client.post(f"/v1/jobs/{running['id']}/cancel")
    assert cancelled.status_code == 202
    done = wait_job(alice.client, running["id"])
    assert (done["state"], outcomes(done)) == ("cancelled", ["cancelled"])
    again = alice.client.post(f"/v1/jobs/{running['id']}/cancel")
    assert again.status_code == 202 and again.json()["state"] == "cancelled"
    finished = wait_job(alice.client, submit(alice.client)["id"])
    refused = alice.client.post(f"/v1/jobs/{finished['id']}/cancel")
    assert refused.status_code == 409 and "already ended" in refused.json()["detail"]


def test_submit_is_idempotent_and_bad_input_is_explained(jobs: Cluster, alice: Tenant) -> None:
    body = {"binary": "fakegen", "args": {"behavior": "success", "duration": 0.1},
            "timeout_s": 30}
    headers = key()
    first = alice.client.post("/v1/jobs", json=body, headers=headers)
    second = alice.client.post("/v1/jobs", json=body, headers=headers)
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    assert second.headers.get("Idempotent-Replayed") == "true"
    changed = alice.client.post("/v1/jobs", json={**body, "gpus": 2}, headers=headers)
    assert changed.status_code == 422
    for bad, field in [({"binary": "nope"}, "no binary"),
                       ({"gpus": 0}, "gpus"),
                       ({"gpu_types": ["H100-80GB"]}, "no host can run"),
                       ({"tier": "platinum"}, "unknown tier"),
                       ({"args": {"output-dir": "/etc"}}, "output-dir"),
                       ({"args": {"x": [1, 2]}}, "args")]:
        response = alice.client.post("/v1/jobs", json={**body, **bad})
        assert response.status_code in (404, 422), (bad, response.text)
        assert response.headers["content-type"].startswith("application/problem+json")
        assert field in response.text, (bad, response.text)


def test_50_concurrent_clients_and_their_retries_get_one_job_per_key(
        jobs: Cluster, alice: Tenant) -> None:
    """Submissions are admitted in batches: 50 clients at once, 10 of them sending
    their request twice at the same moment, get exactly one job per key (a racing
    duplicate gets the same job or 409), and every other answer is its own."""
    body = {"binary": "fakegen", "args": {"behavior": "success", "duration": 0.05},
            "timeout_s": 30}
    keys = [str(uuid.uuid4()) for _ in range(40)]
    sends = [(k, {**body, "name": f"conc-{i}"}) for i, k in enumerate(keys)]
    sends += [(k, {**body, "name": f"conc-{i}"}) for i, k in enumerate(keys[:10])]
    barrier = threading.Barrier(len(sends))
    token = alice.client.headers["authorization"]

    def send(item: tuple[str, dict[str, Any]]) -> tuple[str, httpx.Response]:
        idempotency_key, payload = item
        with httpx.Client(base_url=jobs.url, timeout=60,
                          headers={"Authorization": token}) as client:
            barrier.wait(30)
            return idempotency_key, client.post("/v1/jobs", json=payload,
                                                headers={"Idempotency-Key": idempotency_key})

    with ThreadPoolExecutor(len(sends)) as pool:
        answers = list(pool.map(send, sends))
    by_key: dict[str, set[str]] = {}
    for idempotency_key, response in answers:
        assert response.status_code in (202, 409), response.text
        if response.status_code == 202:
            by_key.setdefault(idempotency_key, set()).add(response.json()["id"])
    assert set(by_key) == set(keys)  # every key got its job...
    assert all(len(ids) == 1 for ids in by_key.values())  # ...exactly one
    names = [job["name"] for job in alice.client.get("/v1/jobs", params={"limit": 500})
             .json()["items"] if (job["name"] or "").startswith("conc-")]
    assert sorted(names) == sorted(f"conc-{i}" for i in range(40))  # none twice
    wait_all(alice.client, [next(iter(ids)) for ids in by_key.values()])
    verified(jobs)


def test_a_submission_needs_a_valid_token(jobs: Cluster) -> None:
    body = {"binary": "fakegen", "args": {}}
    for headers in ({}, {"Authorization": "Bearer nbf_not-a-token"}):
        response = httpx.post(f"{jobs.url}/v1/jobs", json=body, headers=headers)
        assert response.status_code == 401, response.text
        assert response.headers["content-type"].startswith("application/problem+json")


def test_jobs_are_invisible_to_other_tenants(jobs: Cluster, alice: Tenant) -> None:
    job = submit(alice.client)
    mallory = funded_tenant(jobs)
    for method, path in [("GET", ""), ("POST", "/cancel"), ("GET", "/logs"),
                         ("GET", "/result"), ("GET", "/events")]:
        response = mallory.client.request(method, f"/v1/jobs/{job['id']}{path}")
        assert response.status_code == 404, (method, path, response.text)
    listed = mallory.client.get("/v1/jobs").json()["items"]
    assert job["id"] not in {j["id"] for j in listed}
    binaries = mallory.client.get("/v1/binaries").json()["items"]
    assert binaries and "command" not in binaries[0]  # how a binary runs is for admins


def test_the_ledger_balances_after_all_of_it(jobs: Cluster, alice: Tenant) -> None:
    wait_job(alice.client, submit(alice.client)["id"])
    verified(jobs)


def test_the_cli_submits_waits_lists_and_downloads(jobs: Cluster, alice: Tenant,
                                                   tmp_path: Path) -> None:
    env = {**os.environ, "NBFLEET_URL": jobs.url,
           "NBFLEET_TOKEN": str(alice.client.headers["Authorization"]).split()[1]}
    cli = [sys.executable, "-m", "nbfleet.cli.main"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True,
                              timeout=120)

    submitted = run("job", "submit", "fakegen", "--arg", "behavior=success",
                    "--arg", "duration=0.2", "--arg", "prompt=a dog", "--timeout", "60",
                    "--wait")
    assert submitted.returncode == 0, submitted.stderr
    import json
    job = json.loads(submitted.stdout)
    assert job["state"] == "succeeded" and job["args"]["prompt"] == "a dog"
    assert job["id"] in run("job", "list").stdout
    logs = run("job", "logs", job["id"])
    assert "progress:" in logs.stdout
    downloaded = run("job", "result", job["id"], "-o", str(tmp_path))
    assert downloaded.returncode == 0, downloaded.stderr
    assert (tmp_path / "video.mp4").stat().st_size > 0
    failed = run("job", "submit", "fakegen", "--arg", "behavior=crash", "--max-attempts", "1",
                 "--wait")
    assert failed.returncode == 1 and '"dead_lettered"' in failed.stdout
    missing = run("job", "get", "job_00000000000000000000000000")
    assert missing.returncode == 1 and "error 404" in missing.stderr
    bad = run("job", "submit", "fakegen", "--arg", "novalue")
    assert bad.returncode == 2 and "NAME=VALUE" in bad.stderr


SNOOP = """
import os, pathlib, sys
target, out = sys.argv[1].split("=", 1)[1], sys.argv[-1].split("=", 1)[1]
try:
    found = "READ " + pathlib.Path(target).read_text()[:4]
except OSError as exc:
    found = f"DENIED {type(exc).__name__}"
secrets = sorted(k for k in os.environ if k.startswith("NBFLEET_") and "SECRET" in k)
pathlib.Path(out, "report.txt").write_text(f"{found} env={secrets}")
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
def test_a_binary_cannot_read_the_control_planes_secrets(jobs: Cluster, alice: Tenant) -> None:
    register(jobs, "snoop", "1.0", [sys.executable, "-c", SNOOP])
    secret = jobs.home / "cluster-secret"
    assert secret.exists()
    response = alice.client.post("/v1/jobs", json={
        "binary": "snoop", "args": {"path": str(secret)}, "timeout_s": 30}, headers=key())
    done = wait_job(alice.client, response.json()["id"])
    assert done["state"] == "succeeded", done
    (file,) = alice.client.get(f"/v1/jobs/{done['id']}/result").json()["files"]
    report = httpx.get(file["url"]).text
    assert report.startswith("DENIED") and "env=[]" in report, report


def test_logs_stream_while_the_job_runs(jobs: Cluster, alice: Tenant) -> None:
    job = submit(alice.client, duration=3.0, args={"progress-interval": 0.1})
    wait_job(alice.client, job["id"], states={"running"})
    received = b""
    with alice.client.stream("GET", f"/v1/jobs/{job['id']}/logs",
                             params={"follow": "true"}) as response:
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            received += chunk
            if b"progress:" in received:
                break
    during = alice.client.get(f"/v1/jobs/{job['id']}").json()
    assert during["state"] == "running"  # the lines came while it was still running
    assert wait_job(alice.client, job["id"])["state"] == "succeeded"


def test_list_filters_and_pages(jobs: Cluster) -> None:
    bob = funded_tenant(jobs)
    ok = [submit(bob.client)["id"] for _ in range(3)]
    bad = submit(bob.client, "crash", max_attempts=1)["id"]
    for job_id in [*ok, bad]:
        wait_job(bob.client, job_id)
    failed = bob.client.get("/v1/jobs", params={"state": "dead_lettered"}).json()["items"]
    assert [j["id"] for j in failed] == [bad]
    seen, before = [], None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"before": before} if before else {})}
        page = bob.client.get("/v1/jobs", params=params).json()
        seen += [j["id"] for j in page["items"]]
        before = page["next"]
        if not before:
            break
    assert seen == sorted([*ok, bad], reverse=True)  # newest first, each once
    assert bob.client.get("/v1/jobs", params={"state": "bogus"}).status_code == 422


def test_admins_roll_binaries_out_with_the_cli(jobs: Cluster) -> None:
    env = {**os.environ, "NBFLEET_URL": jobs.url, "NBFLEET_TOKEN": jobs.admin_token,
           "COLUMNS": "250"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nbfleet.cli.main", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    first = run("binary", "register", "clitool", "1.0", "--", sys.executable, "-V")
    assert first.returncode == 0, first.stderr
    canary = run("binary", "register", "clitool", "2.0", "--canary", "25", "--",
                 sys.executable, "-V")
    assert canary.returncode == 0 and '"canary"' in canary.stdout, canary.stderr
    assert run("binary", "canary", "clitool", "2.0", "50").returncode == 0
    listed = run("binary", "list", "clitool").stdout
    assert "stable" in listed and "canary" in listed and "50" in listed
    assert '"stable"' in run("binary", "promote", "clitool", "2.0").stdout
    again = run("binary", "register", "clitool", "2.0", "--", "x")
    assert again.returncode == 1 and "already registered" in again.stderr


def test_admins_choose_the_tiers_a_project_may_use(jobs: Cluster) -> None:
    carol = funded_tenant(jobs, project="free-only")
    path = f"/v1/admin/orgs/{carol.org}/projects/{carol.project}/job-settings"
    bad = jobs.admin().put(path, json={"tiers": ["gold"]})
    assert bad.status_code == 422 and "unknown tiers" in bad.json()["detail"]
    assert carol.client.put(path, json={"tiers": ["free"]}).status_code == 404  # admins only
    assert jobs.admin().put(path, json={"tiers": ["free"]}).status_code == 200
    refused = carol.client.post("/v1/jobs", json={"binary": "fakegen", "tier": "paid"})
    assert refused.status_code == 422 and "not enabled" in refused.json()["detail"]
    assert submit(carol.client, tier="free")["state"] == "queued"
