"""The simulator's side of the sim-versus-live equivalence test.

The simulator replays a trace through a policy and records, in order, every call
it makes into the policy (the *events*: a host joined, a session opened, a cell
submitted or finished, warm containers ready, a session closed) with the
decisions each call answered. The live side then performs the same events, in
the same order, on the real platform (``tests/e2e/test_sim_live.py``)
and compares its scheduler's decision log with these.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.resources import HostInventory
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.decisions import (
    Decision,
    KernelRequest,
    TaskRequest,
    decision_record,
)
from nbfleet.sim.driver import SimOptions, Simulation
from nbfleet.sim.latency import Latencies
from nbfleet.sim.traces.model import Session, Task, Trace

GPU_TYPE = "A100-80GB"


@dataclass(frozen=True)
class Step:
    """One call into the policy: ``event`` names it, ``decisions`` are its answer;
    ``warm`` is each host's warm containers after it (what a live host should show)."""

    event: tuple[str, ...]
    decisions: list[dict[str, Any]]
    warm: dict[str, int] = field(default_factory=dict)
    #: Each host's kernels and committed GPUs after it (shown when a step differs).
    hosts: dict[str, tuple[list[str], int]] = field(default_factory=dict)


def small_trace(sessions: int = 20, cells: int = 5, seed: int = 14) -> Trace:
    """``sessions`` staggered notebooks of ``cells`` one-GPU cells each, busy enough
    that cells contend for the fleet's GPUs (they wait, kernels move, a host is
    added) but never so many at once that a kernel waits for a host."""
    rng = random.Random(seed)
    out = []
    for index in range(sessions):
        start = 5.0 + index * 7.0
        at, tasks = start + rng.uniform(0.5, 2.0), []
        for _ in range(cells):
            duration = rng.uniform(2.0, 9.0)
            tasks.append(Task(round(at, 3), round(duration, 3), 1))
            at += duration + rng.uniform(0.3, 3.0)
        out.append(Session(f"s{index:02d}", start, round(at + 1.0, 3), 1,
                           gpu_types=(GPU_TYPE,), tasks=tuple(tasks)))
    return Trace(tuple(out))


class _Recorder:
    """The policy, with every call the simulator makes into it recorded."""

    def __init__(self, policy: FleetPolicy, steps: list[Step]) -> None:
        self._policy, self._steps = policy, steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def _record(self, event: tuple[str, ...], decisions: list[Decision]) -> list[Decision]:
        hosts = {h.id: (sorted(h.subscriptions), h.committed_gpus)
                 for h in self._policy.hosts.values()}
        self._steps.append(Step(event, [decision_record(d) for d in decisions],
                                dict(self._policy.warm), hosts))
        return decisions

    def add_host(self, host: Host, now: float) -> list[Decision]:
        return self._record(("host", host.id), self._policy.add_host(host, now))

    def open_session(self, request: KernelRequest, now: float) -> list[Decision]:
        return self._record(("open", request.id), self._policy.open_session(request, now))

    def close_session(self, kernel_id: str, now: float) -> list[Decision]:
        return self._record(("close", kernel_id), self._policy.close_session(kernel_id, now))

    def submit(self, task: TaskRequest, now: float) -> list[Decision]:
        return self._record(("submit", task.id), self._policy.submit(task, now))

    def finish(self, task_id: str, now: float) -> list[Decision]:
        return self._record(("finish", task_id), self._policy.finish(task_id, now))

    def prewarmed(self, host_id: str, count: int, now: float) -> list[Decision]:
        return self._record(("prewarmed", host_id), self._policy.prewarmed(host_id, count, now))

    def tick(self, now: float) -> list[Decision]:
        return self._record(("tick",), self._policy.tick(now))


class _FleetSimulation(Simulation):
    """Its first hosts are the live agents (their names and inventories)."""

    def __init__(self, trace: Trace, policy: Any, hosts: list[tuple[str, HostInventory]],
                 options: SimOptions) -> None:
        super().__init__(trace, policy, options)
        self._initial = list(hosts)

    def _new_host(self) -> None:
        if self._initial:
            name, inventory = self._initial.pop(0)
            self._host_seq += 1
            self._apply(self.policy.add_host(Host.from_inventory(name, inventory),
                                             self.engine.now))
            return
        super()._new_host()


#: A host or a warm container the simulator asks for is ready at once, so its call
#: into the policy directly follows the decision that asked for it: the live side
#: waits for the real one there, and nothing else can happen in between. The
#: latencies only move the simulator's times, never the order of its calls.
LATENCIES = Latencies(state_sync_s=0.0, large_read_s=0.0, large_write_s=0.0, election_s=0.0,
                      cold_start_s=1e-6, warm_start_s=1e-6, host_provision_s=1e-6)


def simulate(trace: Trace, policy: FleetPolicy,
             hosts: list[tuple[str, HostInventory]]) -> list[Step]:
    steps: list[Step] = []
    options = SimOptions(latencies=LATENCIES, initial_hosts=len(hosts))
    _FleetSimulation(trace, _Recorder(policy, steps), hosts, options).run()
    return steps


def session_spec() -> ResourceSpec:
    return ResourceSpec(gpus=1, gpu_types=(GPU_TYPE,))
