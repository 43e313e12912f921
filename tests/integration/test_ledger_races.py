"""Races on the ledger: real threads, each with its own transactions (``ledger.service``,
on the DB clock). They matter most on PostgreSQL; SQLite serialises its writers."""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update

from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.engine import Database
from nbfleet.ledger import grants, service
from nbfleet.ledger.metering import UsageReport
from nbfleet.model.credits import usage_cost
from nbfleet.model.errors import PaymentRequired
from tests.support.ledger import ADMIN, Tenant, assert_verified, give, new_tenant
from tests.support.ledger_ops import assert_balanced, hold, txns

RATE = 3_600_000  # 1 micro-credit per GPU-ms



def db_now(db: Database) -> Any:
    with db.transaction(write=False) as session:
        return db.now(session)


def funded(db: Database, amount: int) -> Tenant:
    tenant = new_tenant(db)
    give(db, tenant.owner(db), amount, now=db_now(db))
    return tenant


def together(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` on ``count`` threads released at once; results or exceptions."""
    barrier = threading.Barrier(count)

    def run(index: int) -> Any:
        barrier.wait()
        try:
            return work(index)
        except Exception as error:
            return error

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def hold_count(db: Database) -> int:
    with db.transaction(write=False) as session:
        return int(session.execute(select(func.count()).select_from(CreditHold)).scalar_one())


def check(db: Database) -> None:
    assert_balanced(db)
    assert_verified(db)


def test_64_reserves_against_100_credits_admit_exactly_10(db: Database) -> None:
    tenant = funded(db, 100)
    results = together(64, lambda i: service.reserve(
        db, tenant.hold_request(f"job-{i}", 10), ADMIN))
    admitted = [r for r in results if isinstance(r, tuple)]
    refused = [r for r in results if isinstance(r, PaymentRequired)]
    assert len(admitted) == 10, [r for r in results if isinstance(r, Exception)
                                 and not isinstance(r, PaymentRequired)]
    assert len(refused) == 54
    assert all(error.extra["reason"] == "insufficient_credits" for error in refused)
    assert all(created for _hold, created in admitted)
    assert hold_count(db) == 10
    owner = tenant.owner(db)
    with db.transaction(write=False) as session:
        balance = grants.balance(session, owner, db.now(session))
    assert (balance["available"], balance["held"]) == (0, 100)
    check(db)


def test_duplicate_admissions_share_one_hold(db: Database) -> None:
    tenant = funded(db, 100)
    results = together(64, lambda i: service.reserve(
        db, tenant.hold_request(f"job-{i // 2}", 10), ADMIN))
    unexpected = [r for r in results if isinstance(r, Exception)
                  and not isinstance(r, PaymentRequired)]
    assert not unexpected, unexpected
    by_work: dict[str, set[str]] = defaultdict(set)
    created: dict[str, int] = defaultdict(int)
    for result in results:
        if isinstance(result, tuple):
            row, was_created = result
            by_work[row.work_id].add(row.id)
            created[row.work_id] += was_created
    assert len(by_work) == 10
    assert all(len(ids) == 1 for ids in by_work.values())
    assert all(count == 1 for count in created.values())
    assert hold_count(db) == 10
    for index in range(32):  # both of a pair got the hold, or both were refused
        pair = results[2 * index: 2 * index + 2]
        ids = {r[0].id for r in pair if isinstance(r, tuple)}
        assert len(ids) <= 1
    check(db)


def lapse(db: Database, hold_id: str) -> None:
    with db.transaction() as session:
        session.execute(update(CreditHold).where(CreditHold.id == hold_id).values(
            lease_expires_at=db.now(session) - timedelta(seconds=5)))


def test_settle_racing_the_reaper_releases_once(db: Database) -> None:
    tenant = funded(db, 10_000)
    for index in range(20):
        row, _created = service.reserve(db, tenant.hold_request(f"job-{index}", 100), ADMIN)
        if index % 2:
            service.meter(db, [UsageReport(row.id, 1, 30)], ADMIN)
        lapse(db, row.id)
        settled, reaped = together(2, lambda i, h=row.id: (
            service.settle(db, h, "finished", ADMIN) if i == 0 else service.reap(db)))
        assert not isinstance(settled, Exception), settled
        assert not isinstance(reaped, Exception), reaped
        _hold, changed = settled
        assert changed != (row.id in reaped), (changed, reaped)
        assert txns(db, row.id).count("release") == 1
        final = hold(db, row.id)
        assert (final.state, final.held) == ("settled", 0)
        assert final.released == 100 - (30 if index % 2 else 0)
        assert final.settle_reason == ("finished" if changed else "lease_expired")
    check(db)


def test_concurrent_usage_batches_capture_the_highest_counter(db: Database) -> None:
    tenant = funded(db, 100_000)
    holds = [service.reserve(db, tenant.hold_request(f"job-{i}", amount), ADMIN)[0].id
             for i, amount in enumerate([5_000, 5_000, 300, 1_000])]
    reports = [(hold_id, seq, seq * 97) for hold_id in holds for seq in range(1, 21)]
    rng = random.Random(5)
    batches = []
    for _thread in range(16):
        batch = rng.sample(reports, 30) + rng.sample(reports, 5)  # overlaps and duplicates
        rng.shuffle(batch)  # reordered
        batches.append([UsageReport(h, seq, ms) for h, seq, ms in batch])
    # someone sends each hold's last report
    batches[0] += [UsageReport(h, 20, 20 * 97) for h in holds]
    results = together(16, lambda i: service.meter(db, batches[i], ADMIN))
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
    for hold_id in holds:
        final = hold(db, hold_id)
        assert (final.gpu_ms, final.last_seq) == (20 * 97, 20)
        assert final.captured == usage_cost(20 * 97, RATE)
        assert final.uncovered == 0
        assert final.amount == final.captured + final.held
    check(db)


def test_a_mixed_storm_on_one_wallet_never_deadlocks(db: Database) -> None:
    """Reserves, usage that needs extensions, settles with a final report and
    reapers, all at once on one tenant's buckets and counters (and its org's):
    with one lock order, nothing deadlocks (PostgreSQL would abort a deadlocked
    transaction with an error) and the books balance afterwards."""
    tenant = funded(db, 40_000)
    give(db, tenant.owner(db, project_wallet=False), 20_000, now=db_now(db))

    def storm(index: int) -> int:
        rng = random.Random(index)
        done = 0
        for round_ in range(6):
            try:
                hold_id = service.reserve(
                    db, tenant.hold_request(f"w{index}-{round_}", rng.randint(50, 400),
                                            lease_s=1 if index % 6 == 0 else 300), ADMIN)[0].id
            except PaymentRequired:
                continue
            for seq in range(1, rng.randint(2, 5)):
                service.meter(db, [UsageReport(hold_id, seq, seq * rng.randint(50, 300))],
                              ADMIN)
            if index % 6:
                service.settle(db, hold_id, "finished", ADMIN,
                               final=UsageReport(hold_id, 10, rng.randint(200, 900)))
            else:
                service.reap(db)
            done += 1
        return done

    results = together(24, storm)
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors
    assert sum(results) > 24  # most rounds found credit
    check(db)
