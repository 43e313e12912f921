"""The discrete-event engine, the manual clock and the latency parameters."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbfleet.model.clock import ManualClock
from nbfleet.sim.engine import Engine
from nbfleet.sim.latency import Latencies


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    engine = Engine()
    seen: list[tuple[float, str]] = []
    for label, at in (("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("b3", 2.0)):
        engine.at(at, lambda label=label: seen.append((engine.now, label)))
    assert engine.run() == 5
    assert seen == [(1.0, "a"), (2.0, "b1"), (2.0, "b2"), (2.0, "b3"), (3.0, "c")]


def test_events_can_schedule_events_and_be_cancelled() -> None:
    engine = Engine()
    log: list[str] = []

    def tick() -> None:
        log.append(f"tick@{engine.now:g}")
        if engine.now < 3:
            engine.after(1.0, tick)

    engine.at(0.0, tick)
    doomed = engine.after(2.5, lambda: log.append("doomed"))
    engine.after(1.5, doomed.cancel)
    engine.run()
    assert log == ["tick@0", "tick@1", "tick@2", "tick@3"]
    assert engine.pending == 0


def test_run_until_stops_and_advances_the_clock() -> None:
    engine = Engine()
    fired: list[float] = []
    for at in (1.0, 5.0, 9.0):
        engine.at(at, lambda: fired.append(engine.now))
    assert engine.run(until=6.0) == 2
    assert engine.now == 6.0 and fired == [1.0, 5.0] and engine.pending == 1
    with pytest.raises(ValueError, match="past"):
        engine.at(2.0, lambda: None)
    with pytest.raises(ValueError, match="negative"):
        engine.after(-1.0, lambda: None)


def test_the_clock_never_goes_back() -> None:
    clock = ManualClock(10.0)
    clock.advance_to(10.0)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(9.0)


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_same_seed_same_run(seed: int) -> None:
    def simulate() -> list[tuple[float, int]]:
        rng = random.Random(seed)
        engine = Engine()
        trail: list[tuple[float, int]] = []
        for i in range(30):
            engine.at(rng.uniform(0, 100), lambda i=i: trail.append((engine.now, i)))
        engine.run()
        return trail

    first = simulate()
    assert first == simulate()
    assert [t for t, _ in first] == sorted(t for t, _ in first)


def test_latencies_compose_migration_and_refuse_negatives() -> None:
    latencies = Latencies()
    assert latencies.migration_s(warm=True) < latencies.migration_s(warm=False)
    assert latencies.migration_s(warm=False) - latencies.migration_s(warm=True) == pytest.approx(
        latencies.cold_start_s - latencies.warm_start_s
    )
    with pytest.raises(ValueError, match="cold_start_s"):
        Latencies(cold_start_s=-1)
