"""GPU jobs: submissions per second, dispatch decisions per second, submit-to-start latency.

Three parts (``--parts``), each on its own throwaway database: PostgreSQL by default
(the issue's figure), ``--db sqlite`` or ``--db both`` for comparison. Figures are
printed as ``<db>_<figure>``.

* ``submit``: ``POST /v1/jobs`` (each with a fresh ``Idempotency-Key``) through the
  HTTP API of a real ``nbfleet control`` (``--rate-limit 0``, ``--workers``
  processes) from ``--clients`` concurrent keep-alive connections of the lean
  load generator (``loadgen.py``; httpx would spend more CPU than the server),
  ``--submissions`` per measurement, spread over ``--tenants`` tenants (each its
  own org and wallet). Hosts are registered (fake agent rows, so admission accepts
  the jobs) but none is alive, so the jobs only queue; the dispatcher still wakes
  on every submission. In alternating blocks (ABC, CBA, ...), the same number of
  ``GET /healthz`` (the HTTP floor) and ``GET /v1/binaries`` (a token lookup and a
  one-row read) with the same concurrency: ``submit_per_s``, ``healthz_per_s``,
  ``authed_get_per_s``, the ratios ``submit_vs_healthz`` and
  ``submit_vs_authed_get``, and for each the CPU the server process and the
  clients spent per request (``*_server_cpu_ms``, ``*_client_cpu_ms``; the
  server's is its workers' too). Then, without HTTP, in-process on the same
  database and one thread, for ``--seconds`` each: ``admit_t1_per_s``
  (``admission.submit`` in a transaction per job: the unbatched baseline) and
  ``intake_b<N>_per_s`` for N = 1, 8, 32 (``JobIntake.admit`` of a batch of N:
  all the route's DB work, the tokens, the Idempotency-Keys, admission and the
  stored replies, in one transaction), with their CPU per job (``*_cpu_ms``).
* ``dispatch``: ``--hosts`` fake hosts with fresh heartbeats (``--gpus-per-host``
  GPUs of four types, every tenth host with two) and ``--queued`` jobs across
  ``--dispatch-tenants`` tenants (1/2/4/8 GPUs, mixed type preferences, a fifth of
  the tenants on the paid tier, weights 1/2/4), admitted with ``admission.submit``,
  ``--batch`` per transaction. Then full dispatch passes (what
  ``JobDispatcher.dispatch_pass`` runs: ``load_fleet``, ``load_queue``,
  ``load_tenants``, ``load_usage``, ``plan_dispatch``, ``claim``, under the
  dispatcher lease) until one starts nothing: ``dispatch_decisions_per_s`` (jobs
  claimed per second of pass time) and the first pass split into read (of which
  the queue) / plan / claim. Then the steady state: the fleet full, ``--free``
  1-GPU jobs finish before each pass (as their agents would report them), and the
  pass is timed (median of ``--steady-repeats``) with ``--queued`` jobs waiting
  (topped up) and again with ``--small-queue`` (the newest cancelled):
  ``dispatch_steady_<figure>_q<queued>_k<freed>``.
* ``latency``: a real control plane (``--job-dispatch-interval 1``, so a start
  must come from the wake-up path, not from polling) and one agent with four
  free GPUs running ``tests/support/nbfleet-fakegen`` (0.05 s successes);
  ``--latency-jobs`` jobs submitted one at a time, each once the previous one has
  started (after ``--latency-warmup`` uncounted ones). ``start_p50_ms`` etc.: the
  job's ``started_at - created_at`` (DB clock); ``client_start_*``: from just
  before the POST until a GET shows ``started_at`` (polled every ``--poll-ms``,
  default 50: each poll is an authenticated read in the server process, and at
  10 ms the measuring client took enough of this 2-core machine's CPU from the
  dispatcher to add some 8 ms to the DB-clock figure); ``post_*``: the
  POST alone; ``schedule_*``: ``created_at`` until the ``scheduled`` event (the
  dispatch pass's claim).

Throughput figures are medians over ``--repeats``. ``--quick`` shrinks everything
to a smoke test of well under a minute.

    .venv/bin/python bench/jobs.py                  # PostgreSQL, all parts
    .venv/bin/python bench/jobs.py --db sqlite --parts submit,latency
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

import loadgen
from harness import emit, free_port, healthy, stderr, throwaway_db, wait_for
from nbfleet.control import leases, tenancy
from nbfleet.control.idempotency import request_fingerprint
from nbfleet.control.job_dispatcher import LEASE, MAX_HEADS
from nbfleet.control.job_intake import JobIntake, Submission
from nbfleet.control.platform import ControlConfig, Platform
from nbfleet.db.engine import Database
from nbfleet.db.job_tables import Job, JobAttempt
from nbfleet.db.tables import Agent, Project, User
from nbfleet.jobs import admission, attempts, binaries, dispatch
from nbfleet.jobs.settings import JobSettings
from nbfleet.ledger import audit, grants
from nbfleet.ledger.wallets import owner_by_ids
from nbfleet.model.credits import GrantKind
from nbfleet.model.jobs import PLACED, CanaryRule, JobState
from nbfleet.model.pricing import parse_prices
from nbfleet.policy.job_dispatch import can_act, plan_dispatch

BENCH = "jobs"
TARGET_SUBMIT_PER_S = 500.0
TARGET_START_P50_MS = 50.0
ROOT = Path(__file__).resolve().parent.parent
FAKEGEN = ROOT / "tests" / "support" / "nbfleet-fakegen"
BINARY = "fakegen"
PRICES = "default=1,A100-80GB=2,H100-80GB=4"
SETTINGS = JobSettings(prices=parse_prices(PRICES))
ACTOR = audit.Actor("system:bench", request_id="bench-jobs")
#: Credits no run here can spend (micro-credits).
GRANT = 10**15
#: (type, VRAM GB) of the fake fleet.
GPU_TYPES = (("A10G", 24), ("L40S", 48), ("A100-80GB", 80), ("H100-80GB", 80))
#: Accepted type lists of the dispatch part's jobs, with their weights.
TYPE_CHOICES: tuple[tuple[tuple[str, ...], int], ...] = (
    ((), 40), (("H100-80GB",), 20), (("A100-80GB", "H100-80GB"), 20), (("L40S",), 10),
    (("A10G", "L40S"), 10))
GPU_CHOICES = ((1, 60), (2, 20), (4, 15), (8, 5))
START_TIMEOUT_S = 60.0
TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "dead_lettered"}
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


# ------------------------------------------------------------------ processes
@contextlib.contextmanager
def nbfleet_process(name: str, args: Sequence[str], home: Path) -> Iterator[
        subprocess.Popen[bytes]]:
    """``nbfleet <args>`` in its own session, with ``home`` as NBFLEET_HOME; its
    output goes to ``home/<name>.log``, printed if anything fails while it runs."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_HOME"] = str(home)
    log = home / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nbfleet.cli.main", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        yield proc
    except BaseException:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(empty)"
        stderr.print(f"{name} log ({log}):\n{tail}", markup=False, highlight=False)
        raise
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (an agent then stops its jobs), SIGKILL to the group if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def control_plane(db_url: str, home: Path, *extra: str) -> Iterator[tuple[str, int]]:
    """``nbfleet control`` on a free port, no rate limit; yields its URL and pid."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with nbfleet_process("control", [
            "control", "--db", db_url, "--blobs", str(home / "blobs"), "--port", str(port),
            "--rate-limit", "0", "--gpu-prices", PRICES, "--log-level", "warning", *extra],
            home) as proc:
        wait_for(lambda: healthy(url), proc, "the control plane")
        yield url, proc.pid


@contextlib.contextmanager
def agent(db: Database, url: str, home: Path, gpus: str) -> Iterator[None]:
    """One ``nbfleet agent`` with virtual GPUs, registered (its row is fresh)."""
    def registered() -> bool:
        with db.transaction(write=False) as session:
            return bool(session.execute(select(func.count()).select_from(Agent)).scalar_one())

    with nbfleet_process("agent", [
            "agent", "--control", url, "--state-dir", str(home / "agent"), "--gpus", gpus,
            "--warm-pool", "0", "--log-level", "warning"], home) as proc:
        wait_for(registered, proc, "the agent")
        yield


# --------------------------------------------------------------------- tenants
@dataclass(frozen=True)
class Tenant:
    org_id: str
    project_id: str
    user_id: str
    token: str

    @property
    def admission(self) -> admission.Tenant:
        return admission.Tenant(self.org_id, self.project_id, self.user_id)


def new_tenants(db: Database, count: int) -> list[Tenant]:
    """Users in orgs of their own, each with credit nothing here can exhaust."""
    tenants = []
    for _ in range(count):
        suffix = uuid.uuid4().hex[:8]
        created = tenancy.create_user(db, f"bench-{suffix}", f"bench-{suffix}", "jobs")
        with db.transaction() as session:
            user = session.get(User, created.user_id)
            assert user is not None
            grants.issue(session, owner_by_ids(session, user.org_id, user.project_id),
                         grants.GrantRequest(GrantKind.PURCHASE, GRANT), ACTOR,
                         db.now(session))
            tenants.append(Tenant(user.org_id, user.project_id, user.id, created.token))
    return tenants


def register_binary(db: Database, command: list[str]) -> None:
    with db.transaction() as session:
        binaries.register(session, BINARY, "1.0", command, 0, CanaryRule(), db.now(session))


def add_hosts(db: Database, count: int, gpus_per_host: int, alive: bool) -> int:
    """``count`` host rows as agents register them; every tenth has two GPU types.
    Dead ones (a day without heartbeat) still make admission accept their shapes.
    Returns the GPUs added."""
    rows = []
    total = 0
    with db.transaction() as session:
        now = db.now(session)
        beat = now if alive else now - timedelta(days=1)
        for i in range(count):
            first, second = GPU_TYPES[i % len(GPU_TYPES)], GPU_TYPES[(i + 1) % len(GPU_TYPES)]
            if i % 10 == 9 and gpus_per_host > 1:
                half = gpus_per_host // 2
                groups = [(half, *first), (gpus_per_host - half, *second)]
            else:
                groups = [(gpus_per_host, *first)]
            total += gpus_per_host
            rows.append({
                "id": f"host{i:05d}", "url": f"http://host{i:05d}.invalid", "boot_id": "boot1",
                "inventory": {"millicpus": 64000, "memory_mb": 512000, "gpus": [
                    {"count": c, "type": t, "vram_gb": v} for c, t, v in groups]},
                "registered_at": beat, "last_heartbeat_at": beat})
        session.execute(insert(Agent), rows)
    return total


# ------------------------------------------------------------------ measuring
def run_threads(threads: int, step: Callable[[int], None], seconds: float
                ) -> tuple[float, float]:
    """``step(thread_index)`` in a loop from ``threads`` threads for ``seconds``;
    returns calls per second over all of them, and this process's CPU
    milliseconds per call."""
    barrier = threading.Barrier(threads + 1)
    counts = [0] * threads
    errors: list[BaseException] = []
    deadline = [0.0]

    def work(index: int) -> None:
        try:
            barrier.wait()
            while time.perf_counter() < deadline[0]:
                step(index)
                counts[index] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    start, cpu = time.perf_counter(), time.process_time()
    deadline[0] = start + seconds
    barrier.wait()
    for thread in pool:
        thread.join()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    if errors:
        raise errors[0]
    calls = max(1, sum(counts))
    return sum(counts) / elapsed, cpu * 1000 / calls


def cpu_seconds(pid: int) -> float:
    """User + system CPU so far of process ``pid`` and of the processes it forked
    (the control plane's workers) (Linux; 0 elsewhere)."""
    try:
        forked = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        forked = []
    total = 0
    for process in [str(pid), *forked]:
        try:
            fields = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 < q < 1), interpolated between the closest ranks."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def job_body(seed: int, **extra: Any) -> dict[str, Any]:
    return {"binary": BINARY, "args": {"prompt": "a red fox", "seed": seed},
            "timeout_s": 60, "idle_timeout_s": 5, **extra}


# ------------------------------------------------------------- part 1: submit
@dataclass
class Blast:
    per_s: float
    #: CPU of the server process and of this one (the clients), per request, in ms.
    server_cpu_ms: float
    client_cpu_ms: float


async def blast(connections: Sequence[loadgen.Connection], make: loadgen.MakeRequest,
                total: int, expect: int, server_pid: int) -> Blast:
    server = cpu_seconds(server_pid)
    run = await loadgen.blast(connections, make, total, expect)
    return Blast(run.per_s, (cpu_seconds(server_pid) - server) * 1000 / total,
                 run.client_cpu_ms)


async def measure_http(url: str, server_pid: int, tenants: list[Tenant],
                       args: argparse.Namespace) -> dict[str, float]:
    headers = [{"Authorization": f"Bearer {t.token}"} for t in tenants]
    seeds = itertools.count()

    def healthz(n: int, worker: int) -> loadgen.RequestSpec:
        return "GET", "/healthz", {}, None

    def authed_get(n: int, worker: int) -> loadgen.RequestSpec:
        return "GET", "/v1/binaries", headers[worker % len(headers)], None

    def submit(n: int, worker: int) -> loadgen.RequestSpec:
        return "POST", "/v1/jobs", {**headers[worker % len(headers)],
                                    "Idempotency-Key": str(uuid.uuid4())}, job_body(next(seeds))

    phases: list[tuple[str, loadgen.MakeRequest, int]] = [
        ("healthz", healthz, 200), ("authed_get", authed_get, 200), ("submit", submit, 202)]
    samples: dict[str, list[Blast]] = {name: [] for name, _, _ in phases}
    # One keep-alive connection per client, on the lean client (loadgen.py): with
    # httpx the clients' CPU, not the server, set the ceiling on these two cores.
    connections = [await loadgen.Connection.open(url) for _ in range(args.clients)]
    try:
        for _name, make, expect in phases:  # warm up: connections, caches
            await blast(connections, make, min(200, args.submissions), expect, server_pid)
        for repeat in range(args.repeats):
            # ABC, then CBA: drift in the machine's load hits every phase alike.
            order = phases if repeat % 2 == 0 else phases[::-1]
            for name, make, expect in order:
                stderr.print(f"  submit: repeat {repeat + 1}/{args.repeats}: {name}",
                             highlight=False)
                samples[name].append(await blast(connections, make, args.submissions, expect,
                                                 server_pid))
    finally:
        for connection in connections:
            await connection.close()
    result: dict[str, float] = {}
    for name, blasts in samples.items():
        result[f"{name}_per_s"] = statistics.median(b.per_s for b in blasts)
        result[f"{name}_server_cpu_ms"] = statistics.median(b.server_cpu_ms for b in blasts)
        result[f"{name}_client_cpu_ms"] = statistics.median(b.client_cpu_ms for b in blasts)
    result["submit_vs_healthz"] = result["submit_per_s"] / result["healthz_per_s"]
    result["submit_vs_authed_get"] = result["submit_per_s"] / result["authed_get_per_s"]
    return result


def measure_in_process(db: Database, tenants: list[Tenant], args: argparse.Namespace
                       ) -> dict[str, float]:
    """The route's DB work without HTTP, on one thread: ``admission.submit`` with a
    transaction per job (the unbatched baseline), and ``JobIntake.admit`` of
    batches of 1, 8 and 32 (token, Idempotency-Key, admission and stored reply of
    every submission of the batch, in one transaction)."""
    with db.transaction(write=False) as session:
        shapes = admission.fleet_shapes(session)
    seeds = itertools.count(10**9)

    def request(seed: int) -> admission.JobRequest:
        return admission.JobRequest(binary=BINARY, args={"prompt": "a red fox", "seed": seed},
                                    timeout_s=60, idle_timeout_s=5)

    def admit(index: int) -> None:
        tenant = tenants[index % len(tenants)]
        with db.transaction() as session:
            admission.submit(session, tenant.admission, request(next(seeds)), SETTINGS,
                             shapes, ACTOR, db.now(session))

    platform = Platform(ControlConfig(db_url=db.url, blobs_url=str(Path(tempfile.mkdtemp())),
                                      secret="bench", gpu_prices=PRICES))
    intake = JobIntake(platform)

    def batch_of(size: int) -> Callable[[int], None]:
        def step(_index: int) -> None:
            batch = []
            for n in range(size):
                tenant, seed = tenants[n % len(tenants)], next(seeds)
                body = job_body(seed)
                item = Submission(tenant.token, str(uuid.uuid4()),
                                  request_fingerprint("POST", "/v1/jobs", body), None,
                                  request(seed))
                item.answer.set_running_or_notify_cancel()
                batch.append(item)
            intake.admit(batch)
            reply = batch[-1].answer.result()
            if reply.outcome is None or reply.outcome[0] != 202:
                raise RuntimeError(f"intake: {reply}")
        return step

    result: dict[str, float] = {}
    steps: list[tuple[str, Callable[[int], None], int]] = [("admit_t1", admit, 1)] + [
        (f"intake_b{size}", batch_of(size), size) for size in (1, 8, 32)]
    try:
        for name, step, per_call in steps:
            stderr.print(f"  submit: in-process {name}", highlight=False)
            runs = [run_threads(1, step, args.seconds) for _ in range(args.repeats)]
            result[f"{name}_per_s"] = statistics.median(r for r, _ in runs) * per_call
            result[f"{name}_cpu_ms"] = statistics.median(c for _, c in runs) / per_call
    finally:
        platform.db.dispose()
    result["intake_b32_vs_admit_t1"] = result["intake_b32_per_s"] / result["admit_t1_per_s"]
    return result


def run_submit(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    with throwaway_db(kind, args.pg_url, tmp / "submit-db", "jobs-bench") as db:
        # Shapes admission accepts, on hosts nobody hears from: jobs only queue.
        add_hosts(db, 8, 8, alive=False)
        register_binary(db, ["/bin/true"])
        tenants = new_tenants(db, args.tenants)
        workers = args.workers if kind == "postgres" else 1
        with control_plane(db.url, tmp / "submit-home", "--workers", str(workers)) as (
                url, pid):
            result = asyncio.run(measure_http(url, pid, tenants, args))
        result["workers"] = workers
        result["queued_after_submit"] = queued_count(db)
        result |= measure_in_process(db, tenants, args)
    r = result
    verdict = "met" if r["submit_per_s"] >= TARGET_SUBMIT_PER_S else "NOT met"
    stderr.print(
        f"{BENCH}: {kind} c{args.clients} over {args.tenants} tenants, {workers} worker(s): submit "
        f"{r['submit_per_s']:.0f}/s (server CPU {r['submit_server_cpu_ms']:.2f} ms each) = "
        f"x{r['submit_vs_healthz']:.2f} of GET /healthz {r['healthz_per_s']:.0f}/s "
        f"({r['healthz_server_cpu_ms']:.2f} ms), x{r['submit_vs_authed_get']:.2f} of "
        f"GET /v1/binaries {r['authed_get_per_s']:.0f}/s ({r['authed_get_server_cpu_ms']:.2f} "
        f"ms) | in-process, 1 thread: a transaction per job {r['admit_t1_per_s']:.0f}/s "
        f"({r['admit_t1_cpu_ms']:.2f} ms CPU each), batches of 32 {r['intake_b32_per_s']:.0f}"
        f"/s ({r['intake_b32_cpu_ms']:.2f} ms) | target >= {TARGET_SUBMIT_PER_S:.0f}"
        f"/s: {verdict}", highlight=False)
    return result


# ----------------------------------------------------------- part 2: dispatch
@dataclass
class PassTiming:
    fleet_s: float = 0.0
    queue_s: float = 0.0
    tenants_s: float = 0.0
    plan_s: float = 0.0
    claim_s: float = 0.0
    free: int = 0
    pending: int = 0
    starts: int = 0
    preemptions: int = 0

    @property
    def read_s(self) -> float:
        return self.fleet_s + self.queue_s + self.tenants_s

    @property
    def total_s(self) -> float:
        return self.read_s + self.plan_s + self.claim_s


def timed_pass(db: Database, token: int) -> PassTiming:
    """``JobDispatcher.dispatch_pass`` with a clock between its steps (same calls,
    same transactions, the lease's fencing token checked)."""
    def check_lease(session: Session) -> None:
        if not leases.still_held(session, LEASE, token):
            raise RuntimeError("lost the dispatcher lease")

    timing = PassTiming()
    t0 = time.perf_counter()
    with db.transaction(write=False) as session:
        now = db.now(session)
        fleet = dispatch.load_fleet(session, now, 3600)
        t1 = time.perf_counter()
        timing.fleet_s, timing.free = t1 - t0, fleet.free.free_count()
        if not can_act(fleet.free, fleet.placed):
            return timing
        pending = dispatch.load_queue(session, now, max(1, min(MAX_HEADS, timing.free)))
        t2 = time.perf_counter()
        timing.queue_s = t2 - t1
        timing.pending = len(pending)
        if not pending:
            return timing
        ids = {p.work.tenant_id for p in pending} | {p.work.tenant_id for p in fleet.placed}
        tenants = dispatch.load_tenants(session, ids)
        usage = dispatch.load_usage(session, ids, SETTINGS.usage_half_life_s)
    t3 = time.perf_counter()
    plan = plan_dispatch(pending, fleet.free, tenants, usage, fleet.placed, now.timestamp())
    t4 = time.perf_counter()
    with db.transaction() as session:
        orders = dispatch.claim(session, plan.starts, fleet, SETTINGS, db.now(session),
                                check_lease)
    for job, victims in plan.preemptions:
        with db.transaction() as session:
            timing.preemptions += len(dispatch.request_preemption(
                session, victims, job.work.id, fleet, SETTINGS, db.now(session), check_lease))
    t5 = time.perf_counter()
    timing.tenants_s, timing.plan_s, timing.claim_s = t3 - t2, t4 - t3, t5 - t4
    timing.starts = len(orders)
    return timing


def bulk_submit(db: Database, tenants: list[Tenant], count: int, rng: random.Random,
                batch: int, paid: set[str]) -> float:
    """Admit ``count`` jobs of the mix, ``batch`` per transaction, tenants in turn;
    returns admissions per second."""
    with db.transaction(write=False) as session:
        shapes = admission.fleet_shapes(session)
    gpu_sizes, gpu_weights = zip(*GPU_CHOICES, strict=True)
    type_lists, type_weights = zip(*TYPE_CHOICES, strict=True)
    start = time.perf_counter()
    done = 0
    while done < count:
        with db.transaction() as session:
            for _ in range(min(batch, count - done)):
                tenant = tenants[done % len(tenants)]
                gpus = rng.choices(gpu_sizes, gpu_weights)[0]
                types = rng.choices(type_lists, type_weights)[0]
                vram = 40 if rng.random() < 0.1 and "A10G" not in types else 0
                request = admission.JobRequest(
                    binary=BINARY, args={"prompt": "a red fox", "seed": rng.getrandbits(48)},
                    gpus=gpus, gpu_types=types, vram_gb=vram, timeout_s=3600,
                    tier="paid" if tenant.project_id in paid else "free")
                admission.submit(session, tenant.admission, request, SETTINGS, shapes, ACTOR,
                                 db.now(session))
                done += 1
    return count / (time.perf_counter() - start)


def queued_count(db: Database) -> int:
    with db.transaction(write=False) as session:
        return int(session.execute(select(func.count()).select_from(Job)
                                   .where(Job.state == JobState.QUEUED)).scalar_one())


def free_gpus(db: Database, count: int) -> int:
    """Finish ``count`` placed 1-GPU jobs (started, then a success report, one
    transaction each, as their agents would): their GPUs come free."""
    with db.transaction(write=False) as session:
        rows = session.execute(
            select(JobAttempt.job_id, JobAttempt.attempt, JobAttempt.host_id,
                   JobAttempt.host_boot_id)
            .join(Job, (Job.id == JobAttempt.job_id) & (Job.attempt == JobAttempt.attempt))
            .where(Job.state.in_(list(PLACED)), Job.gpus == 1, JobAttempt.state != "ended")
            .order_by(JobAttempt.created_at, JobAttempt.job_id).limit(count)).all()
    facts = attempts.Facts(seq=1, gpu_ms=60_000, exit_code=0, result=[
        {"name": "video.mp4", "key": "jobs/x/1/output/video.mp4", "size": 3, "sha256": "ab"}])
    for job_id, attempt, host_id, boot_id in rows:
        with db.transaction() as session:
            now = db.now(session)
            attempts.started(session, job_id, attempt, now)
            attempts.finish(session, job_id, attempt, host_id, boot_id, facts, SETTINGS, now,
                            0.5)
    return len(rows)


def cancel_queued(db: Database, keep: int, batch: int = 200) -> None:
    """Cancel queued jobs (the newest first) until ``keep`` are left."""
    while (extra := queued_count(db) - keep) > 0:
        with db.transaction() as session:
            now = db.now(session)
            jobs = session.execute(select(Job).where(Job.state == JobState.QUEUED)
                                   .order_by(Job.created_at.desc(), Job.id.desc())
                                   .limit(min(batch, extra)).with_for_update()).scalars()
            for job in jobs:
                attempts.cancel(session, job, SETTINGS, now)


def steady(db: Database, token: int, free: int, repeats: int) -> dict[str, float]:
    """Median pass over ``repeats`` passes, each after ``free`` GPUs came free."""
    timings = []
    for _ in range(repeats):
        free_gpus(db, free)
        timings.append(timed_pass(db, token))
    med = statistics.median
    return {"pass_ms": med(t.total_s for t in timings) * 1000,
            "read_ms": med(t.read_s for t in timings) * 1000,
            "fleet_read_ms": med(t.fleet_s for t in timings) * 1000,
            "queue_read_ms": med(t.queue_s for t in timings) * 1000,
            "plan_ms": med(t.plan_s for t in timings) * 1000,
            "claim_ms": med(t.claim_s for t in timings) * 1000,
            "free_gpus": med(t.free for t in timings),
            "pending_read": med(t.pending for t in timings),
            "starts": med(t.starts for t in timings)}


def run_dispatch(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    result: dict[str, float] = {}
    rng = random.Random(7)
    with throwaway_db(kind, args.pg_url, tmp / "dispatch-db", "jobs-bench") as db:
        with stderr.status(f"{kind} dispatch: {args.hosts} hosts, "
                           f"{args.dispatch_tenants} tenants"):
            result["hosts"] = args.hosts
            result["gpus"] = add_hosts(db, args.hosts, args.gpus_per_host, alive=True)
            register_binary(db, ["/bin/true"])
            tenants = new_tenants(db, args.dispatch_tenants)
            paid = {t.project_id for t in tenants[: max(1, len(tenants) // 5)]}
            with db.transaction() as session:  # weights 1, 2 and 4
                for i, tenant in enumerate(tenants):
                    session.execute(update(Project).where(Project.id == tenant.project_id)
                                    .values(job_weight=float(2 ** (i % 3))))
        with stderr.status(f"{kind} dispatch: admitting {args.queued} jobs"):
            result["bulk_admit_per_s"] = bulk_submit(db, tenants, args.queued, rng,
                                                     args.batch, paid)
        result["queued"] = queued_count(db)
        token = leases.acquire(db, LEASE, "bench-jobs", 3600)
        assert token is not None
        # Fill: passes until one starts nothing.
        fill: list[PassTiming] = []
        with stderr.status(f"{kind} dispatch: filling the fleet"):
            while True:
                timing = timed_pass(db, token)
                if not timing.starts:
                    break
                fill.append(timing)
        if not fill:
            raise RuntimeError("the first dispatch pass started nothing")
        first = fill[0]
        starts = sum(t.starts for t in fill)
        result |= {
            "fill_passes": len(fill), "fill_starts": starts,
            "fill_s": sum(t.total_s for t in fill),
            "decisions_per_s": starts / sum(t.total_s for t in fill),
            "first_pass_pending": first.pending, "first_pass_starts": first.starts,
            "first_pass_ms": first.total_s * 1000, "first_pass_read_ms": first.read_s * 1000,
            "first_pass_fleet_read_ms": first.fleet_s * 1000,
            "first_pass_queue_read_ms": first.queue_s * 1000,
            "first_pass_plan_ms": first.plan_s * 1000,
            "first_pass_claim_ms": first.claim_s * 1000,
            "free_after_fill": timing.free, "queued_after_fill": queued_count(db)}
        stderr.print(
            f"{BENCH}: {kind} dispatch fill: {starts} starts in {len(fill)} passes, "
            f"{result['decisions_per_s']:.0f} decisions/s; first pass "
            f"{first.total_s * 1000:.0f} ms = read {first.read_s * 1000:.0f} (queue "
            f"{first.queue_s * 1000:.0f}) + plan {first.plan_s * 1000:.0f} + claim "
            f"{first.claim_s * 1000:.0f} ms; {timing.free} GPUs free after, "
            f"{result['queued_after_fill']:.0f} still queued", highlight=False)
        # Steady state: the fleet full, a few GPUs freed before each pass.
        for queue in (args.queued, args.small_queue):
            with stderr.status(f"{kind} dispatch: steady state with {queue} queued"):
                if queued_count(db) < queue:
                    bulk_submit(db, tenants, queue - queued_count(db), rng, args.batch, paid)
                cancel_queued(db, queue)
                for free in args.free:
                    tag = f"q{queue}_k{free}"
                    result[f"steady_queued_{tag}"] = queued_count(db)
                    figures = steady(db, token, free, args.steady_repeats)
                    for name, value in figures.items():
                        result[f"steady_{name}_{tag}"] = value
                    stderr.print(
                        f"{BENCH}: {kind} dispatch steady, {result[f'steady_queued_{tag}']:.0f}"
                        f" queued, {figures['free_gpus']:.0f} GPUs free: pass "
                        f"{figures['pass_ms']:.1f} ms = read {figures['read_ms']:.1f} (fleet "
                        f"{figures['fleet_read_ms']:.1f}, queue {figures['queue_read_ms']:.1f})"
                        f" + plan {figures['plan_ms']:.1f} + "
                        f"claim {figures['claim_ms']:.1f} ms, {figures['starts']:.0f} starts",
                        highlight=False)
        leases.release(db, LEASE, "bench-jobs")
    return {f"dispatch_{name}": value for name, value in result.items()}


# ------------------------------------------------------------ part 3: latency
def measure_latency(url: str, tenant: Tenant, args: argparse.Namespace) -> dict[str, float]:
    db_ms: list[float] = []
    client_ms: list[float] = []
    post_ms: list[float] = []
    schedule_ms: list[float] = []
    ids: list[str] = []
    poll = args.poll_ms / 1000
    with httpx.Client(base_url=url, timeout=60.0,
                      headers={"Authorization": f"Bearer {tenant.token}"}) as http:
        for n in range(args.latency_warmup + args.latency_jobs):
            body = job_body(n, args={"behavior": "success", "duration": 0.05,
                                     "progress-interval": 0.05, "seed": n})
            t0 = time.perf_counter()
            posted = http.post("/v1/jobs", json=body,
                               headers={"Idempotency-Key": str(uuid.uuid4())})
            t1 = time.perf_counter()
            if posted.status_code != 202:
                raise RuntimeError(f"POST /v1/jobs: {posted.status_code} {posted.text[:300]}")
            job_id = posted.json()["id"]
            deadline = t0 + 30
            while True:
                view = http.get(f"/v1/jobs/{job_id}").json()
                if view["started_at"]:
                    break
                if view["state"] in TERMINAL or time.perf_counter() > deadline:
                    raise RuntimeError(f"{job_id} did not start: {view['state']} "
                                       f"{view['reason']}")
                time.sleep(poll)
            t2 = time.perf_counter()
            if n < args.latency_warmup:
                continue
            ids.append(job_id)
            created = parse_time(view["created_at"])
            db_ms.append((parse_time(view["started_at"]) - created).total_seconds() * 1000)
            client_ms.append((t2 - t0) * 1000)
            post_ms.append((t1 - t0) * 1000)
            events = http.get(f"/v1/jobs/{job_id}/events").json()["items"]
            scheduled = next(e["at"] for e in events if e["to"] == "scheduled")
            schedule_ms.append((parse_time(scheduled) - created).total_seconds() * 1000)
        succeeded = wait_ended(http, ids)
    result: dict[str, float] = {}
    for name, values in (("start", db_ms), ("client_start", client_ms), ("post", post_ms),
                         ("schedule", schedule_ms)):
        for q in (50, 90, 99):
            result[f"{name}_p{q}_ms"] = quantile(values, q / 100)
    result["latency_jobs"] = len(ids)
    result["latency_succeeded"] = succeeded
    return result


def wait_ended(http: httpx.Client, ids: list[str], timeout: float = 60.0) -> int:
    """Wait for the jobs to end; how many succeeded."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    for job_id in ids:
        while (state := http.get(f"/v1/jobs/{job_id}").json()["state"]) not in TERMINAL:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        states[job_id] = state
    return sum(state == "succeeded" for state in states.values())


def run_latency(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    home = tmp / "latency-home"
    with throwaway_db(kind, args.pg_url, tmp / "latency-db", "jobs-bench") as db:
        register_binary(db, [sys.executable, str(FAKEGEN)])
        (tenant,) = new_tenants(db, 1)
        with control_plane(db.url, home, "--job-dispatch-interval", "1") as (url, _), \
                agent(db, url, home, "4xA100-80GB"):
            result = measure_latency(url, tenant, args)
    verdict = "met" if result["start_p50_ms"] < TARGET_START_P50_MS else "NOT met"
    stderr.print(
        f"{BENCH}: {kind} submit-to-start over {result['latency_jobs']:.0f} jobs: p50/p90/p99 "
        f"{result['start_p50_ms']:.1f}/{result['start_p90_ms']:.1f}/"
        f"{result['start_p99_ms']:.1f} ms (DB clock), client {result['client_start_p50_ms']:.1f}/"
        f"{result['client_start_p90_ms']:.1f}/{result['client_start_p99_ms']:.1f} ms; "
        f"to scheduled p50 {result['schedule_p50_ms']:.1f} ms; "
        f"{result['latency_succeeded']:.0f} succeeded | target p50 < "
        f"{TARGET_START_P50_MS:.0f} ms: {verdict}", highlight=False)
    return result


# ------------------------------------------------------------------------ main
PARTS: dict[str, Callable[[str, argparse.Namespace, Path], dict[str, float]]] = {
    "submit": run_submit, "dispatch": run_dispatch, "latency": run_latency}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="GPU jobs: submissions/s through the API, dispatch decisions/s with a "
                    "large queue and fleet, submit-to-start latency. Prints one JSON line "
                    "per figure.")
    parser.add_argument("--db", choices=("postgres", "sqlite", "both"), default="postgres")
    parser.add_argument("--pg-url", default=PG_DEFAULT,
                        help="an admin URL of the PostgreSQL server; a throwaway database "
                             "is created and dropped per part (default: %(default)s)")
    parser.add_argument("--parts", default="submit,dispatch,latency",
                        help="comma-separated, of submit, dispatch, latency "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: everything small (under a minute)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per throughput figure (default: %(default)s)")
    submit = parser.add_argument_group("submit")
    submit.add_argument("--clients", type=int, default=32,
                        help="concurrent HTTP clients (default: %(default)s)")
    submit.add_argument("--workers", type=int, default=1,
                        help="control-plane processes (nbfleet control --workers; on "
                             "SQLite always 1) (default: %(default)s)")
    submit.add_argument("--submissions", type=int, default=2000,
                        help="requests per measurement (default: %(default)s)")
    submit.add_argument("--tenants", type=int, default=32,
                        help="tenants the clients submit as, in turn (default: %(default)s)")
    submit.add_argument("--seconds", type=float, default=3.0,
                        help="seconds per in-process measurement (default: %(default)s)")
    disp = parser.add_argument_group("dispatch")
    disp.add_argument("--hosts", type=int, default=1000, help="(default: %(default)s)")
    disp.add_argument("--gpus-per-host", type=int, default=8, help="(default: %(default)s)")
    disp.add_argument("--queued", type=int, default=10_000, help="(default: %(default)s)")
    disp.add_argument("--small-queue", type=int, default=1000,
                      help="the second steady-state queue length (default: %(default)s)")
    disp.add_argument("--dispatch-tenants", type=int, default=50,
                      help="(default: %(default)s)")
    disp.add_argument("--free", default="8,64",
                      help="GPUs freed before each steady-state pass, comma-separated "
                           "(default: %(default)s)")
    disp.add_argument("--steady-repeats", type=int, default=7,
                      help="steady-state passes per figure (default: %(default)s)")
    disp.add_argument("--batch", type=int, default=200,
                      help="admissions per transaction when queueing (default: %(default)s)")
    lat = parser.add_argument_group("latency")
    lat.add_argument("--latency-jobs", type=int, default=100, help="(default: %(default)s)")
    lat.add_argument("--latency-warmup", type=int, default=5, help="(default: %(default)s)")
    lat.add_argument("--poll-ms", type=float, default=50.0,
                     help="how often the client asks whether the job started "
                          "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.clients = min(args.clients, 16)
        args.tenants = min(args.tenants, 16)
        args.submissions = 300
        args.seconds = 1.0
        args.hosts, args.queued, args.small_queue = 100, 1000, 100
        args.dispatch_tenants = 10
        args.free = "8"
        args.steady_repeats = 2
        args.latency_jobs, args.latency_warmup = 15, 2
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        parser.error(f"--parts takes a comma-separated list of {', '.join(PARTS)}")
    try:
        args.free = [int(f) for f in args.free.split(",") if f.strip()]
    except ValueError:
        parser.error("--free takes comma-separated integers")
    if min(args.clients, args.submissions, args.tenants, args.repeats, args.hosts,
           args.gpus_per_host, args.queued, args.dispatch_tenants, args.latency_jobs,
           args.steady_repeats, args.batch, *args.free) < 1 or args.seconds <= 0:
        parser.error("counts must be at least 1 and --seconds positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = ("postgres", "sqlite") if args.db == "both" else (args.db,)
    with tempfile.TemporaryDirectory(prefix="nbfleet-bench-jobs-") as tmp:
        try:
            for kind in kinds:
                for part in args.parts:
                    stderr.print(f"{BENCH}: {kind}: {part}", highlight=False)
                    directory = Path(tmp) / f"{kind}-{part}"
                    directory.mkdir()
                    for figure, value in PARTS[part](kind, args, directory).items():
                        emit(BENCH, f"{kind}_{figure}", value)
        except KeyboardInterrupt:
            stderr.print("interrupted; cleaned up")
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
