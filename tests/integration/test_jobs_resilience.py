"""GPU jobs under load and under failure, with real processes: a control plane,
agents and ``nbfleet-fakegen`` jobs in their own process groups.

Hundreds of jobs with a mix of behaviours each end as their behaviour says, with
nothing lost, doubled or left held; kill -9 of an agent or of the control plane
costs no job its success; a worker cut off, declared lost and replaced cannot
overwrite the attempt that replaced it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.job_tables import GpuAllocation, Job, JobAttempt
from tests.support.cluster import Cluster, agent_names, wait_until
from tests.support.credit_api import internal, query
from tests.support.job_api import (
    AGENT_ARGS,
    CONTROL_ARGS,
    TERMINAL,
    funded_tenant,
    job_cluster,
    submit,
    verified,
    wait_job,
)

pytestmark = pytest.mark.timeout(240)

INFRA = {"lost", "launch_failed"}


# ------------------------------------------------------------------ helpers

def listed_jobs(client: httpx.Client) -> list[dict[str, Any]]:
    """Every job the tenant sees, page by page, duplicates kept (to be counted)."""
    items: list[dict[str, Any]] = []
    before: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 500, **({"before": before} if before else {})}
        response = client.get("/v1/jobs", params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        items += page["items"]
        before = page["next"]
        if not before:
            return items


def attempts_by_job(cluster: Cluster, job_ids: Iterable[str]
                    ) -> dict[str, list[tuple[int, str, str | None, str]]]:
    """job id -> its attempts as (number, state, outcome, host), in number order."""
    wanted = set(job_ids)
    found: dict[str, list[tuple[int, str, str | None, str]]] = defaultdict(list)
    for job_id, number, state, outcome, host in query(cluster, select(
            JobAttempt.job_id, JobAttempt.attempt, JobAttempt.state, JobAttempt.outcome,
            JobAttempt.host_id).order_by(JobAttempt.job_id, JobAttempt.attempt)):
        if job_id in wanted:
            found[job_id].append((number, state, outcome, host))
    return found


def unfinished(cluster: Cluster) -> int:
    """Jobs not yet ended, straight from the DB (no load on the control plane)."""
    return int(query(cluster, select(func.count()).select_from(Job).where(
        Job.state.not_in(sorted(TERMINAL))))[0][0])


def assert_nothing_left_held(cluster: Cluster) -> None:
    """No GPU still bound, no credit still held, and the ledger balances."""
    assert query(cluster, select(GpuAllocation.host_id, GpuAllocation.gpu_index,
                                 GpuAllocation.job_id)) == []
    assert query(cluster, select(CreditHold.id, CreditHold.work_id).where(
        CreditHold.state == "active")) == []
    assert query(cluster, select(Job.id).where(Job.hold_id.is_not(None))) == []
    verified(cluster)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _job_environments() -> Iterator[tuple[int, set[bytes]]]:
    """(pid, environment) of every live process the agent started for a job: it
    gives each one ``NBFLEET_JOB_ID``. A job may be more than one process (its
    sandbox, the binary)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                env = set(handle.read().split(b"\0"))
        except OSError:
            continue
        if any(var.startswith(b"NBFLEET_JOB_ID=") for var in env) and _alive(int(entry)):
            yield int(entry), env


def job_processes(job_ids: Iterable[str], attempt: int | None = None) -> dict[int, str]:
    """Live processes (pid -> job id) of any of ``job_ids`` (of one attempt of
    them, if given)."""
    wanted = {f"NBFLEET_JOB_ID={job_id}".encode(): job_id for job_id in job_ids}
    found: dict[int, str] = {}
    for pid, env in _job_environments():
        job_id = next((wanted[var] for var in env & wanted.keys()), None)
        if job_id is not None and (attempt is None
                                   or f"NBFLEET_ATTEMPT={attempt}".encode() in env):
            found[pid] = job_id
    return found


def processes_under(root: Path) -> list[int]:
    """Live job processes whose work directory is under ``root`` (one test's)."""
    prefix = f"NBFLEET_OUTPUT_DIR={os.path.realpath(root)}/".encode()
    return [pid for pid, env in _job_environments()
            if any(var.startswith(prefix) for var in env)]


def running(client: httpx.Client, job_ids: list[str]) -> list[dict[str, Any]]:
    jobs = [client.get(f"/v1/jobs/{job_id}").json() for job_id in job_ids]
    return [job for job in jobs if job["state"] == "running"]


def outcomes(job: dict[str, Any]) -> list[str | None]:
    return [a["outcome"] for a in job["attempts"]]


@pytest.fixture(autouse=True)
def _no_stray_jobs(tmp_path: Path) -> Iterator[None]:
    """None of a test's job processes outlive its cluster."""
    yield
    wait_until(lambda: not processes_under(tmp_path), 15, 0.2, "job processes to end")


# ---------------------------------------------------------- 500 mixed jobs

#: What each behaviour's attempts end as, and the job's final state.
EXPECTED = {"success": ("succeeded", "succeeded"), "crash": ("crash", "dead_lettered"),
            "hang": ("hang", "dead_lettered"), "oom": ("oom", "dead_lettered"),
            "cuda-oom": ("oom", "dead_lettered")}
#: The issue's 500 on PostgreSQL; the SQLite pass (embedded mode, where the same
#: code runs with a single writer) checks the same properties on 200, to keep CI
#: within its time.
MIXED_JOBS = 500 if os.environ.get("NBFLEET_TEST_PG") else 200


def mixed(i: int) -> tuple[str, dict[str, Any]]:
    """Job ``i`` of the mix: 70% success (0.05-0.3 s), 10% each crash, hang and
    out-of-memory (host or CUDA). Every job has its own seed, so its own input:
    one failing input's quarantine never refuses the next submission.

    A failing job has 2 attempts, on both hosts (a retry avoids the host that
    failed it). Half the crashes may have 3: failing on 2 hosts before the budget
    is spent quarantines them instead."""
    fields: dict[str, Any] = {"args": {"seed": i}}
    kind = i % 10
    if kind < 7:
        return "success", {**fields, "duration": 0.05 + 0.05 * (i % 6)}
    fields |= {"max_attempts": 2, "duration": 0.1}
    if kind == 7:
        return "crash", {**fields, "max_attempts": 2 + (i // 10) % 2}
    if kind == 8:
        return "hang", {**fields, "idle_timeout_s": 1}
    if (i // 10) % 2:
        return "cuda-oom", fields
    return "oom", {**fields, "memory_mb": 100}


def test_500_mixed_jobs_all_end_as_their_behaviour_says(tmp_path: Path) -> None:
    with job_cluster(tmp_path, gpus="8xA100-80GB", agents=2) as cluster:
        tenants = [funded_tenant(cluster), funded_tenant(cluster)]
        tokens = [str(t.client.headers["Authorization"]).split()[1] for t in tenants]
        local = threading.local()
        opened: list[httpx.Client] = []

        def client_for(tenant: int) -> httpx.Client:
            clients: dict[int, httpx.Client] | None = getattr(local, "clients", None)
            if clients is None:
                clients = local.clients = {}
            if tenant not in clients:
                clients[tenant] = cluster.client(tokens[tenant])
                opened.append(clients[tenant])
            return clients[tenant]

        def submit_one(i: int) -> tuple[str, str, int]:
            behavior, fields = mixed(i)
            job = submit(client_for(i % 2), behavior, **fields)
            assert job["max_attempts"] == fields.get("max_attempts", job["max_attempts"])
            return job["id"], behavior, i % 2

        started = time.monotonic()
        try:
            with ThreadPoolExecutor(8) as pool:
                submitted = list(pool.map(submit_one, range(MIXED_JOBS)))
        finally:
            for client in opened:
                client.close()
        behaviour = {job_id: b for job_id, b, _ in submitted}
        owner = {job_id: t for job_id, _, t in submitted}
        assert len(behaviour) == MIXED_JOBS  # that many distinct ids
        wait_until(lambda: unfinished(cluster) == 0, 150, 1.0, "every job to end")
        elapsed = time.monotonic() - started

        # Each tenant lists exactly its own jobs, each once.
        listed: list[dict[str, Any]] = []
        for index, tenant in enumerate(tenants):
            mine = listed_jobs(tenant.client)
            assert Counter(j["id"] for j in mine).most_common(1)[0][1] == 1
            assert {j["id"] for j in mine} == {j for j, t in owner.items() if t == index}
            listed += mine
        assert len(listed) == MIXED_JOBS and {j["id"] for j in listed} == set(behaviour)

        history = attempts_by_job(cluster, behaviour)
        results = dict(query(cluster, select(Job.id, Job.result)))
        wrong: list[tuple[str, str, str, list[Any]]] = []
        for job in listed:
            job_id, kind = job["id"], behaviour[job["id"]]
            outcome, state = EXPECTED[kind]
            tries = history[job_id]
            numbers = [number for number, *_ in tries]
            assert numbers == list(range(1, len(tries) + 1)) == list(
                range(1, job["attempt"] + 1)), (job_id, numbers, job["attempt"])
            assert all(t[1] == "ended" for t in tries), (job_id, tries)
            expected_tries = 1 if kind == "success" else 2
            if (job["state"] != state or len(tries) != expected_tries
                    or any(t[2] != outcome for t in tries)):
                wrong.append((job_id, kind, job["state"], tries))
                continue
            if kind == "success":
                assert job["has_result"], job
                files = results[job_id]
                assert files and all(f["key"].startswith(f"jobs/{job_id}/1/output/")
                                     for f in files), files
                continue
            assert not job["has_result"] and results[job_id] is None, job
            assert len({t[3] for t in tries}) == 2, tries  # the retry went elsewhere
            # Failed on both hosts with attempts to spare: poison, not bad luck.
            assert job["quarantined"] == (job["max_attempts"] == 3), job
            assert job["reason"].startswith("quarantined" if job["quarantined"] else
                                            f"2 of 2 attempts failed (last: {outcome})"), job
        assert not wrong, f"{len(wrong)} jobs ended unlike their behaviour: {wrong[:5]}"
        poisoned = next(j for j in listed if j["quarantined"])
        again = tenants[owner[poisoned["id"]]].client.post("/v1/jobs", json={
            "binary": "fakegen", "args": poisoned["args"], "timeout_s": 60})
        assert again.status_code == 422 and "quarantined" in again.text, again.text
        assert_nothing_left_held(cluster)
        print(f"{MIXED_JOBS} jobs ended in {elapsed:.1f} s")


# ----------------------------------------------------------- kill -9 agent

def test_kill_9_of_the_agent_while_jobs_run(tmp_path: Path) -> None:
    # Until the dead agent's heartbeat lapses, starts sent to it fail at once and
    # count as infrastructure failures (6 dead-letter a job): with the suite's
    # 0.2 s backoff they could all fall inside a slow restart of the agent.
    with job_cluster(tmp_path, gpus="4xA100-80GB",
                     control_args=("--job-retry-backoff", "2")) as cluster:
        tenant = funded_tenant(cluster)
        client = tenant.client
        # max_attempts=1: a lost attempt must not use it up.
        ids = [submit(client, duration=3.0, max_attempts=1, args={"seed": i})["id"]
               for i in range(6)]
        hit = wait_until(lambda: len(now := running(client, ids)) == 4 and now,
                         30, 0.1, "4 jobs running")
        hit_ids = [job["id"] for job in hit]
        doomed = wait_until(lambda: len(set((found := job_processes(hit_ids, 1)).values()))
                            == 4 and found, 10, 0.1, "the running jobs' processes")

        cluster.kill_agent("agent1")
        # PR_SET_PDEATHSIG: the jobs die with their agent, though in groups of their own.
        wait_until(lambda: not any(_alive(pid) for pid in doomed), 10, 0.1,
                   "the dead agent's jobs to die with it")
        cluster.start_agent("agent1", args=AGENT_ARGS)

        for job_id in ids:
            done = wait_job(client, job_id, timeout=90)
            assert done["state"] == "succeeded", done
            *failed, last = outcomes(done)
            assert last == "succeeded" and set(failed) <= INFRA, done
            if job_id in hit_ids:
                assert failed and failed[0] == "lost", done
        assert job_processes(ids) == {}
        assert_nothing_left_held(cluster)


# --------------------------------------------------- kill -9 control plane

#: Long enough that a report retried with an unbounded backoff would come back
#: only after the new dispatcher's lost-worker grace (one 3 s heartbeat timeout).
OUTAGE_S = 10.0


def test_kill_9_of_the_control_plane_while_jobs_run(tmp_path: Path) -> None:
    with job_cluster(tmp_path, gpus="4xA100-80GB") as cluster:
        tenant = funded_tenant(cluster)
        client = tenant.client
        # Two end during the outage (their finish reports wait for the control
        # plane); two run on past it (their heartbeats resume).
        ids = [submit(client, duration=duration, max_attempts=1, args={"seed": i})["id"]
               for i, duration in enumerate([3.0, 3.0, 14.0, 14.0])]
        wait_until(lambda: len(running(client, ids)) == 4, 30, 0.1, "4 jobs running")
        processes = wait_until(lambda: len(set((found := job_processes(ids, 1)).values()))
                               == 4 and found, 10, 0.1, "the jobs' processes")

        cluster.kill_control()
        assert all(_alive(pid) for pid in processes)  # the agent keeps them running
        time.sleep(OUTAGE_S)  # the outage: the short jobs end, every report fails
        cluster.start_control(args=CONTROL_ARGS)

        for job_id in ids:
            done = wait_job(client, job_id, timeout=60)
            assert (done["state"], outcomes(done)) == ("succeeded", ["succeeded"]), done
            assert done["has_result"]
        assert_nothing_left_held(cluster)


# ----------------------------------------------------------- stale worker

def test_a_stale_worker_cannot_overwrite_a_newer_attempt(tmp_path: Path) -> None:
    with job_cluster(tmp_path, gpus="1xA100-80GB", agents=2) as cluster:
        tenant = funded_tenant(cluster)
        client = tenant.client
        job_id = submit(client, duration=4.0, max_attempts=1)["id"]
        first = wait_job(client, job_id, timeout=30, states={"running"})["attempts"][0]
        names = agent_names(cluster)
        stale_name = names[first["host_id"]]
        (other,) = set(names) - {first["host_id"]}
        boot = {a["id"]: a["boot_id"]
                for a in cluster.admin().get("/v1/admin/agents").json()["items"]}
        agent = cluster.agents[stale_name]
        log = cluster.logs / f"{stale_name}.log"

        os.kill(agent.pid, signal.SIGSTOP)  # cut off: no heartbeat, no report
        try:
            def replaced() -> dict[str, Any] | None:
                job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
                return job if job["attempt"] == 2 and job["state"] == "running" else None

            job = wait_until(replaced, 30, 0.1, "attempt 2 running")
            assert [(a["attempt"], a["state"], a["outcome"]) for a in job["attempts"]] == [
                (1, "ended", "lost"), (2, "running", None)]
            assert job["attempts"][1]["host_id"] == other
        finally:
            os.kill(agent.pid, signal.SIGCONT)

        # The old worker wakes while attempt 2 runs. Whichever comes first (its
        # heartbeat, answered "stop: stale", or its report of attempt 1's end) it
        # drops attempt 1's report.
        dropped = re.compile(rf"job {job_id} attempt 1 (is|was stopped as) stale; report dropped")
        wait_until(lambda: dropped.search(log.read_text()), 30, 0.1,
                   "the stale worker's report to be dropped")
        # Its report, had it come: a success with a result, for the lost attempt 1.
        secret = internal(cluster)
        who = {"agent_id": first["host_id"], "boot_id": boot[first["host_id"]]}
        late = {**who, "seq": 99, "gpu_ms": 4000, "exit_code": 0, "output_tail": "done",
                "result": [{"name": "video.mp4", "key": f"jobs/{job_id}/1/output/video.mp4",
                            "size": 4104, "sha256": "0" * 64}]}
        for _ in range(2):  # now (attempt 2 may still run), and once it has succeeded
            refused = secret.post(f"/internal/jobs/{job_id}/attempts/1/finish", json=late)
            assert refused.status_code == 409, refused.text
            beat = secret.post("/internal/jobs/heartbeats", json={**who, "attempts": [
                {"job_id": job_id, "attempt": 1, "seq": 100, "gpu_ms": 5000}]})
            assert beat.json()["directives"] == [{"job_id": job_id, "attempt": 1,
                                                  "action": "stop", "reason": "stale",
                                                  "grace_s": 0.0}]
            done = wait_job(client, job_id, timeout=30)

        assert done["state"] == "succeeded", done
        assert [(a["attempt"], a["outcome"], a["host_id"]) for a in done["attempts"]] == [
            (1, "lost", first["host_id"]), (2, "succeeded", other)]
        assert done["attempts"][0]["gpu_ms"] < 4000  # the late usage was not metered
        files = client.get(f"/v1/jobs/{job_id}/result").json()["files"]
        assert files and all(f"/{job_id}/2/" in f["url"] for f in files), files
        (result,) = query(cluster, select(Job.result).where(Job.id == job_id))
        assert [f["key"] for f in result[0]] == [f"jobs/{job_id}/2/output/video.mp4"]
        events = client.get(f"/v1/jobs/{job_id}/events").json()["items"]
        assert events[-1]["to"] == "succeeded" and events[-1]["attempt"] == 2, events
        assert_nothing_left_held(cluster)
