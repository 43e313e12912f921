"""Victim choice for preemption, and the proof that preemption cannot loop."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nbfleet.policy.fairness import QueuedWork, Tenant, UsageLedger, order_queue
from nbfleet.policy.preemption import RunningWork, choose_victims, load_by_tenant, may_preempt

FREE, PAID = 0, 10


def pending(
    id: str = "new", tenant: str = "p", *, priority: int = PAID, gpus: int = 1
) -> QueuedWork:
    return QueuedWork(id, tenant, priority, gpus, 0.0, True)


def run(
    id: str,
    tenant: str,
    *,
    priority: int = FREE,
    gpus: int = 1,
    preemptible: bool = True,
    started: float = 0.0,
) -> RunningWork:
    return RunningWork(id, tenant, priority, gpus, preemptible, started)


def tenants(*items: Tenant) -> dict[str, Tenant]:
    return {t.id: t for t in items}


def ids(victims: Sequence[RunningWork] | None) -> list[str] | None:
    return None if victims is None else sorted(v.id for v in victims)


TS = tenants(Tenant("p", 1.0), Tenant("a", 1.0), Tenant("b", 1.0))


# --- hand-made scenarios ------------------------------------------------------


def test_lower_priority_preemptible_work_is_taken() -> None:
    running = [run("a1", "a", gpus=2), run("a2", "a", gpus=2)]
    assert ids(choose_victims(pending(gpus=2), running, TS)) in (["a1"], ["a2"])


def test_equal_priority_is_never_a_victim() -> None:
    running = [run("a1", "a", priority=PAID)]
    assert choose_victims(pending(), running, TS) is None


def test_non_preemptible_work_is_never_a_victim() -> None:
    running = [run("a1", "a", preemptible=False), run("a2", "a")]
    assert ids(choose_victims(pending(), running, TS)) == ["a2"]
    assert choose_victims(pending(gpus=2), running, TS) is None


def test_none_when_not_enough_can_be_freed() -> None:
    running = [run("a1", "a", gpus=3)]
    assert choose_victims(pending(gpus=4), running, TS) is None


def test_nothing_needed_means_no_victims() -> None:
    assert choose_victims(pending(gpus=4), [run("a1", "a")], TS, needed_gpus=0) == ()


def test_needed_gpus_overrides_the_request() -> None:
    running = [run("a1", "a", gpus=1, started=1.0), run("a2", "a", gpus=1, started=2.0)]
    assert ids(choose_victims(pending(gpus=2), running, TS, needed_gpus=1)) == ["a2"]


def test_guarantee_limits_how_much_a_tenant_loses() -> None:
    ts = tenants(Tenant("p", 1.0), Tenant("a", 1.0, guarantee_gpus=4))
    running = [run(f"a{i}", "a", started=float(i)) for i in range(6)]
    assert ids(choose_victims(pending(gpus=2), running, ts)) == ["a4", "a5"]
    assert choose_victims(pending(gpus=3), running, ts) is None


def test_tenant_under_its_guarantee_loses_nothing() -> None:
    ts = tenants(Tenant("p", 1.0), Tenant("a", 1.0, guarantee_gpus=4))
    running = [run("a0", "a"), run("a1", "a")]
    assert choose_victims(pending(), running, ts) is None


def test_a_tenant_may_swap_its_own_work_within_its_guarantee() -> None:
    """Its high-priority item replaces its low one, so it never drops below."""
    ts = tenants(Tenant("p", 1.0, guarantee_gpus=2))
    running = [run("p0", "p", gpus=2)]
    assert ids(choose_victims(pending(gpus=2), running, ts)) == ["p0"]
    assert choose_victims(pending(gpus=1), [run("p0", "p", gpus=2)], ts) is None


def test_victims_come_from_the_tenant_most_over_its_share() -> None:
    ts = tenants(Tenant("p", 1.0), Tenant("a", 1.0), Tenant("b", 1.0, guarantee_gpus=2))
    # a is 3 over its guarantee; b holds 4, i.e. 2 over. Within a tenant the
    # most recently started goes first.
    running = [run(f"a{i}", "a", started=float(i)) for i in range(3)]
    running += [run(f"b{i}", "b", started=float(i)) for i in range(4)]
    assert ids(choose_victims(pending(gpus=1), running, ts)) == ["a2"]
    # Recomputed per pick: after a2 both are 2 over, and b3 started later than a1;
    # then a is further over again.
    assert ids(choose_victims(pending(gpus=3), running, ts)) == ["a1", "a2", "b3"]


def test_weight_shapes_who_is_over_its_share() -> None:
    ts = tenants(Tenant("p", 1.0), Tenant("heavy", 4.0), Tenant("light", 1.0))
    # heavy: 4 GPUs / weight 4 = 1 per weight; light: 2 / 1 = 2, so light pays,
    # even though heavy's item started later.
    running = [run(f"h{i}", "heavy", started=10.0 + i) for i in range(4)]
    running += [run(f"l{i}", "light", started=float(i)) for i in range(2)]
    assert ids(choose_victims(pending(), running, ts)) == ["l1"]


def test_then_lowest_priority_then_most_recently_started() -> None:
    running = [
        run("old-low", "a", priority=0, started=1.0),
        run("new-mid", "a", priority=5, started=9.0),
        run("new-low", "a", priority=0, started=5.0),
    ]
    assert ids(choose_victims(pending(), running, TS)) == ["new-low"]
    assert ids(choose_victims(pending(gpus=2), running, TS)) == ["new-low", "old-low"]


def test_result_is_minimal() -> None:
    """Greedy takes the recent 1-GPU item first, then needs the 4-GPU one; the 1-GPU
    item is then superfluous and is handed back."""
    running = [run("small", "a", gpus=1, started=9.0), run("big", "a", gpus=4, started=1.0)]
    assert ids(choose_victims(pending(gpus=4), running, TS)) == ["big"]


def test_zero_gpu_work_is_never_a_victim() -> None:
    running = [run("cpu", "a", gpus=0, started=9.0), run("gpu", "a", gpus=1)]
    assert ids(choose_victims(pending(), running, TS)) == ["gpu"]


def test_unknown_tenant_is_an_error() -> None:
    with pytest.raises(ValueError, match="ghost"):
        choose_victims(pending(), [run("x", "ghost")], TS)


def test_load_by_tenant_counts_items_and_gpus() -> None:
    loads = load_by_tenant([run("1", "a", gpus=2), run("2", "a", gpus=3), run("3", "b")])
    assert {t: (v.items, v.gpus) for t, v in loads.items()} == {"a": (2, 5), "b": (1, 1)}


def test_preempted_work_cannot_preempt_its_preemptor() -> None:
    """The ping-pong: paid takes free's GPU; free, requeued, cannot take it back."""
    ts = tenants(Tenant("t", 1.0))
    free = run("free", "t", priority=FREE)
    paid_pending = QueuedWork("paid", "t", PAID, 1, 1.0, True)
    assert ids(choose_victims(paid_pending, [free], ts)) == ["free"]
    paid_running = RunningWork("paid", "t", PAID, 1, True, 1.0)
    free_again = QueuedWork("free", "t", FREE, 1, 0.0, True)
    assert choose_victims(free_again, [paid_running], ts) is None


# --- properties -----------------------------------------------------------------

TENANT_IDS = ["a", "b", "c"]
running_items = st.builds(
    RunningWork,
    id=st.uuids().map(str),
    tenant_id=st.sampled_from(TENANT_IDS),
    priority=st.integers(0, 3),
    gpus=st.integers(0, 4),
    preemptible=st.booleans(),
    started_at=st.floats(0.0, 100.0),
)
tenant_sets = st.tuples(
    *[st.tuples(st.floats(0.25, 4.0), st.integers(0, 6)) for _ in TENANT_IDS]
).map(lambda ps: {t: Tenant(t, w, g) for t, (w, g) in zip(TENANT_IDS, ps, strict=True)})


@settings(max_examples=300, deadline=None)
@given(a=running_items, b=running_items)
def test_may_preempt_is_asymmetric(a: RunningWork, b: RunningWork) -> None:
    assert not (may_preempt(a, b) and may_preempt(b, a))
    assert not may_preempt(a, a)


@settings(max_examples=300, deadline=None)
@given(
    running=st.lists(running_items, max_size=12),
    ts=tenant_sets,
    tenant=st.sampled_from(TENANT_IDS),
    priority=st.integers(0, 4),
    gpus=st.integers(0, 8),
    needed=st.one_of(st.none(), st.integers(-1, 10)),
)
def test_victims_obey_every_rule(
    running: list[RunningWork],
    ts: dict[str, Tenant],
    tenant: str,
    priority: int,
    gpus: int,
    needed: int | None,
) -> None:
    want = QueuedWork("pending", tenant, priority, gpus, 0.0, True)
    need = gpus if needed is None else needed
    victims = choose_victims(want, running, ts, needed)

    eligible = [w for w in running if w.gpus > 0 and may_preempt(want, w)]
    before = {t: sum(w.gpus for w in running if w.tenant_id == t) for t in TENANT_IDS}
    floor = {t: min(ts[t].guarantee_gpus, before[t]) for t in TENANT_IDS}
    credit = {t: gpus if t == tenant else 0 for t in TENANT_IDS}
    if victims is None:
        # Greedy can only miss a set when a guarantee cuts into a tenant's items;
        # without any binding guarantee, None means the eligible GPUs fall short.
        if all(ts[w.tenant_id].guarantee_gpus == 0 for w in eligible):
            assert sum(w.gpus for w in eligible) < need
        return
    assert len({v.id for v in victims}) == len(victims)
    assert all(v in running and may_preempt(want, v) for v in victims)
    freed = sum(v.gpus for v in victims)
    assert freed >= need
    for v in victims:  # minimal: each victim is needed
        assert freed - v.gpus < need
    for t in TENANT_IDS:
        after = before[t] - sum(v.gpus for v in victims if v.tenant_id == t) + credit[t]
        assert after >= floor[t]


# --- no preemption loop: a closed system always settles ------------------------

Vector = list[int]


def priority_vector(running: Sequence[RunningWork]) -> Vector:
    return sorted((w.priority for w in running), reverse=True)


def reaches_cycle(edges: set[tuple[str, str]]) -> bool:
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str) -> bool:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1 or (nxt not in state and visit(nxt)):
                return True
        state[node] = 2
        return False

    return any(node not in state and visit(node) for node in list(graph))


Arrival = tuple[str, int, int, bool, int]
arrival = st.tuples(
    st.sampled_from(TENANT_IDS),  # tenant
    st.integers(0, 3),  # priority
    st.integers(1, 4),  # gpus
    st.sampled_from([True, True, True, False]),  # preemptible
    st.sampled_from([0, 0, 0, 1, 2]),  # completions before this arrival (rare: contention)
)
guarantee_sets = st.tuples(
    *[st.tuples(st.floats(0.25, 4.0), st.integers(0, 3)) for _ in TENANT_IDS]
).map(lambda ps: {t: Tenant(t, w, g) for t, (w, g) in zip(TENANT_IDS, ps, strict=True)})


def simulate(
    arrivals: Sequence[Arrival], ts: dict[str, Tenant], capacity: int
) -> tuple[set[tuple[str, str]], list[RunningWork]]:
    """Drive order_queue and choose_victims like a scheduler: after every arrival,
    start work (preempting where allowed) until nothing more can start. Preempted
    work goes back to the queue and competes again. Asserts that every preemption
    raises the sorted priority vector of the running set and that each settling
    finishes; returns the who-preempted-whom edges and what runs at the end."""
    queue: dict[str, QueuedWork] = {}
    running: list[RunningWork] = []
    edges: set[tuple[str, str]] = set()
    ledger = UsageLedger(half_life_s=60.0)
    now = 0.0
    for n, (tenant, priority, gpus, preemptible, completions) in enumerate(arrivals):
        now += 1.0
        for _ in range(min(completions, len(running))):
            done = min(running, key=lambda w: (w.started_at, w.id))
            running.remove(done)
            ledger = ledger.record(done.tenant_id, done.gpus * (now - done.started_at), now)
        queue[f"w{n}"] = QueuedWork(f"w{n}", tenant, priority, gpus, now, preemptible)

        for _step in range(10 * len(arrivals) + 10):  # a loop would exhaust this
            free = capacity - sum(w.gpus for w in running)
            assert free >= 0
            loads = load_by_tenant(running)
            ordered = order_queue(queue.values(), ts, ledger, loads, now, horizon_s=60.0)
            for want in ordered:
                if want.gpus > capacity:
                    continue
                victims = choose_victims(want, running, ts, want.gpus - free)
                if victims is None:
                    continue
                before = priority_vector(running)
                for v in victims:
                    assert (v.id, want.id) not in edges, "victim preempts its preemptor"
                    edges.add((want.id, v.id))
                    running.remove(v)
                    queue[v.id] = QueuedWork(
                        v.id, v.tenant_id, v.priority, v.gpus, now, v.preemptible
                    )
                del queue[want.id]
                running.append(
                    RunningWork(
                        want.id, want.tenant_id, want.priority, want.gpus, want.preemptible, now
                    )
                )
                assert priority_vector(running) > before
                assert sum(w.gpus for w in running) <= capacity
                break
            else:
                break  # nothing could start: settled
        else:
            pytest.fail("scheduling did not settle: a preemption loop")
    return edges, running


def test_a_cascade_of_rising_priorities_preempts_and_settles() -> None:
    ts = tenants(*(Tenant(t, 1.0) for t in TENANT_IDS))
    arrivals: list[Arrival] = [("a", 0, 2, True, 0), ("b", 0, 2, True, 0)]  # fills 4 GPUs
    arrivals += [("c", 1, 2, True, 0), ("a", 2, 2, True, 0), ("b", 3, 4, False, 0)]
    edges, running = simulate(arrivals, ts, capacity=4)
    assert ("w2", "w1") in edges  # priority 1 took b's free-tier work
    assert ("w4", "w3") in edges  # priority 3 took everything below it
    assert ("w4", "w2") in edges
    assert [w.id for w in running] == ["w4"]
    assert not reaches_cycle(edges)


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=3, max_size=25),
    ts=guarantee_sets,
    capacity=st.integers(4, 8),
)
def test_random_arrivals_never_form_a_preemption_loop(
    arrivals: list[Arrival], ts: dict[str, Tenant], capacity: int
) -> None:
    """The who-preempted-whom graph over a random run has no cycle at all."""
    edges, _ = simulate(arrivals, ts, capacity)
    event("preempted" if edges else "no preemption")
    assert not reaches_cycle(edges)
