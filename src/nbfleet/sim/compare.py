"""Run several policies over one trace: the unit of every comparison we publish."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from nbfleet.model.resources import HostInventory
from nbfleet.policy.scheduling.registry import POLICIES, make_policy
from nbfleet.sim.driver import SimOptions, Simulation
from nbfleet.sim.metrics import Meters
from nbfleet.sim.summary import Billing, Summary, summarize
from nbfleet.sim.traces.model import Trace


@dataclass(frozen=True, slots=True)
class PolicyRun:
    meters: Meters
    summary: Summary
    billing_kind: str
    wall_s: float

    @property
    def events_per_s(self) -> float:
        return self.meters.events / self.wall_s if self.wall_s > 0 else float("inf")


def resolve_policies(spec: str) -> list[str]:
    """``all`` or a comma-separated list of known names, in the order given."""
    if spec.strip() == "all":
        return list(POLICIES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(map(repr, unknown)) or repr(spec)}; "
                         f"known: all, {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def run_policies(trace: Trace, names: Sequence[str], *, options: SimOptions | None = None,
                 billing: Billing | None = None, max_hosts: int | None = None,
                 host_shape: HostInventory | None = None,
                 immediate_s: float = 1.0,
                 progress: Callable[[str, float], None] | None = None) -> dict[str, PolicyRun]:
    """Each policy on a fresh copy of the fleet; ``progress(name, sim_time)`` as it goes."""
    runs: dict[str, PolicyRun] = {}
    for name in names:
        policy = make_policy(name, max_hosts=max_hosts, host_shape=host_shape)
        started = time.perf_counter()
        simulation = Simulation(trace, policy, options)
        meters = simulation.run(None if progress is None else partial(progress, name))
        wall = time.perf_counter() - started
        runs[name] = PolicyRun(meters, summarize(meters, policy.billing, billing, immediate_s),
                               policy.billing, wall)
        if progress is not None:
            progress(name, meters.end)
    return runs
