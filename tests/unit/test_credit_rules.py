"""The credit ledger's pure rules (``nbfleet.model.credits``): the spec the ledger follows."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbfleet.model.credits import (
    MS_PER_HOUR,
    BucketKey,
    BudgetRule,
    Enforcement,
    GrantKind,
    Level,
    Period,
    draw,
    is_expired,
    judge,
    period_key,
    spend_order_key,
    usage_cost,
)

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def bucket(name: str, priority: int = 0, expires_in: float | None = None,
           kind: GrantKind = GrantKind.PURCHASE, age: float = 0) -> BucketKey:
    expires_at = None if expires_in is None else T0 + timedelta(seconds=expires_in)
    return BucketKey(name, priority, expires_at, kind, T0 - timedelta(seconds=age))


def ordered(*buckets: BucketKey) -> list[str]:
    return [b.id for b in sorted(buckets, key=spend_order_key)]


def test_lower_priority_number_goes_first_whatever_else() -> None:
    assert ordered(
        bucket("late-promo-soon", priority=5, expires_in=10, kind=GrantKind.PROMO, age=100),
        bucket("early-purchase-never", priority=1),
    ) == ["early-purchase-never", "late-promo-soon"]


def test_earliest_expiry_first_and_never_expiring_last() -> None:
    assert ordered(
        bucket("never", kind=GrantKind.PROMO, age=1000),
        bucket("in-a-day", expires_in=86400),
        bucket("in-an-hour", expires_in=3600),
    ) == ["in-an-hour", "in-a-day", "never"]


def test_promo_before_grant_before_purchase_at_the_same_expiry() -> None:
    for expires_in in (3600, None):
        assert ordered(
            bucket("purchase", expires_in=expires_in, kind=GrantKind.PURCHASE, age=30),
            bucket("grant", expires_in=expires_in, kind=GrantKind.GRANT, age=20),
            bucket("promo", expires_in=expires_in, kind=GrantKind.PROMO, age=10),
        ) == ["promo", "grant", "purchase"]


def test_then_the_oldest_then_the_id() -> None:
    assert ordered(bucket("b", age=1), bucket("a", age=0), bucket("c", age=5)) == ["c", "b", "a"]
    assert ordered(bucket("z"), bucket("y"), bucket("x")) == ["x", "y", "z"]


def test_an_expiring_bucket_created_later_still_goes_before_a_never_expiring_one() -> None:
    # never-expiring uses created_at in the expiry slot; the flag must decide first
    assert ordered(bucket("never", age=-10_000), bucket("far", expires_in=10**8)) == [
        "far", "never"]


keys = st.builds(
    BucketKey,
    id=st.text("abcdef", min_size=1, max_size=4),
    priority=st.integers(-3, 3),
    expires_at=st.one_of(st.none(), st.integers(1, 10).map(lambda h: T0 + timedelta(hours=h))),
    kind=st.sampled_from(list(GrantKind)),
    created_at=st.integers(0, 5).map(lambda m: T0 - timedelta(minutes=m)),
)


@given(st.lists(keys, min_size=2, max_size=8, unique_by=lambda k: k.id))
def test_spend_order_is_the_lexicographic_rule(buckets: list[BucketKey]) -> None:
    rank = {GrantKind.PROMO: 0, GrantKind.GRANT: 1, GrantKind.PURCHASE: 2}
    result = sorted(buckets, key=spend_order_key)
    for first, second in itertools.pairwise(result):
        if first.priority != second.priority:
            assert first.priority < second.priority
            continue
        if (first.expires_at is None) != (second.expires_at is None):
            assert second.expires_at is None
            continue
        if first.expires_at != second.expires_at:
            assert first.expires_at is not None and second.expires_at is not None
            assert first.expires_at < second.expires_at
            continue
        if first.kind != second.kind:
            assert rank[first.kind] < rank[second.kind]
            continue
        if first.created_at != second.created_at:
            assert first.created_at < second.created_at
            continue
        assert first.id < second.id
    # a total order: the input order never matters
    assert sorted(reversed(buckets), key=spend_order_key) == result


def test_draw_takes_in_order_and_skips_empty_buckets() -> None:
    assert draw([("a", 300), ("b", 0), ("c", 500), ("d", 1000)], 600) == [
        ("a", 300), ("c", 300)]
    assert draw([("a", 300)], 300) == [("a", 300)]
    assert draw([("a", 300), ("b", 5)], 0) == []


def test_draw_short_takes_what_there_is() -> None:
    assert draw([("a", 3), ("b", 4)], 100) == [("a", 3), ("b", 4)]
    assert draw([], 10) == []


@given(st.lists(st.integers(0, 1000), max_size=6), st.integers(0, 5000))
def test_draw_properties(haves: list[int], amount: int) -> None:
    buckets = [(f"b{i}", have) for i, have in enumerate(haves)]
    taken = draw(buckets, amount)
    assert sum(part for _b, part in taken) == min(amount, sum(haves))
    have = dict(buckets)
    assert all(0 < part <= have[b] for b, part in taken)
    # a prefix: every bucket before the last one drawn is emptied
    names = [b for b, _part in taken]
    for b, part in taken[:-1]:
        assert part == have[b]
    order = [b for b, h in buckets if h > 0]
    assert names == order[:len(names)]


def test_usage_cost_rounds_up() -> None:
    rate = 2 * 1_000_000  # 2 credits per GPU-hour
    assert usage_cost(0, rate) == 0
    assert usage_cost(1, rate) == 1  # a sliver is never free
    assert usage_cost(MS_PER_HOUR, rate) == rate
    assert usage_cost(MS_PER_HOUR + 1, rate) == rate + 1
    assert usage_cost(1800, 1000) == 1  # 0.5 rounds up
    assert usage_cost(3600, 1000) == 1
    assert usage_cost(3601, 1000) == 2
    assert usage_cost(10**9, 0) == 0
    assert usage_cost(600, MS_PER_HOUR) == 600


@given(st.integers(0, 10**12), st.integers(0, 10**12), st.integers(0, 10**10))
def test_usage_cost_is_monotonic_and_never_under_charges(a: int, b: int, rate: int) -> None:
    low, high = sorted((a, b))
    assert usage_cost(low, rate) <= usage_cost(high, rate)
    exact = low * rate
    cost = usage_cost(low, rate)
    assert cost * MS_PER_HOUR >= exact > (cost - 1) * MS_PER_HOUR or exact == cost == 0
    assert isinstance(cost, int)


def test_period_key_is_the_utc_calendar_period() -> None:
    assert period_key(Period.DAY, T0) == "day:2026-11-23"
    assert period_key(Period.MONTH, T0) == "month:2026-11"
    end = datetime(2026, 11, 30, 23, 59, 59, 999999, tzinfo=UTC)
    assert period_key(Period.DAY, end) == "day:2026-11-30"
    assert period_key(Period.DAY, end + timedelta(microseconds=1)) == "day:2026-12-01"
    assert period_key(Period.MONTH, end + timedelta(microseconds=1)) == "month:2026-12"
    assert period_key(Period.MONTH, datetime(2027, 1, 1, tzinfo=UTC)) == "month:2027-01"


def test_is_expired_at_the_instant() -> None:
    assert not is_expired(None, T0)
    assert is_expired(T0, T0)
    assert not is_expired(T0 + timedelta(microseconds=1), T0)


def rule(enforcement: Enforcement, limit: int = 1000) -> BudgetRule:
    return BudgetRule("bud_x", Level.PROJECT, Period.DAY, limit, enforcement)


@pytest.mark.parametrize(("before", "amount", "refused"), [
    (0, 1000, False), (999, 1, False), (1000, 0, False), (0, 1001, True), (999, 2, True),
    (1000, 1, True), (2000, 1, True),
])
def test_hard_refuses_past_the_limit(before: int, amount: int, refused: bool) -> None:
    verdict = judge(rule(Enforcement.HARD), before, amount)
    assert (verdict.refused, verdict.alert) == (refused, False)
    assert verdict.committed_before == before
    assert "budget of 1000" in verdict.reason


@pytest.mark.parametrize(("before", "amount", "refused"), [
    (0, 10**6, False), (999, 500, False), (1000, 1, True), (1500, 1, True),
])
def test_cap_refuses_only_once_reached(before: int, amount: int, refused: bool) -> None:
    verdict = judge(rule(Enforcement.CAP), before, amount)
    assert (verdict.refused, verdict.alert) == (refused, False)
    if refused:
        assert "spend cap reached" in verdict.reason


@pytest.mark.parametrize(("before", "amount", "alert"), [
    (0, 1000, False),  # reaching the limit is not passing it
    (0, 1001, True), (1000, 1, True),  # crossing, or leaving it from exactly the limit
    (999, 2, True), (1001, 5, False),  # already past: alerted before
    (0, 0, False),
])
def test_soft_admits_and_alerts_once_when_crossed(before: int, amount: int, alert: bool) -> None:
    verdict = judge(rule(Enforcement.SOFT), before, amount)
    assert (verdict.refused, verdict.alert) == (False, alert)


def test_zero_limit() -> None:
    assert judge(rule(Enforcement.HARD, 0), 0, 1).refused
    assert not judge(rule(Enforcement.HARD, 0), 0, 0).refused
    assert judge(rule(Enforcement.CAP, 0), 0, 1).refused
    assert judge(rule(Enforcement.SOFT, 0), 0, 1).alert
