"""Queue ordering across tenants: strict tiers, weighted fair share, decayed usage."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.policy.fairness import QueuedWork, RunningLoad, Tenant, UsageLedger, order_queue

FREE, PAID = 0, 10
HOUR = 3600.0


def work(
    id: str,
    tenant: str,
    *,
    priority: int = FREE,
    gpus: int = 1,
    at: float = 0.0,
    preemptible: bool = True,
) -> QueuedWork:
    return QueuedWork(id, tenant, priority, gpus, at, preemptible)


def tenants(*items: Tenant) -> dict[str, Tenant]:
    return {t.id: t for t in items}


def ids(ordered: list[QueuedWork]) -> list[str]:
    return [w.id for w in ordered]


EMPTY = UsageLedger(half_life_s=HOUR)


# --- tiers ------------------------------------------------------------------


def test_flood_of_free_work_submitted_first_does_not_delay_paid_work() -> None:
    ts = tenants(Tenant("flood", 1.0), Tenant("payer", 1.0))
    flood = [work(f"f{i:04d}", "flood", at=float(i)) for i in range(1000)]
    paid = [work(f"p{i}", "payer", priority=PAID, at=5000.0 + i) for i in range(10)]
    ordered = order_queue(flood + paid, ts, EMPTY, {}, now=6000.0)
    assert ids(ordered[:10]) == [f"p{i}" for i in range(10)]
    assert len(ordered) == 1010
    assert ids(ordered[10:]) == [f"f{i:04d}" for i in range(1000)]


def test_paid_work_of_the_flooding_tenant_also_jumps_its_own_free_work() -> None:
    ts = tenants(Tenant("flood", 1.0))
    flood = [work(f"f{i}", "flood", at=float(i)) for i in range(50)]
    ordered = order_queue([*flood, work("p", "flood", priority=PAID, at=99.0)], ts, EMPTY, {}, 100)
    assert ordered[0].id == "p"


def test_tiers_beat_usage_and_weight() -> None:
    """A heavy, low-weight paid tenant still goes before an idle, heavy-weight free one."""
    ts = tenants(Tenant("paid", 0.1), Tenant("free", 100.0))
    ledger = EMPTY.record("paid", 1e9, now=0.0)
    q = [work("f", "free", at=0.0), work("p", "paid", priority=PAID, at=10.0)]
    assert ids(order_queue(q, ts, ledger, {"paid": RunningLoad(50, 50)}, now=10.0)) == ["p", "f"]


# --- fair share within a tier ----------------------------------------------


def test_two_equal_weight_tenants_alternate() -> None:
    ts = tenants(Tenant("a", 1.0), Tenant("b", 1.0))
    q = [work(f"a{i}", "a", at=float(i)) for i in range(5)]
    q += [work(f"b{i}", "b", at=100.0 + i) for i in range(5)]
    ordered = order_queue(q, ts, EMPTY, {}, now=200.0)
    assert ids(ordered) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]


def test_flood_interleaves_with_a_later_single_tenant() -> None:
    ts = tenants(Tenant("flood", 1.0), Tenant("late", 1.0))
    q = [work(f"f{i}", "flood", at=float(i)) for i in range(100)]
    q.append(work("late", "late", at=500.0))
    ordered = order_queue(q, ts, EMPTY, {}, now=600.0)
    assert ids(ordered).index("late") == 1


def test_fifo_within_a_tenant_by_submit_time_then_id() -> None:
    ts = tenants(Tenant("a", 1.0))
    q = [work("c", "a", at=2.0), work("b", "a", at=1.0), work("a", "a", at=2.0)]
    assert ids(order_queue(q, ts, EMPTY, {}, now=3.0)) == ["b", "a", "c"]


def test_recent_usage_goes_last_and_is_forgiven_after_many_half_lives() -> None:
    ts = tenants(Tenant("heavy", 1.0), Tenant("light", 1.0))
    ledger = EMPTY.record("heavy", 10 * HOUR, now=0.0)  # ten GPU-hours
    q = [work("h", "heavy", at=0.0), work("l", "light", at=1.0)]
    light_runs_one = {"light": RunningLoad(items=1, gpus=1)}  # counts as one GPU-hour
    assert ids(order_queue(q, ts, ledger, light_runs_one, now=1.0)) == ["l", "h"]
    # 30 half-lives later heavy's ten GPU-hours have decayed to ~1e-5 GPU-seconds.
    assert ids(order_queue(q, ts, ledger, light_runs_one, now=30 * HOUR)) == ["h", "l"]


def test_running_gpus_count_against_a_tenant() -> None:
    ts = tenants(Tenant("busy", 1.0), Tenant("idle", 1.0))
    q = [work("b", "busy", at=0.0), work("i", "idle", at=1.0)]
    ordered = order_queue(q, ts, EMPTY, {"busy": RunningLoad(items=1, gpus=4)}, now=2.0)
    assert ids(ordered) == ["i", "b"]


def test_weight_scales_the_share_a_tenant_may_hold() -> None:
    """Weight 4 holding 3 GPUs is below its share; weight 1 holding 1 is not."""
    ts = tenants(Tenant("big", 4.0), Tenant("small", 1.0))
    loads = {"big": RunningLoad(3, 3), "small": RunningLoad(1, 1)}
    q = [work("s", "small", at=0.0), work("b", "big", at=1.0)]
    assert ids(order_queue(q, ts, EMPTY, loads, now=2.0)) == ["b", "s"]


def test_large_items_cost_more_share_than_small_ones() -> None:
    ts = tenants(Tenant("big", 1.0), Tenant("small", 1.0))
    q = [work("B0", "big", gpus=8, at=0.0), work("B1", "big", gpus=8, at=1.0)]
    q += [work(f"s{i}", "small", gpus=1, at=2.0 + i) for i in range(8)]
    ordered = ids(order_queue(q, ts, EMPTY, {}, now=20.0))
    # After big's 8-GPU pick, small gets eight 1-GPU picks before big's next one.
    assert ordered[0] == "B0"
    assert ordered.index("B1") > ordered.index("s6")


# --- concurrency caps -------------------------------------------------------


def test_tenant_at_its_cap_is_skipped() -> None:
    ts = tenants(Tenant("capped", 1.0, max_running=2), Tenant("other", 1.0))
    q = [work(f"c{i}", "capped", at=float(i)) for i in range(5)] + [work("o", "other", at=9.0)]
    ordered = order_queue(q, ts, EMPTY, {"capped": RunningLoad(items=1, gpus=1)}, now=10.0)
    assert Counter(w.tenant_id for w in ordered) == {"capped": 1, "other": 1}
    assert ids(ordered) == ["o", "c0"]


def test_cap_counts_picks_across_tiers() -> None:
    ts = tenants(Tenant("t", 1.0, max_running=2))
    q = [work("free", "t", at=0.0)] + [
        work(f"p{i}", "t", priority=PAID, at=1.0 + i) for i in range(2)
    ]
    assert ids(order_queue(q, ts, EMPTY, {}, now=5.0)) == ["p0", "p1"]


def test_zero_cap_admits_nothing() -> None:
    ts = tenants(Tenant("t", 1.0, max_running=0))
    assert order_queue([work("x", "t")], ts, EMPTY, {}, now=0.0) == []


def test_unknown_tenant_is_an_error() -> None:
    with pytest.raises(ValueError, match="ghost"):
        order_queue([work("x", "ghost")], {}, EMPTY, {}, now=0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"weight": 0.0},
        {"weight": -1.0},
        {"weight": math.inf},
        {"weight": 1.0, "guarantee_gpus": -1},
    ],
)
def test_tenant_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Tenant("t", **kwargs)  # type: ignore[arg-type]


# --- decayed usage ----------------------------------------------------------


def test_usage_halves_after_one_half_life() -> None:
    ledger = UsageLedger(half_life_s=600.0).record("t", 1000.0, now=100.0)
    assert ledger.usage("t", 100.0) == pytest.approx(1000.0)
    assert ledger.usage("t", 700.0) == pytest.approx(500.0)
    assert ledger.usage("t", 1300.0) == pytest.approx(250.0)
    assert ledger.usage("nobody", 1300.0) == 0.0


def test_record_adds_to_the_decayed_value_and_leaves_the_old_ledger_alone() -> None:
    first = UsageLedger(half_life_s=10.0).record("t", 80.0, now=0.0)
    second = first.record("t", 20.0, now=10.0)
    assert second.usage("t", 10.0) == pytest.approx(60.0)
    assert second.usage("t", 20.0) == pytest.approx(30.0)
    assert first.usage("t", 10.0) == pytest.approx(40.0)
    assert second.tenants() == frozenset({"t"})


def test_time_running_backwards_never_grows_usage() -> None:
    ledger = UsageLedger(half_life_s=10.0).record("t", 100.0, now=50.0)
    assert ledger.usage("t", 0.0) == pytest.approx(100.0)
    late = ledger.record("t", 10.0, now=40.0)  # skewed caller: charged at the latest time
    assert late.usage("t", 50.0) == pytest.approx(110.0)
    assert late.usage("t", 60.0) == pytest.approx(55.0)


def test_ledger_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        UsageLedger(half_life_s=0.0)
    with pytest.raises(ValueError):
        EMPTY.record("t", -1.0, now=0.0)


@settings(max_examples=200, deadline=None)
@given(
    half_life=st.floats(1.0, 1e6),
    amount=st.floats(0.0, 1e9),
    start=st.floats(-1e6, 1e6),
    k=st.integers(0, 6),
)
def test_usage_after_k_half_lives_is_amount_over_two_to_the_k(
    half_life: float, amount: float, start: float, k: int
) -> None:
    ledger = UsageLedger(half_life).record("t", amount, now=start)
    later = start + k * half_life
    assert ledger.usage("t", later) == pytest.approx(amount / 2**k, rel=1e-9, abs=1e-9)


# --- properties ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    weight_a=st.floats(0.25, 8.0),
    weight_b=st.floats(0.25, 8.0),
    sizes_a=st.lists(st.integers(1, 4), min_size=150, max_size=150),
    sizes_b=st.lists(st.integers(1, 4), min_size=150, max_size=150),
    prefix=st.integers(10, 150),
)
def test_weighted_share_of_gpus_tracks_weights(
    weight_a: float, weight_b: float, sizes_a: list[int], sizes_b: list[int], prefix: int
) -> None:
    """In any prefix of the order where both tenants still have work queued,
    GPUs picked per unit of weight differ by at most one item per unit of weight."""
    ts = tenants(Tenant("a", weight_a), Tenant("b", weight_b))
    q = [work(f"a{i:03d}", "a", gpus=g, at=float(i)) for i, g in enumerate(sizes_a)]
    q += [work(f"b{i:03d}", "b", gpus=g, at=float(i)) for i, g in enumerate(sizes_b)]
    ordered = order_queue(q, ts, EMPTY, {}, now=1000.0)
    picked = ordered[:prefix]
    got = {t: sum(w.gpus for w in picked if w.tenant_id == t) for t in "ab"}
    counts = Counter(w.tenant_id for w in picked)
    if counts["a"] == len(sizes_a) or counts["b"] == len(sizes_b):
        return  # one tenant ran dry: the other legitimately takes everything
    slack = 4 / min(weight_a, weight_b) + 1e-9
    assert abs(got["a"] / weight_a - got["b"] / weight_b) <= slack


def test_weight_two_gets_about_twice_the_picks_over_a_long_run() -> None:
    ts = tenants(Tenant("double", 2.0), Tenant("single", 1.0))
    q = [work(f"d{i:04d}", "double", at=float(i)) for i in range(1000)]
    q += [work(f"s{i:04d}", "single", at=float(i)) for i in range(1000)]
    first = order_queue(q, ts, EMPTY, {}, now=0.0)[:900]
    counts = Counter(w.tenant_id for w in first)
    assert 598 <= counts["double"] <= 602
    assert 298 <= counts["single"] <= 302


items = st.builds(
    QueuedWork,
    id=st.text("abcdefgh", min_size=1, max_size=4),
    tenant_id=st.sampled_from(["t1", "t2", "t3"]),
    priority=st.sampled_from([FREE, 5, PAID]),
    gpus=st.integers(0, 8),
    submitted_at=st.floats(0.0, 100.0),
    preemptible=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(
    queue=st.lists(items, max_size=40, unique_by=lambda w: w.id),
    caps=st.tuples(*[st.one_of(st.none(), st.integers(0, 5))] * 3),
    weights=st.tuples(*[st.floats(0.1, 10.0)] * 3),
    usage=st.tuples(*[st.floats(0.0, 1e5)] * 3),
    running=st.tuples(*[st.integers(0, 4)] * 3),
    data=st.data(),
)
def test_order_is_a_deterministic_tiered_subset_respecting_caps_and_fifo(
    queue: list[QueuedWork],
    caps: tuple[int | None, ...],
    weights: tuple[float, ...],
    usage: tuple[float, ...],
    running: tuple[int, ...],
    data: st.DataObject,
) -> None:
    names = ["t1", "t2", "t3"]
    ts = {n: Tenant(n, w, max_running=c) for n, w, c in zip(names, weights, caps, strict=True)}
    ledger = EMPTY
    for n, u in zip(names, usage, strict=True):
        ledger = ledger.record(n, u, now=0.0)
    loads = {n: RunningLoad(r, 2 * r) for n, r in zip(names, running, strict=True)}

    ordered = order_queue(queue, ts, ledger, loads, now=50.0)
    shuffled = data.draw(st.permutations(queue))
    assert order_queue(shuffled, ts, ledger, loads, now=50.0) == ordered

    assert len({w.id for w in ordered}) == len(ordered)
    assert {w.id for w in ordered} <= {w.id for w in queue}
    priorities = [w.priority for w in ordered]
    assert priorities == sorted(priorities, reverse=True)
    for n in names:
        mine = [w for w in ordered if w.tenant_id == n]
        cap = ts[n].max_running
        queued = sum(w.tenant_id == n for w in queue)
        allowed = queued if cap is None else max(0, min(queued, cap - loads[n].items))
        assert len(mine) == allowed
        for tier in {w.priority for w in mine}:
            in_tier = [w for w in mine if w.priority == tier]
            assert in_tier == sorted(in_tier, key=lambda w: (w.submitted_at, w.id))
