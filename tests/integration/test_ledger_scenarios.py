"""The credit ledger, one story per test, with exact numbers and the exact journal."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from nbfleet.db.engine import Database
from nbfleet.ledger import metering, verify
from nbfleet.model.credits import Enforcement, GrantKind, Level, Period
from nbfleet.model.errors import PaymentRequired
from tests.support.ledger import (
    T0,
    Tenant,
    assert_verified,
    entries_of,
    give,
    later,
    new_tenant,
)
from tests.support.ledger_ops import (
    assert_balanced,
    audit_rows,
    bucket,
    budget,
    counter,
    expire,
    hold,
    hold_numbers,
    parts,
    reap,
    reserve,
    row_counts,
    settle,
    txns,
    usage,
)

DAY = "day:2026-11-23"
MONTH = "month:2026-11"



@pytest.fixture
def tenant(db: Database) -> Tenant:
    return new_tenant(db)


def check(db: Database) -> None:
    assert_balanced(db)
    assert_verified(db)


def test_preempted_at_60_percent_refunds_the_rest_to_its_buckets(db: Database,
                                                                 tenant: Tenant) -> None:
    owner = tenant.owner(db)
    promo = give(db, owner, 300, kind=GrantKind.PROMO)
    grant = give(db, owner, 500, kind=GrantKind.GRANT)
    paid = give(db, owner, 1000, kind=GrantKind.PURCHASE)
    h = reserve(db, tenant, "job-002", 1000)
    assert parts(db, h.id) == [(promo, 300, 300, 0), (grant, 500, 500, 0), (paid, 200, 200, 0)]
    check(db)
    # 1 micro-credit per GPU-ms: cumulative reports of 200, 450 and 600 GPU-ms
    for seq, (at, gpu_ms) in enumerate([(10, 200), (20, 450), (30, 600)], start=1):
        assert usage(db, h.id, seq, gpu_ms, later(at)).status == metering.APPLIED
        check(db)
    settled, changed = settle(db, h.id, "preempted", later(31))
    assert changed and settled.settle_reason == "preempted"

    release = sorted([(grant, 200), (paid, 200)])
    assert entries_of(db, h.id) == [
        ("reserve", promo, "available", -300), ("reserve", promo, "held", 300),
        ("reserve", grant, "available", -500), ("reserve", grant, "held", 500),
        ("reserve", paid, "available", -200), ("reserve", paid, "held", 200),
        ("capture", promo, "held", -200), ("capture", promo, "consumed", 200),
        ("capture", promo, "held", -100), ("capture", promo, "consumed", 100),
        ("capture", grant, "held", -150), ("capture", grant, "consumed", 150),
        ("capture", grant, "held", -150), ("capture", grant, "consumed", 150),
        *[entry for b, amount in release
          for entry in (("release", b, "held", -amount), ("release", b, "available", amount))],
    ]
    assert txns(db, h.id) == ["reserve", "capture", "capture", "capture", "release"]
    assert bucket(db, promo) == {"available": 0, "held": 0, "consumed": 300, "expired": 0}
    assert bucket(db, grant) == {"available": 200, "held": 0, "consumed": 300, "expired": 0}
    assert bucket(db, paid) == {"available": 1000, "held": 0, "consumed": 0, "expired": 0}
    assert hold_numbers(db, h.id) == {
        "amount": 1000, "held": 0, "captured": 600, "released": 400, "expired": 0,
        "uncovered": 0, "gpu_ms": 600, "last_seq": 3, "state": "settled"}
    assert parts(db, h.id) == [(promo, 300, 0, 300), (grant, 500, 0, 300), (paid, 200, 0, 0)]
    for scope in (f"org:{tenant.org_id}", f"project:{tenant.project_id}",
                  f"user:{tenant.user_id}"):
        assert counter(db, scope, DAY) == counter(db, scope, MONTH) == 600

    # The audit trail tells the same story, each row's before the previous one's after.
    rows = audit_rows(db, h.id)
    assert [action for action, _b, _a in rows] == ["reserve", "usage", "usage", "usage",
                                                   "settle"]
    assert rows[0][1] is None
    assert (rows[0][2]["held"], rows[0][2]["captured"]) == (1000, 0)
    for (_a, _before, after), (_a2, before, _after) in itertools.pairwise(rows):
        assert {k: before[k] for k in ("held", "captured", "released", "gpu_ms")} == {
            k: after[k] for k in ("held", "captured", "released", "gpu_ms")}
    assert [(after["captured"], after["held"], after["seq"]) for _a, _b, after in rows[1:4]] == [
        (200, 800, 1), (450, 550, 2), (600, 400, 3)]
    _action, before, after = rows[4]
    assert (before["held"], before["captured"], before["released"]) == (400, 600, 0)
    assert (after["held"], after["captured"], after["released"], after["expired"],
            after["state"], after["reason"]) == (0, 600, 400, 0, "settled", "preempted")
    check(db)


def test_a_lost_finish_is_reaped_exactly_once(db: Database, tenant: Tenant) -> None:
    paid = give(db, tenant.owner(db), 1000)
    h = reserve(db, tenant, "job-lost", 500, lease_s=60)
    assert usage(db, h.id, 1, 100, later(30)).status == metering.APPLIED
    assert hold(db, h.id).lease_expires_at == later(90)  # renewed from the report's now
    assert reap(db, later(89)) == []
    assert reap(db, later(90)) == [h.id]
    assert reap(db, later(91)) == []
    assert reap(db, later(3600)) == []
    late, changed = settle(db, h.id, "finished", later(120))
    assert not changed
    assert (late.settle_reason, late.settled_by) == ("lease_expired", "system:reaper")
    assert txns(db, h.id) == ["reserve", "capture", "release"]
    assert [e for e in entries_of(db, h.id) if e[0] == "release"] == [
        ("release", paid, "held", -400), ("release", paid, "available", 400)]
    assert hold_numbers(db, h.id) == {
        "amount": 500, "held": 0, "captured": 100, "released": 400, "expired": 0,
        "uncovered": 0, "gpu_ms": 100, "last_seq": 1, "state": "settled"}
    assert bucket(db, paid) == {"available": 900, "held": 0, "consumed": 100, "expired": 0}
    assert [a for a, _b, _a2 in audit_rows(db, h.id)] == ["reserve", "usage", "settle"]
    # a report that comes after the settle changes nothing
    assert usage(db, h.id, 2, 300, later(121)).status == metering.SETTLED
    assert hold_numbers(db, h.id)["captured"] == 100
    check(db)


def test_a_promo_expiring_mid_run_keeps_its_held_share_until_settle(
        db: Database, tenant: Tenant) -> None:
    owner = tenant.owner(db)
    promo = give(db, owner, 400, kind=GrantKind.PROMO, expires_at=later(100))
    paid = give(db, owner, 1000)
    other = reserve(db, tenant, "job-other", 100)  # promo 100, released below
    h = reserve(db, tenant, "job-run", 600)
    assert parts(db, h.id) == [(promo, 300, 300, 0), (paid, 300, 300, 0)]
    settle(db, other.id, "cancelled", later(10))
    assert bucket(db, promo) == {"available": 100, "held": 300, "consumed": 0, "expired": 0}
    check(db)

    assert usage(db, h.id, 1, 100, later(50)).status == metering.APPLIED
    # past the expiry instant, before the sweep: still drawn from the held promo share
    assert usage(db, h.id, 2, 180, later(110)).status == metering.APPLIED
    assert bucket(db, promo) == {"available": 100, "held": 120, "consumed": 180, "expired": 0}
    check(db)
    assert expire(db, later(120)) == 1
    assert expire(db, later(121)) == 0
    assert bucket(db, promo) == {"available": 0, "held": 120, "consumed": 180, "expired": 100}
    assert bucket(db, paid) == {"available": 700, "held": 300, "consumed": 0, "expired": 0}
    check(db)
    assert usage(db, h.id, 3, 250, later(150)).status == metering.APPLIED
    assert bucket(db, promo) == {"available": 0, "held": 50, "consumed": 250, "expired": 100}
    check(db)
    # a new hold cannot draw the expired promo
    fresh = reserve(db, tenant, "job-after", 10, now=later(151))
    assert parts(db, fresh.id) == [(paid, 10, 10, 0)]

    _settled, changed = settle(db, h.id, "finished", later(200))
    assert changed
    assert [e for e in entries_of(db, h.id) if e[0] == "release"] == [
        entry for b, target, amount in sorted([(promo, "expired", 50), (paid, "available", 300)])
        for entry in (("release", b, "held", -amount), ("release", b, target, amount))]
    assert bucket(db, promo) == {"available": 0, "held": 0, "consumed": 250, "expired": 150}
    assert bucket(db, paid) == {"available": 990, "held": 10, "consumed": 0, "expired": 0}
    assert hold_numbers(db, h.id) == {
        "amount": 600, "held": 0, "captured": 250, "released": 300, "expired": 50,
        "uncovered": 0, "gpu_ms": 250, "last_seq": 3, "state": "settled"}
    check(db)


def test_spend_order_kinds_expiry_priority_then_the_org_wallet(db: Database,
                                                               tenant: Tenant) -> None:
    project, org = tenant.owner(db), tenant.owner(db, project_wallet=False)
    # created in an order that differs from the spend order
    org_soon = give(db, org, 10, kind=GrantKind.PROMO, expires_at=later(3600), priority=-5)
    paid_new = give(db, project, 10, now=later(2))
    paid_old = give(db, project, 10, now=later(1))
    grant = give(db, project, 10, kind=GrantKind.GRANT)
    promo = give(db, project, 10, kind=GrantKind.PROMO)
    paid_two_days = give(db, project, 10, expires_at=later(2 * 86400))
    promo_one_day = give(db, project, 10, kind=GrantKind.PROMO, expires_at=later(86400))
    paid_one_day = give(db, project, 10, expires_at=later(86400))
    first = give(db, project, 10, priority=-1)
    last = give(db, project, 10, kind=GrantKind.PROMO, expires_at=later(60), priority=1)
    order = [first, promo_one_day, paid_one_day, paid_two_days, promo, grant, paid_old,
             paid_new, last, org_soon]

    h = reserve(db, tenant, "job-order", 95, now=later(5))
    assert [p[0] for p in parts(db, h.id)] == order
    assert [p[1] for p in parts(db, h.id)] == [10] * 9 + [5]
    assert entries_of(db, h.id) == [
        entry for b, amount in zip(order, [10] * 9 + [5], strict=True)
        for entry in (("reserve", b, "available", -amount), ("reserve", b, "held", amount))]
    # captures follow the same order
    usage(db, h.id, 1, 15, later(6))
    assert [p[3] for p in parts(db, h.id)] == [10, 5] + [0] * 8
    # the project's wallet is emptied before the org's is touched again
    assert bucket(db, org_soon)["available"] == 5
    check(db)


def test_insufficient_credits_writes_nothing(db: Database, tenant: Tenant) -> None:
    owner = tenant.owner(db)
    give(db, owner, 100)
    give(db, tenant.owner(db, project_wallet=False), 50)
    before = row_counts(db)
    with pytest.raises(PaymentRequired) as refused:
        reserve(db, tenant, "job-big", 151)
    assert refused.value.extra["reason"] == "insufficient_credits"
    assert (refused.value.extra["requested"], refused.value.extra["available"]) == (151, 150)
    assert row_counts(db) == before
    check(db)
    # and the same work id can be admitted once it fits
    assert reserve(db, tenant, "job-big", 150).held == 150


def test_only_expired_credits_left_is_insufficient(db: Database, tenant: Tenant) -> None:
    promo = give(db, tenant.owner(db), 500, kind=GrantKind.PROMO, expires_at=later(10))
    before = row_counts(db)
    for swept in (False, True):
        with pytest.raises(PaymentRequired) as refused:
            reserve(db, tenant, "job-late", 1, now=later(10))  # the expiry instant
        assert refused.value.extra["reason"] == "insufficient_credits"
        assert refused.value.extra["available"] == 0
        if not swept:
            assert row_counts(db) == before
            assert expire(db, later(11)) == 1
    assert bucket(db, promo) == {"available": 0, "held": 0, "consumed": 0, "expired": 500}
    check(db)


@pytest.mark.parametrize("level", list(Level))
def test_a_hard_budget_refuses_at_its_level(db: Database, tenant: Tenant, level: Level) -> None:
    give(db, tenant.owner(db), 10_000)
    budget(db, tenant, level, 500)
    reserve(db, tenant, "job-1", 400)
    before = row_counts(db)
    with pytest.raises(PaymentRequired) as refused:
        reserve(db, tenant, "job-2", 101)
    extra = refused.value.extra
    assert (extra["reason"], extra["level"], extra["limit"], extra["committed"]) == (
        "budget_exceeded", str(level), 500, 400)
    assert row_counts(db) == before
    reserve(db, tenant, "job-3", 100)  # exactly up to the limit
    with pytest.raises(PaymentRequired):
        reserve(db, tenant, "job-4", 1)
    if level is not Level.USER:  # a hold without a user still counts for org and project
        with pytest.raises(PaymentRequired):
            reserve(db, tenant, "job-5", 1, user=False)
    else:
        reserve(db, tenant, "job-5", 1, user=False)
    check(db)


def test_the_tightest_of_several_levels_decides(db: Database, tenant: Tenant) -> None:
    give(db, tenant.owner(db), 10_000)
    budget(db, tenant, Level.ORG, 1000)
    budget(db, tenant, Level.PROJECT, 800)
    budget(db, tenant, Level.USER, 600)
    reserve(db, tenant, "job-1", 600)
    with pytest.raises(PaymentRequired) as refused:
        reserve(db, tenant, "job-2", 1)
    assert refused.value.extra["level"] == "user"
    reserve(db, tenant, "job-3", 200, user=False)
    with pytest.raises(PaymentRequired) as refused:
        reserve(db, tenant, "job-4", 1, user=False)
    assert refused.value.extra["level"] == "project"
    other = new_tenant(db, org=tenant.org, project="q")
    give(db, other.owner(db), 1000)
    reserve(db, other, "job-5", 200)
    with pytest.raises(PaymentRequired) as refused:
        reserve(db, other, "job-6", 1)
    assert refused.value.extra["level"] == "org"
    check(db)


def test_a_soft_budget_admits_and_alerts_once(db: Database, tenant: Tenant) -> None:
    give(db, tenant.owner(db), 10_000)
    rule = budget(db, tenant, Level.PROJECT, 500, Enforcement.SOFT)
    reserve(db, tenant, "job-1", 500)
    assert audit_rows(db, action="budget_alert") == []
    reserve(db, tenant, "job-2", 200)
    reserve(db, tenant, "job-3", 300)
    alerts = audit_rows(db, action="budget_alert")
    assert alerts == [("budget_alert", {"committed": 500}, {
        "committed": 700, "limit": 500, "level": "project", "period": "day", "work": "job-2"})]
    assert audit_rows(db, rule, "budget_alert") == alerts
    check(db)


def test_a_user_cap_admits_until_reached_then_refuses(db: Database, tenant: Tenant) -> None:
    give(db, tenant.owner(db), 10_000)
    budget(db, tenant, Level.USER, 500, Enforcement.CAP)
    reserve(db, tenant, "job-1", 300)
    reserve(db, tenant, "job-2", 400)  # 300 < 500: admitted, and crosses the cap
    with pytest.raises(PaymentRequired) as refused:
        reserve(db, tenant, "job-3", 1)
    assert (refused.value.extra["reason"], refused.value.extra["level"]) == (
        "spend_cap_reached", "user")
    reserve(db, tenant, "job-4", 1, user=False)  # the cap is the user's only
    check(db)


def test_budgets_are_per_period_and_releases_give_room_back(db: Database,
                                                            tenant: Tenant) -> None:
    give(db, tenant.owner(db), 100_000)
    budget(db, tenant, Level.PROJECT, 500)
    budget(db, tenant, Level.ORG, 1200, period=Period.MONTH)
    first = reserve(db, tenant, "job-1", 500)
    with pytest.raises(PaymentRequired):
        reserve(db, tenant, "job-2", 1)
    tomorrow = T0 + timedelta(days=1)
    reserve(db, tenant, "job-3", 500, now=tomorrow)  # a new day starts from 0
    assert counter(db, f"project:{tenant.project_id}", "day:2026-11-24") == 500
    with pytest.raises(PaymentRequired) as refused:  # but the month still counts
        reserve(db, tenant, "job-4", 201, now=tomorrow + timedelta(days=1))
    assert (refused.value.extra["level"], refused.value.extra["committed"]) == ("org", 1000)
    # settle job-1 having used 100: 400 back, counted in the day it was admitted
    usage(db, first.id, 1, 100, later(60))
    settle(db, first.id, "finished", later(120))
    assert counter(db, f"project:{tenant.project_id}", DAY) == 100
    assert counter(db, f"org:{tenant.org_id}", MONTH) == 600
    reserve(db, tenant, "job-5", 400)
    reserve(db, tenant, "job-6", 200, now=T0 + timedelta(days=40))  # a new month
    check(db)


def test_usage_past_the_hold_extends_it_then_exhausts(db: Database, tenant: Tenant) -> None:
    paid = give(db, tenant.owner(db), 1000)
    h = reserve(db, tenant, "job-ext", 300)
    outcome = usage(db, h.id, 1, 500, later(10))
    assert outcome.status == metering.APPLIED
    assert hold_numbers(db, h.id) | {} == {
        "amount": 500, "held": 0, "captured": 500, "released": 0, "expired": 0,
        "uncovered": 0, "gpu_ms": 500, "last_seq": 1, "state": "active"}
    assert txns(db, h.id) == ["reserve", "extend", "capture"]
    check(db)
    outcome = usage(db, h.id, 2, 1200, later(20))
    assert outcome.status == metering.EXHAUSTED
    assert outcome.hold is not None and outcome.hold["uncovered"] == 200
    assert hold_numbers(db, h.id) == {
        "amount": 1000, "held": 0, "captured": 1000, "released": 0, "expired": 0,
        "uncovered": 200, "gpu_ms": 1200, "last_seq": 2, "state": "active"}
    assert bucket(db, paid) == {"available": 0, "held": 0, "consumed": 1000, "expired": 0}
    check(db)
    # more usage with nothing left: all of it uncovered, nothing captured twice
    assert usage(db, h.id, 3, 1300, later(30)).status == metering.EXHAUSTED
    assert hold_numbers(db, h.id)["uncovered"] == 300
    settled, changed = settle(db, h.id, "failed", later(40))
    assert changed and (settled.captured, settled.released, settled.uncovered) == (1000, 0, 300)
    assert counter(db, f"project:{tenant.project_id}", DAY) == 1000
    check(db)


def test_a_hard_budget_stops_an_extension(db: Database, tenant: Tenant) -> None:
    give(db, tenant.owner(db), 10_000)
    budget(db, tenant, Level.PROJECT, 400)
    h = reserve(db, tenant, "job-ext", 300)
    assert usage(db, h.id, 1, 350, later(10)).status == metering.APPLIED
    assert hold_numbers(db, h.id)["amount"] == 350
    outcome = usage(db, h.id, 2, 500, later(20))
    assert outcome.status == metering.EXHAUSTED
    assert hold_numbers(db, h.id) == {
        "amount": 350, "held": 0, "captured": 350, "released": 0, "expired": 0,
        "uncovered": 150, "gpu_ms": 500, "last_seq": 2, "state": "active"}
    assert counter(db, f"project:{tenant.project_id}", DAY) == 350
    check(db)


def test_reporter_clock_skew_changes_nothing_but_the_counters(db: Database) -> None:
    stamps = [None, T0.replace(year=1970), T0.replace(year=2200)]
    numbers, leases = [], []
    for index, stamp in enumerate(stamps):
        tenant = new_tenant(db)
        give(db, tenant.owner(db), 1000)
        h = reserve(db, tenant, f"job-skew-{index}", 500, lease_s=60)
        for seq, gpu_ms in ((1, 100), (2, 250)):
            assert usage(db, h.id, seq, gpu_ms, later(100 * seq), stamp).status == "applied"
        numbers.append(hold_numbers(db, h.id))
        leases.append(hold(db, h.id).lease_expires_at)
        before = (entries_of(db, h.id), hold_numbers(db, h.id), row_counts(db))
        # retried, then reordered: a seq not above the last changes nothing
        assert usage(db, h.id, 2, 250, later(300), stamp).status == metering.DUPLICATE
        assert usage(db, h.id, 1, 100, later(400), stamp).status == metering.DUPLICATE
        assert usage(db, h.id, 1, 900, later(400), stamp).status == metering.DUPLICATE
        assert (entries_of(db, h.id), hold_numbers(db, h.id), row_counts(db)) == before
        assert hold(db, h.id).lease_expires_at == later(260)  # duplicates do not renew
        # the lease is the DB clock's, so the reaper sees it lapse at now + lease_s
        assert reap(db, later(259)) == []
        assert reap(db, later(260)) == [h.id]
    assert numbers[0] == numbers[1] == numbers[2] == {
        "amount": 500, "held": 250, "captured": 250, "released": 0, "expired": 0,
        "uncovered": 0, "gpu_ms": 250, "last_seq": 2, "state": "active"}
    assert leases == [later(260)] * 3
    check(db)


def test_a_lower_counter_with_a_higher_seq_never_refunds(db: Database, tenant: Tenant) -> None:
    give(db, tenant.owner(db), 1000)
    h = reserve(db, tenant, "job-back", 500)
    usage(db, h.id, 1, 300, later(1))
    assert usage(db, h.id, 2, 100, later(2)).status == metering.APPLIED
    assert (hold_numbers(db, h.id)["captured"], hold_numbers(db, h.id)["gpu_ms"]) == (300, 300)
    check(db)


@pytest.mark.parametrize("table", ["ledger_entries", "credit_audit"])
def test_the_journal_and_the_audit_trail_are_append_only(db: Database, tenant: Tenant,
                                                         table: str) -> None:
    give(db, tenant.owner(db), 1000)
    column = "amount" if table == "ledger_entries" else "actor"
    value = "0" if table == "ledger_entries" else "'someone'"
    with pytest.raises(DBAPIError, match="append-only"), db.transaction() as session:
        session.execute(text(f"UPDATE {table} SET {column} = {value}"))
    with pytest.raises(DBAPIError, match="append-only"), db.transaction() as session:
        session.execute(text(f"DELETE FROM {table}"))
    assert row_counts(db)[table] > 0
    check(db)


def test_verify_catches_a_tampered_bucket(db: Database, tenant: Tenant) -> None:
    paid = give(db, tenant.owner(db), 1000)
    other = give(db, tenant.owner(db), 1000, now=later(1))
    reserve(db, tenant, "job-1", 200)
    check(db)
    with db.transaction() as session:
        session.execute(text("UPDATE credit_buckets SET available = available - 1, "
                             "consumed = consumed + 1 WHERE id = :id"), {"id": paid})
    with db.transaction(write=False) as session:
        report = verify.verify(session)
    assert not report.ok
    assert report.mismatches == [
        f"bucket {paid} available: stored 799, journal 800",
        f"bucket {paid} consumed: stored 1, journal 0",
    ]
    assert not any(other in line for line in report.mismatches)


def test_verify_catches_a_tampered_spend_counter(db: Database, tenant: Tenant) -> None:
    give(db, tenant.owner(db), 1000)
    reserve(db, tenant, "job-1", 200)
    project = f"project:{tenant.project_id}"
    with db.transaction() as session:
        session.execute(text("UPDATE credit_spend SET amount = amount - 1 "
                             "WHERE scope = :s AND period = :p"), {"s": project, "p": DAY})
        session.execute(text("DELETE FROM credit_spend WHERE scope = :s AND period = :p"),
                        {"s": f"org:{tenant.org_id}", "p": MONTH})
    with db.transaction(write=False) as session:
        report = verify.verify(session)
    assert sorted(report.mismatches) == sorted([
        f"spend counter {project} {DAY}: 199, holds say 200",
        f"spend counter org:{tenant.org_id} {MONTH} missing (holds say 200)",
    ])
