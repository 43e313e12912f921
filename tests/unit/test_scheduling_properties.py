"""Invariants every placement policy keeps, over random small traces and event orders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.decisions import (
    Decision,
    KernelRequest,
    Prewarm,
    ScaleIn,
    ScaleOut,
    Started,
    StartPath,
    TaskRequest,
    Unschedulable,
)
from nbfleet.policy.scheduling.registry import POLICIES, default_config, make_policy
from nbfleet.sim.driver import Simulation
from nbfleet.sim.metrics import Meters
from nbfleet.sim.traces.model import Session, Task, Trace

NAMES = list(POLICIES)
GPUS = (0, 1, 2, 4, 8)
TOO_BIG = 16  # no 8-GPU host shape can ever run it
# The default shape (8 GPUs), or a small one (4 GPUs) for contention: more queueing,
# fragmentation and migrations, and 8-GPU sessions that fit nowhere as well.
SHAPES = (8, 4)
EVENTS = ("add_host", "open_session", "close_session", "submit", "finish", "prewarmed", "tick")
PROPERTY = settings(max_examples=40, deadline=None)



# --------------------------------------------------------------------- checks
class FleetChecker:
    """Checks a policy's model after every event, and the decisions it returned."""

    def __init__(self, policy: FleetPolicy) -> None:
        self.policy = policy
        self.seen: dict[str, Host] = {}  # every host that ever joined, released or not
        self.events = 0

    def check(self, decisions: list[Decision]) -> None:
        self.events += 1
        p = self.policy
        for host in p.hosts.values():
            check_host(host, holders=set(p.running) | set(p.kernels))
        for task_id, running in p.running.items():
            where = p.hosts.get(running.host_id)
            assert where is not None, f"{task_id} runs on {running.host_id}, not in the fleet"
            held = where.bound(running.task.kernel_id if running.path is StartPath.RESERVED
                              else task_id)
            assert len(held) >= running.task.gpus
            if running.path is not StartPath.RESERVED:
                assert len(held) == running.task.gpus
        for d in decisions:
            if isinstance(d, Started):
                holder = d.kernel_id if d.path is StartPath.RESERVED else d.task_id
                assert set(d.gpu_indices) <= set(p.hosts[d.host_id].bound(holder)), d
                assert len(d.gpu_indices) == p.running[d.task_id].task.gpus, d
            elif isinstance(d, ScaleIn):
                for host_id in d.host_ids:
                    assert host_id not in p.hosts, d
                    released = self.seen[host_id]
                    assert released.committed_gpus == 0, d
                    assert not released.subscriptions, d
        assert p.provisioning >= 0
        assert all(n >= 0 for n in p.warm.values()) and all(n >= 0 for n in p.warming.values())

    def instrument(self) -> FleetChecker:
        """Wrap the policy's event methods on the instance: check after each call."""
        for name in EVENTS:
            method: Callable[..., list[Decision]] = getattr(self.policy, name)

            def checked(*args: Any, _method: Callable[..., list[Decision]] = method,
                        _name: str = name) -> list[Decision]:
                if _name == "add_host":
                    self.seen[args[0].id] = args[0]
                decisions = _method(*args)
                self.check(decisions)
                return decisions

            setattr(self.policy, name, checked)
        return self


def check_host(host: Host, holders: set[str]) -> None:
    """Commitments within capacity; the GPU -> holder and holder -> GPUs maps agree."""
    assert host.committed_gpus <= len(host.gpus)
    by_holder: dict[str, list[int]] = {}
    for gpu in host.gpus:
        holder = host.holder_of(gpu.index)
        if holder is not None:
            by_holder.setdefault(holder, []).append(gpu.index)
    assert sum(len(v) for v in by_holder.values()) == host.committed_gpus
    for holder, indices in by_holder.items():
        assert host.bound(holder) == tuple(sorted(indices)), (host.id, holder)
        assert holder in holders, f"{holder} holds GPUs on {host.id} but is not running"


def check_idle_at_end(policy: FleetPolicy) -> None:
    assert not policy.running and not policy.queue
    assert not policy.kernels and not policy.waiting_kernels
    for host in policy.hosts.values():
        assert host.committed_gpus == 0, host.id
        assert not host.subscriptions, host.id


# ----------------------------------------------------------------- the traces
@st.composite
def sessions(draw: st.DrawFn, index: int, shape: int, zero_gpus: bool) -> Session:
    """A session with sequential tasks; one in ten asks for more GPUs than a host has."""
    if draw(st.integers(0, 9)) == 0:
        gpus = TOO_BIG
    else:
        gpus = draw(st.sampled_from([g for g in GPUS if (g or zero_gpus) and g <= shape]))
    start = draw(st.integers(0, 1_200))
    clock = start
    tasks: list[Task] = []
    for _ in range(draw(st.integers(0, 5))):
        clock += draw(st.one_of(st.integers(0, 900), st.just(4_000)))  # think time
        duration = draw(st.integers(0, 1_500))
        # Often all of the session's GPUs, so that hosts fill up.
        task_gpus = draw(st.one_of(st.just(gpus), st.sampled_from(
            [g for g in (*GPUS, TOO_BIG) if g <= gpus])))
        tasks.append(Task(clock, duration, task_gpus))
        clock += duration
    return Session(f"s{index}", start, clock + draw(st.integers(0, 900)), gpus,
                   tasks=tuple(tasks))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, int, Trace]:
    """A policy, its host shape's GPU count, and a trace of 1 to 10 sessions."""
    name = draw(st.sampled_from(NAMES))
    shape = draw(st.sampled_from(SHAPES))
    count = draw(st.integers(1, 10))
    trace = Trace.of([draw(sessions(i, shape, True)) for i in range(count)])
    return name, shape, trace


def policy_for(name: str, shape_gpus: int = 8) -> FleetPolicy:
    config = default_config(name)
    if shape_gpus != config.gpus_per_host:
        config = replace(config, host_shape=HostInventory(
            64_000, 488_000, (GpuGroup(shape_gpus, "V100-16GB", 16),)))
    return make_policy(name, config)


def simulate(name: str, trace: Trace,
             shape_gpus: int = 8) -> tuple[Meters, FleetPolicy, FleetChecker]:
    policy = policy_for(name, shape_gpus)
    checker = FleetChecker(policy).instrument()
    meters = Simulation(trace, policy).run()
    if currently_in_test_context():  # what the examples exercised (--hypothesis-show-statistics)
        for record in meters.tasks.values():
            event(f"{name}: {record.path.value if record.path else 'unschedulable'}")
        if meters.migrations:
            event(f"{name}: migrated")
        if meters.shrinks:
            event(f"{name}: shrank")
    return meters, policy, checker


# ---------------------------------------------------------- simulated traces
@PROPERTY
@given(cases())
def test_simulated_traces_keep_the_fleet_consistent_and_finish_every_task(
        case: tuple[str, int, Trace]) -> None:
    name, shape, trace = case
    meters, policy, checker = simulate(name, trace, shape)
    assert checker.events > 0  # the checks ran, after every event
    # (b) every task started or is unschedulable, and only those of sessions too big
    # for the host shape are (all of theirs are).
    for session in trace.sessions:
        for index, task in enumerate(session.tasks):
            record = meters.tasks[f"{session.id}/{index}"]
            if session.gpus > shape:
                assert record.unschedulable is not None and record.start_s is None
                continue
            assert record.unschedulable is None, record
            assert record.start_s is not None and record.end_s is not None, record
            assert record.start_s >= task.submit_s
            assert record.end_s - record.start_s == pytest.approx(task.duration_s)
            assert record.gpus == task.gpus
            assert record.released_s is not None and record.released_s >= record.end_s
            assert record.path in allowed_paths(name)
    assert len(meters.tasks) == trace.task_count
    # (d) nothing is left committed, running, queued or subscribed.
    check_idle_at_end(policy)


def allowed_paths(name: str) -> set[StartPath]:
    return {
        "reservation": {StartPath.RESERVED},
        "batch": {StartPath.COLD},
        "lcp": {StartPath.WARM, StartPath.COLD},
        "notebookos": {StartPath.LOCAL, StartPath.MIGRATE_WARM, StartPath.MIGRATE_COLD},
        "nbfleet": {StartPath.LOCAL, StartPath.MIGRATE_WARM, StartPath.MIGRATE_COLD},
    }[name]


@PROPERTY
@given(cases())
def test_simulation_is_deterministic(case: tuple[str, int, Trace]) -> None:
    name, shape, trace = case
    first, _, _ = simulate(name, trace, shape)
    second, _, _ = simulate(name, trace, shape)
    assert first.tasks == second.tasks
    assert (first.migrations, first.scale_out_hosts, first.scale_in_hosts, first.end) == (
        second.migrations, second.scale_out_hosts, second.scale_in_hosts, second.end)
    assert [s.fleet for s in first.samples] == [s.fleet for s in second.samples]


def test_a_session_no_host_fits_is_unschedulable_in_every_policy() -> None:
    trace = Trace.of([
        Session("big", 0, 600, TOO_BIG, tasks=(Task(10, 60, 16), Task(100, 60, 4))),
        Session("ok", 0, 600, 4, tasks=(Task(10, 60, 4),)),
    ])
    for name in NAMES:
        meters, policy, _ = simulate(name, trace)
        assert meters.tasks["big/0"].unschedulable and meters.tasks["big/1"].unschedulable
        assert meters.tasks["ok/0"].start_s is not None
        check_idle_at_end(policy)


# --------------------------------------------------- random event orders
@dataclass
class World:
    """Drives a policy's events in a random order, as a caller that obeys its
    decisions: hosts asked for join later, Prewarm'd containers come ready later,
    a kernel runs one task at a time, and a session closes only when it is idle."""

    policy: FleetPolicy
    checker: FleetChecker
    now: float = 0.0
    pending_hosts: int = 0
    prewarms: list[Prewarm] = field(default_factory=list)
    kernels: dict[str, int] = field(default_factory=dict)  # open kernel -> GPUs
    busy: dict[str, str] = field(default_factory=dict)  # kernel -> its submitted task
    started: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)  # unschedulable tasks
    submitted: list[str] = field(default_factory=list)
    hosts_made: int = 0
    kernels_made: int = 0

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            event(f"{self.policy.name}: {type(d).__name__}"
                  + (f" {d.path.value}" if isinstance(d, Started) else ""))
            if isinstance(d, Started):
                assert d.task_id not in self.started, f"{d.task_id} started twice"
                self.started.add(d.task_id)
            elif isinstance(d, ScaleOut):
                assert d.count > 0
                self.pending_hosts += d.count
            elif isinstance(d, Prewarm):
                assert d.count > 0
                self.prewarms.append(d)
            elif isinstance(d, Unschedulable) and d.task_id in self.kernels:
                del self.kernels[d.task_id]
            elif isinstance(d, Unschedulable):
                self.lost.add(d.task_id)
                self.busy = {k: t for k, t in self.busy.items() if t != d.task_id}

    def add_host(self) -> None:
        self.hosts_made += 1
        host = Host.from_inventory(f"h{self.hosts_made:03d}", self.policy.config.host_shape)
        self.pending_hosts = max(0, self.pending_hosts - 1)
        self.apply(self.policy.add_host(host, self.now))

    def open(self, gpus: int) -> None:
        self.kernels_made += 1
        kernel_id = f"k{self.kernels_made}"
        self.kernels[kernel_id] = gpus
        self.apply(self.policy.open_session(
            KernelRequest(kernel_id, ResourceSpec(gpus=gpus)), self.now))

    def submit(self, kernel_id: str, gpus: int) -> None:
        task_id = f"{kernel_id}/{len(self.submitted)}"
        self.submitted.append(task_id)
        self.busy[kernel_id] = task_id
        self.apply(self.policy.submit(TaskRequest(task_id, kernel_id, gpus), self.now))

    def finish(self, kernel_id: str) -> None:
        task_id = self.busy.pop(kernel_id)
        self.apply(self.policy.finish(task_id, self.now))

    def close(self, kernel_id: str) -> None:
        del self.kernels[kernel_id]
        self.apply(self.policy.close_session(kernel_id, self.now))

    def prewarmed(self, index: int) -> None:
        d = self.prewarms.pop(index)
        self.apply(self.policy.prewarmed(d.host_id, d.count, self.now))

    def running_kernels(self) -> list[str]:
        return sorted(k for k, t in self.busy.items() if t in self.started)

    def idle_kernels(self) -> list[str]:
        return sorted(k for k in self.kernels if k not in self.busy)

    def drain(self) -> None:
        """Everything the caller owes happens; every task must then start, and the
        fleet must empty once every session has closed."""
        for _ in range(200):
            if not (self.kernels or self.busy or self.pending_hosts or self.prewarms):
                break
            self.now += 60.0
            while self.prewarms:
                self.prewarmed(0)
            while self.pending_hosts:
                self.add_host()
            for kernel_id in self.running_kernels():
                self.finish(kernel_id)
            for kernel_id in self.idle_kernels():
                self.close(kernel_id)
            self.apply(self.policy.tick(self.now))
        else:
            pytest.fail(f"stuck: busy={self.busy} kernels={self.kernels} "
                        f"queue={list(self.policy.queue)} "
                        f"waiting={list(self.policy.waiting_kernels)} "
                        f"hosts={len(self.policy.hosts)} pending={self.pending_hosts}")
        assert set(self.submitted) == self.started | self.lost
        assert not self.started & self.lost
        check_idle_at_end(self.policy)


OPS = ("host", "open", "open", "submit", "submit", "submit", "submit", "finish", "finish",
       "finish", "close", "prewarmed", "prewarmed", "tick", "tick")


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(NAMES), st.sampled_from(SHAPES), st.data())
def test_random_event_orders_keep_the_fleet_consistent(name: str, shape: int,
                                                       data: st.DataObject) -> None:
    policy = policy_for(name, shape)
    world = World(policy, FleetChecker(policy).instrument())
    for _ in range(data.draw(st.integers(0, 4), label="initial hosts")):
        world.add_host()
    kernel_gpus = [*GPUS, TOO_BIG]
    ops = data.draw(st.lists(st.sampled_from(OPS), min_size=10, max_size=80), label="ops")
    for op in ops:
        world.now += data.draw(st.sampled_from((0.0, 1.0, 30.0, 300.0, 700.0, 4_000.0)),
                               label="dt")
        if op == "host" and (world.pending_hosts or len(policy.hosts) < 6):
            world.add_host()
        elif op == "open":
            world.open(data.draw(st.sampled_from(kernel_gpus), label="kernel gpus"))
        elif op == "submit" and world.idle_kernels():
            kernel_id = data.draw(st.sampled_from(world.idle_kernels()), label="kernel")
            limit = world.kernels[kernel_id]
            world.submit(kernel_id, data.draw(st.sampled_from(
                [g for g in GPUS if g <= limit]), label="task gpus"))
        elif op == "finish" and world.running_kernels():
            world.finish(data.draw(st.sampled_from(world.running_kernels()), label="done"))
        elif op == "close" and world.idle_kernels():
            world.close(data.draw(st.sampled_from(world.idle_kernels()), label="close"))
        elif op == "prewarmed" and world.prewarms:
            world.prewarmed(data.draw(st.integers(0, len(world.prewarms) - 1), label="pw"))
        elif op == "tick":
            world.apply(policy.tick(world.now))
    world.drain()
