"""Standby replicas are billed exactly as they existed (issue 28, point 1).

Measured at a0f6044 on 7 days of a real month: a repair's ``Placed`` named all of
the kernel's hosts, the simulator's meter billed each as a new standby (23,595
billed where 7,865 were added), and ``nbfleet``'s revenue came out at $31.8 M
against a $136 k provider cost. The property: on any trace, the standby
replica-hours the meter bills equal the integral, over the run, of the replicas
the policy's model holds minus those executing a task, read off the model itself
after every event.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.policy.scheduling.decisions import Decision
from nbfleet.policy.scheduling.registry import default_config, make_policy
from nbfleet.sim.driver import SimOptions, Simulation
from nbfleet.sim.metrics import Integral
from nbfleet.sim.traces.model import Session, Task, Trace

HOUR = 3600.0


class Audited(Simulation):
    """A simulation that also integrates the standby replicas its model holds."""

    def __init__(self, trace: Trace, *args: object, **kwargs: object) -> None:
        super().__init__(trace, *args, **kwargs)  # type: ignore[arg-type]
        self.held = Integral(trace.start_s)

    def _apply(self, decisions: list[Decision]) -> None:
        super()._apply(decisions)
        replicas = sum(len(k.hosts) for k in self.policy.kernels.values())
        executing = sum(1 for r in self.policy.running.values() if r.path.on_replica)
        self.held.add(self.engine.now, (replicas - executing) - self.held.value)


@st.composite
def traces(draw: st.DrawFn, sessions_from: int = 2, sessions_to: int = 10,
           window_s: float = 2 * HOUR) -> Trace:
    """Sessions of 1-8 GPUs opening within ``window_s``, with think times from
    seconds to hours (past the idle shrink), so that kernels shrink, grow back and
    hosts join meanwhile."""
    sessions = []
    for n in range(draw(st.integers(sessions_from, sessions_to))):
        start = draw(st.floats(0, window_s))
        gpus = draw(st.sampled_from((1, 4, 8, 8)))
        tasks, at = [], start
        for _ in range(draw(st.integers(0, 6))):
            at += draw(st.sampled_from((5.0, 120.0, 900.0, 1.5 * HOUR)))
            duration = draw(st.sampled_from((1.0, 30.0, 600.0, 2 * HOUR)))
            tasks.append(Task(at, duration, draw(st.integers(1, gpus))))
            at += duration
        sessions.append(Session(f"s{n}", start, at + draw(st.floats(1, 3 * HOUR)), gpus,
                                tasks=tuple(tasks)))
    return Trace.of(sessions, "random")


@pytest.mark.parametrize("name", ["nbfleet", "notebookos"])
@settings(max_examples=60, deadline=None)
@given(trace=traces(), initial=st.integers(0, 2), shrink_after=st.sampled_from((300.0, HOUR)))
def test_billed_standby_hours_equal_the_replicas_that_existed(
        name: str, trace: Trace, initial: int, shrink_after: float) -> None:
    config = default_config(name)
    if name == "nbfleet":
        config = dataclasses.replace(config, shrink_idle_s=shrink_after)
    sim = Audited(trace, make_policy(name, config), SimOptions(initial_hosts=initial))
    meters = sim.run()
    billed = meters.standby_replicas.hours(meters.end)
    held = sim.held.hours(meters.end)
    assert billed == pytest.approx(held, rel=1e-9, abs=1e-9), (billed, held)
