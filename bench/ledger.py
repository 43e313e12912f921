"""Throughput of the credit ledger: holds, usage reports, against a trivial write.

Drives ``nbfleet.ledger.service`` directly (the functions the credits API calls),
from N threads at once, each in its own short transactions, on a throwaway SQLite
file (WAL, ``BEGIN IMMEDIATE``) and/or a throwaway PostgreSQL database. For each
database and client count it measures, in this order and ``--repeats`` times:

* ``baseline_txn_per_s``: a trivial write transaction per call (an ``UPDATE`` of the
  client's own row in a scratch table inside ``db.transaction()``), the same
  machinery every ledger call goes through, so the ratios are honest;
* ``reserve_per_s``: each client reserves small holds with distinct work ids, all
  from one wallet with plenty of credit, for ``--seconds``;
* ``settle_per_s``: then each client settles the holds it reserved (timed apart);
* ``usage_single_per_s``: one usage report per call (``service.meter(db, [r])``),
  each client advancing the cumulative ``gpu_ms`` of its own active holds in turn;
* ``usage_batched_per_s``: ``--batch`` reports per call, for distinct holds.

Usage figures count reports, not calls. ``*_vs_baseline`` divides a figure by the
baseline's transactions per second. The figures are medians over the repeats.
After each database's run, ``verify.verify`` must find the whole ledger consistent
(``<db>_verify_ok``) and granted = available + held + consumed + expired
(``<db>_invariant_ok``), and what the buckets consumed must equal what the holds
captured. By default every client works on one tenant's wallet (the hot-bucket
worst case); ``--tenants per-client`` gives each client its own.

    .venv/bin/python bench/ledger.py --db both --clients 1,8,32 --seconds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import func, select, text

from harness import emit, stderr, throwaway_db
from nbfleet.control import tenancy
from nbfleet.db.credit_tables import CreditBucket, CreditHold
from nbfleet.db.engine import Database
from nbfleet.db.tables import User
from nbfleet.ledger import audit, grants, holds, service, verify
from nbfleet.ledger.metering import APPLIED, UsageReport
from nbfleet.ledger.wallets import owner_by_ids
from nbfleet.model.credits import GrantKind

BENCH = "ledger"
TARGET_USAGE_PER_S = 5000.0
ACTOR = audit.Actor("system:bench", request_id="bench-ledger")
#: 3.6 credits per GPU-hour: one micro-credit per GPU-millisecond.
RATE = 3_600_000
#: A wallet nothing here can empty.
GRANT = 10**15
#: A reserve/settle hold: small.
SMALL_HOLD = 1_000
#: A metered hold: large enough never to need an extension during the run.
USAGE_HOLD = 10**9
#: GPU-milliseconds each usage report adds to its hold's counter.
STEP_MS = 1_000
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"


# ----------------------------------------------------------------------- databases
@dataclass(frozen=True)
class Tenant:
    org_id: str
    project_id: str
    user_id: str

    def hold(self, work_id: str, amount: int) -> holds.HoldRequest:
        return holds.HoldRequest(work_id, self.org_id, self.project_id, self.user_id,
                                 "A100-80GB", RATE, amount, lease_s=3600)


def new_tenant(db: Database) -> Tenant:
    """A user in a new org, with plenty of credit in its project's wallet."""
    suffix = uuid.uuid4().hex[:8]
    created = tenancy.create_user(db, f"bench-{suffix}", f"bench-{suffix}", "bench")
    with db.transaction() as session:
        user = session.execute(select(User).where(User.id == created.user_id)).scalar_one()
        tenant = Tenant(user.org_id, user.project_id, user.id)
        grants.issue(session, owner_by_ids(session, tenant.org_id, tenant.project_id),
                     grants.GrantRequest(GrantKind.PURCHASE, GRANT), ACTOR, db.now(session))
    return tenant


def create_scratch(db: Database, clients: int) -> None:
    with db.transaction() as session:
        session.execute(text("CREATE TABLE IF NOT EXISTS bench_scratch "
                             "(id INTEGER PRIMARY KEY, n BIGINT NOT NULL)"))
        session.execute(text("DELETE FROM bench_scratch"))
        for client in range(clients):
            session.execute(text("INSERT INTO bench_scratch (id, n) VALUES (:id, 0)"),
                            {"id": client})


# ------------------------------------------------------------------- measuring
@dataclass
class Client:
    """What one thread works on: its tenant, its metered holds and their counters."""

    index: int
    tenant: Tenant
    usage_holds: list[str] = field(default_factory=list)
    seq: dict[str, int] = field(default_factory=dict)
    reserved: list[str] = field(default_factory=list)
    cursor: int = 0

    def next_reports(self, count: int) -> list[UsageReport]:
        """The next ``count`` reports, for distinct holds (round robin)."""
        reports = []
        for _ in range(count):
            hold_id = self.usage_holds[self.cursor % len(self.usage_holds)]
            self.cursor += 1
            seq = self.seq[hold_id] = self.seq.get(hold_id, 0) + 1
            reports.append(UsageReport(hold_id, seq, seq * STEP_MS))
        return reports


#: One call of a client: how many operations it did (usage reports count each).
Step = Callable[[Client], int]


def run_clients(clients: list[Client], step: Step, seconds: float | None) -> float:
    """Run ``step`` in a thread per client until ``seconds`` pass (or, with None,
    until a step returns 0); return operations per second over all of them."""
    barrier = threading.Barrier(len(clients) + 1)
    counts = [0] * len(clients)
    errors: list[BaseException] = []
    deadline = [0.0]

    def work(client: Client) -> None:
        try:
            barrier.wait()
            done = 0
            while seconds is None or time.perf_counter() < deadline[0]:
                n = step(client)
                if n == 0:
                    break
                done += n
            counts[client.index] = done
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    deadline[0] = start + (seconds or 0.0)
    barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def baseline_step(db: Database) -> Step:
    update = text("UPDATE bench_scratch SET n = n + 1 WHERE id = :id")

    def step(client: Client) -> int:
        with db.transaction() as session:
            session.execute(update, {"id": client.index})
        return 1

    return step


def reserve_step(db: Database) -> Step:
    def step(client: Client) -> int:
        hold, created = service.reserve(
            db, client.tenant.hold(f"bench-{uuid.uuid4().hex}", SMALL_HOLD), ACTOR)
        assert created
        client.reserved.append(hold.id)
        return 1

    return step


def settle_step(db: Database) -> Step:
    def step(client: Client) -> int:
        if not client.reserved:
            return 0
        _hold, changed = service.settle(db, client.reserved.pop(), "finished", ACTOR)
        assert changed
        return 1

    return step


def usage_step(db: Database, batch: int) -> Step:
    def step(client: Client) -> int:
        outcomes = service.meter(db, client.next_reports(batch), ACTOR)
        bad = [o.status for o in outcomes if o.status != APPLIED]
        assert not bad, f"unexpected usage outcomes {bad[:5]}"
        return len(outcomes)

    return step


def prepare_usage_holds(db: Database, clients: list[Client], per_client: int) -> None:
    """Reserve each client's metered holds (untimed), from all clients at once."""
    def step(client: Client) -> int:
        if len(client.usage_holds) >= per_client:
            return 0
        hold, _ = service.reserve(
            db, client.tenant.hold(f"bench-usage-{uuid.uuid4().hex}", USAGE_HOLD), ACTOR)
        client.usage_holds.append(hold.id)
        return 1

    run_clients(clients, step, None)


def settle_usage_holds(db: Database, clients: list[Client]) -> None:
    def step(client: Client) -> int:
        if not client.usage_holds:
            return 0
        service.settle(db, client.usage_holds.pop(), "finished", ACTOR)
        return 1

    run_clients(clients, step, None)


def measure(db: Database, name: str, n_clients: int, args: argparse.Namespace,
            shared: Tenant | None) -> dict[str, float]:
    clients = [Client(i, shared or new_tenant(db)) for i in range(n_clients)]
    create_scratch(db, n_clients)
    with stderr.status(f"{name} c{n_clients}: reserving the metered holds"):
        prepare_usage_holds(db, clients, max(args.holds, args.batch))
    phases: list[tuple[str, Step]] = [
        ("baseline_txn_per_s", baseline_step(db)),
        ("reserve_per_s", reserve_step(db)),
        ("settle_per_s", settle_step(db)),
        ("usage_single_per_s", usage_step(db, 1)),
        ("usage_batched_per_s", usage_step(db, args.batch)),
    ]
    samples: dict[str, list[float]] = {phase: [] for phase, _ in phases}
    with stderr.status(f"{name} c{n_clients}") as status:
        for repeat in range(args.repeats):
            for phase, step in phases:
                status.update(f"{name} c{n_clients} repeat {repeat + 1}/{args.repeats}: {phase}")
                # Settling is timed over the holds the reserve phase made, however long.
                seconds = None if phase == "settle_per_s" else args.seconds
                samples[phase].append(run_clients(clients, step, seconds))
        status.update(f"{name} c{n_clients}: settling the metered holds")
        settle_usage_holds(db, clients)
    result = {phase: statistics.median(values) for phase, values in samples.items()}
    base = result["baseline_txn_per_s"]
    for phase in ("reserve_per_s", "settle_per_s", "usage_single_per_s", "usage_batched_per_s"):
        result[phase.removesuffix("_per_s") + "_vs_baseline"] = result[phase] / base
    return result


def check(db: Database) -> dict[str, float]:
    """The reconciliation check, the invariant, and consumed == captured."""
    with db.transaction(write=False) as session:
        report = verify.verify(session)
        sums = session.execute(select(
            func.coalesce(func.sum(CreditBucket.amount), 0),
            func.coalesce(func.sum(CreditBucket.available), 0),
            func.coalesce(func.sum(CreditBucket.held), 0),
            func.coalesce(func.sum(CreditBucket.consumed), 0),
            func.coalesce(func.sum(CreditBucket.expired), 0))).one()
        captured = session.execute(
            select(func.coalesce(func.sum(CreditHold.captured), 0))).scalar_one()
        active = session.execute(select(func.count()).select_from(CreditHold)
                                 .where(CreditHold.state == holds.ACTIVE)).scalar_one()
    granted, available, held, consumed, expired = (int(v) for v in sums)
    for message in report.mismatches[:10]:
        stderr.print(f"verify: {message}", highlight=False)
    balanced = granted == available + held + consumed + expired and int(captured) == consumed
    return {"verify_ok": float(report.ok), "invariant_ok": float(balanced),
            "verify_wallets": report.wallets, "verify_buckets": report.buckets,
            "verify_holds": report.holds, "verify_entries": report.entries,
            "active_holds_left": active, "granted": granted, "available": available,
            "held": held, "consumed": consumed, "expired": expired}


def run_db(kind: str, args: argparse.Namespace, directory: Path) -> bool:
    ok = True
    with throwaway_db(kind, args.pg_url, directory, "ledger-bench") as db:
        shared = new_tenant(db) if args.tenants == "shared" else None
        for n_clients in args.clients:
            result = measure(db, kind, n_clients, args, shared)
            for figure, value in result.items():
                emit(BENCH, f"{kind}_{figure}_c{n_clients}", value)
            summary(kind, n_clients, result)
        checked = check(db)
        for figure, value in checked.items():
            emit(BENCH, f"{kind}_{figure}", value)
        ok = bool(checked["verify_ok"] and checked["invariant_ok"])
        stderr.print(f"{kind}: verify {'ok' if checked['verify_ok'] else 'FAILED'} "
                     f"({checked['verify_entries']:.0f} journal entries, "
                     f"{checked['verify_holds']:.0f} holds), granted = available + held + "
                     f"consumed + expired: {'ok' if checked['invariant_ok'] else 'FAILED'}",
                     highlight=False)
    return ok


def summary(kind: str, n_clients: int, r: dict[str, float]) -> None:
    verdict = ("met" if r["usage_batched_per_s"] >= TARGET_USAGE_PER_S else "NOT met")
    print(f"{BENCH}: {kind} c{n_clients} | baseline {r['baseline_txn_per_s']:.0f} txn/s | "
          f"reserve {r['reserve_per_s']:.0f}/s, settle {r['settle_per_s']:.0f}/s | usage "
          f"single {r['usage_single_per_s']:.0f}/s, batched {r['usage_batched_per_s']:.0f}/s "
          f"(x{r['usage_batched_vs_baseline']:.1f} baseline) | target >= "
          f"{TARGET_USAGE_PER_S:.0f} usage reports/s: {verdict}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Credit ledger throughput (holds, usage reports) against a trivial "
                    "write transaction. Prints one JSON line per figure.")
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--clients", default="1,8,32",
                        help="comma-separated thread counts (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="seconds per measurement (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=100,
                        help="usage reports per batched call (default: %(default)s)")
    parser.add_argument("--holds", type=int, default=100,
                        help="metered holds per client, at least --batch (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per figure; the median is printed "
                             "(default: %(default)s)")
    parser.add_argument("--tenants", choices=("shared", "per-client"), default="shared",
                        help="one wallet for all clients, or one each (default: %(default)s)")
    parser.add_argument("--pg-url", default=PG_DEFAULT,
                        help="an admin URL of the PostgreSQL server; a throwaway database "
                             "is created and dropped (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        parser.error("--clients takes comma-separated integers")
    if (not args.clients or min(args.clients) < 1 or args.batch < 1 or args.seconds <= 0
            or args.repeats < 1):
        parser.error("need clients >= 1, --batch >= 1, --seconds > 0, --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = ("sqlite", "postgres") if args.db == "both" else (args.db,)
    ok = True
    with tempfile.TemporaryDirectory(prefix="nbfleet-bench-ledger-") as tmp:
        try:
            for kind in kinds:
                ok = run_db(kind, args, Path(tmp)) and ok
        except KeyboardInterrupt:
            stderr.print("interrupted; cleaned up")
            return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
