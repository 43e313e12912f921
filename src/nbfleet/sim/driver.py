"""Replay a trace through a placement policy on simulated time.

The driver owns everything the policy does not: when sessions open and close,
when tasks arrive, how long each decision takes to carry out (``Latencies``),
when provisioned hosts and warm containers become ready, and the billing
meters. The policy sees only its events and answers with decisions, exactly as
the live scheduler will call it.

Jupyter runs a kernel's cells one at a time, so a session's task becomes
*eligible* when it was submitted and the session's previous task has finished;
the interactivity delay is measured from then to the moment it starts running
(the paper's definition: execute_request to execution start).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.decisions import (
    Decision,
    KernelRequest,
    Migrated,
    Placed,
    Prewarm,
    Reclaimed,
    ScaleIn,
    ScaleOut,
    Started,
    StartPath,
    TaskRequest,
    Unschedulable,
)
from nbfleet.sim.engine import Engine
from nbfleet.sim.latency import Latencies
from nbfleet.sim.metrics import Meters
from nbfleet.sim.traces.model import Session, Trace


@dataclass(frozen=True, slots=True)
class SimOptions:
    latencies: Latencies = field(default_factory=Latencies)
    sample_interval_s: float = 60.0
    initial_hosts: int = 0

    def __post_init__(self) -> None:
        if not (self.sample_interval_s > 0 and math.isfinite(self.sample_interval_s)):
            raise ValueError("sample_interval_s must be positive")
        if self.initial_hosts < 0:
            raise ValueError("initial_hosts must be >= 0")


@dataclass(slots=True)
class _SessionRun:
    session: Session
    next_task: int = 0
    busy: bool = False
    ended: bool = False
    closed: bool = False


class Simulation:
    """One policy over one trace; ``run()`` returns its meters."""

    def __init__(self, trace: Trace, policy: FleetPolicy,
                 options: SimOptions | None = None) -> None:
        self.trace = trace
        self.policy = policy
        self.options = options or SimOptions()
        self.latency = self.options.latencies
        self.engine = Engine(start=trace.start_s)
        self.meters = Meters(policy.name, policy.config.gpus_per_host, start=trace.start_s)
        self._runs = {s.id: _SessionRun(s) for s in trace.sessions}
        self._task_session: dict[str, tuple[_SessionRun, int]] = {}
        self._kernel_ready: dict[str, float] = {}
        self._host_seq = 0
        self._open = 0

    # ------------------------------------------------------------------ run
    def run(self, progress: Callable[[float], None] | None = None) -> Meters:
        if self.options.initial_hosts:
            self.meters.hosts_billed(self.engine.now, self.options.initial_hosts)
        for _ in range(self.options.initial_hosts):
            self._new_host()
        for run in self._runs.values():
            self.engine.at(run.session.start_s, partial(self._open_session, run))
            self.engine.at(run.session.end_s, partial(self._end_session, run))
        self._open = len(self._runs)
        self.engine.at(self.engine.now, self._tick)
        self.engine.at(self.engine.now, self._sample)
        self.engine.run(progress=progress)
        self.meters.finish(self.engine.now, self.engine.processed)
        return self.meters

    def _done(self) -> bool:
        return self._open == 0 and not self.policy.running

    def _tick(self) -> None:
        self._apply(self.policy.tick(self.engine.now))
        if not self._done():
            self.engine.after(self.policy.config.autoscaler.interval_s, self._tick)

    def _sample(self) -> None:
        self.meters.sample(self.engine.now, self.policy.snapshot(), self._open)
        if not self._done():
            self.engine.after(self.options.sample_interval_s, self._sample)

    # ------------------------------------------------------------ sessions
    def _open_session(self, run: _SessionRun) -> None:
        session = run.session
        spec = ResourceSpec(gpus=session.gpus, vram_gb=math.ceil(session.vram_gb),
                            gpu_types=session.gpu_types)
        self._apply(self.policy.open_session(KernelRequest(session.id, spec), self.engine.now))
        self._offer_next(run)

    def _end_session(self, run: _SessionRun) -> None:
        run.ended = True
        self._maybe_close(run)

    def _maybe_close(self, run: _SessionRun) -> None:
        """Close once the session has ended and its last task is done."""
        if run.closed or not run.ended or run.busy or run.next_task < len(run.session.tasks):
            return
        run.closed = True
        self._open -= 1
        self.meters.kernel_closed(run.session.id, self.engine.now)
        self._apply(self.policy.close_session(run.session.id, self.engine.now))

    def _offer_next(self, run: _SessionRun) -> None:
        """Submit the session's next task when it is due and the previous one is done."""
        if run.busy or run.next_task >= len(run.session.tasks):
            self._maybe_close(run)
            return
        task = run.session.tasks[run.next_task]
        run.busy = True
        due = max(task.submit_s, self.engine.now)
        self.engine.at(due, partial(self._submit, run))

    def _submit(self, run: _SessionRun) -> None:
        index = run.next_task
        task = run.session.tasks[index]
        task_id = f"{run.session.id}/{index}"
        self._task_session[task_id] = (run, index)
        self.meters.task_submitted(task_id, task.submit_s, self.engine.now, task.gpus)
        self._apply(self.policy.submit(TaskRequest(task_id, run.session.id, task.gpus),
                                       self.engine.now))

    # ----------------------------------------------------------- decisions
    def _apply(self, decisions: list[Decision]) -> None:
        now = self.engine.now
        for decision in decisions:
            if isinstance(decision, Started):
                self._started(decision)
            elif isinstance(decision, Placed):
                # Later Placed decisions add replicas beside a running one: no wait.
                start = self.latency.cold_start_s if decision.host_ids else 0.0
                self._kernel_ready.setdefault(decision.kernel_id, now + start)
                self.meters.replicas_added(decision.kernel_id, now, len(decision.host_ids),
                                           self.policy.kernels[decision.kernel_id].spec.gpus)
            elif isinstance(decision, Unschedulable):
                self._unschedulable(decision)
            elif isinstance(decision, ScaleOut):
                self.meters.scaled_out(now, decision.count)
                for _ in range(decision.count):
                    self.engine.after(self.latency.host_provision_s, self._new_host)
            elif isinstance(decision, ScaleIn):
                self.meters.scaled_in(now, len(decision.host_ids))
            elif isinstance(decision, Prewarm):
                self.engine.after(self.latency.cold_start_s,
                                  partial(self._prewarmed, decision.host_id, decision.count))
            elif isinstance(decision, Migrated):
                self.meters.migrated(now, decision.for_task)
            elif isinstance(decision, Reclaimed):
                self.meters.replicas_removed(decision.kernel_id, now, len(decision.host_ids))

    def _prewarmed(self, host_id: str, count: int) -> None:
        self._apply(self.policy.prewarmed(host_id, count, self.engine.now))

    def _new_host(self) -> None:
        """A host is ready (billing started when it was asked for)."""
        self._host_seq += 1
        host = Host.from_inventory(f"host-{self._host_seq:05d}", self.policy.config.host_shape)
        self._apply(self.policy.add_host(host, self.engine.now))

    def _started(self, started: Started) -> None:
        now = self.engine.now
        before, after = self._path_costs(started.path)
        ready = self._kernel_ready.get(started.kernel_id, now)
        in_kernel = started.path in (StartPath.RESERVED, StartPath.LOCAL)
        begins = max(now + before, ready if in_kernel else now)
        run, index = self._task_session[started.task_id]
        task = run.session.tasks[index]
        ends = begins + task.duration_s
        self.meters.task_started(started.task_id, now, begins, ends, len(started.gpu_indices),
                                 started.path, uses_replica=started.path.on_replica)
        self.engine.at(ends + after, partial(self._finished, started.task_id, run))

    def _path_costs(self, path: StartPath) -> tuple[float, float]:
        """Seconds before the task runs, and after it (state written back, GPUs held)."""
        lat = self.latency
        if path is StartPath.RESERVED:
            return 0.0, 0.0
        if path is StartPath.LOCAL:
            return lat.election_s, 0.0
        if path is StartPath.WARM:
            return lat.warm_start_s + lat.large_read_s, lat.large_write_s
        if path is StartPath.COLD:
            return lat.cold_start_s + lat.large_read_s, lat.large_write_s
        return lat.migration_s(warm=path is StartPath.MIGRATE_WARM), 0.0

    def _finished(self, task_id: str, run: _SessionRun) -> None:
        self.meters.task_finished(task_id, run.session.id, self.engine.now)
        self._apply(self.policy.finish(task_id, self.engine.now))
        self._advance(run)

    def _unschedulable(self, decision: Unschedulable) -> None:
        known = self._task_session.get(decision.task_id)
        if known is None:  # a kernel that can never be placed: all its tasks are lost
            run = self._runs[decision.task_id]
            for index in range(run.next_task, len(run.session.tasks)):
                self.meters.unschedulable(f"{run.session.id}/{index}", decision.reason)
            run.next_task = len(run.session.tasks)
            run.busy = False
            self._maybe_close(run)
            return
        self.meters.unschedulable(decision.task_id, decision.reason)
        self._advance(known[0])

    def _advance(self, run: _SessionRun) -> None:
        run.busy = False
        run.next_task += 1
        self._offer_next(run)
