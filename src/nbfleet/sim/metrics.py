"""What a simulation measures while it runs: task timings, meters, samples.

Meters integrate piecewise-constant quantities exactly between events (hosts
billed, GPUs held by reservations, standby replicas), so GPU-hours do not depend
on the sampling interval; samples only feed the time-series CSV and plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nbfleet.policy.scheduling.base import FleetSnapshot
from nbfleet.policy.scheduling.decisions import StartPath

HOUR = 3600.0


class Integral:
    """The time integral of a value that changes in steps."""

    __slots__ = ("area", "at", "peak", "value")

    def __init__(self, start: float) -> None:
        self.value = 0.0
        self.at = start
        self.area = 0.0
        self.peak = 0.0

    def add(self, now: float, delta: float) -> None:
        self.area += self.value * (now - self.at)
        self.at = now
        self.value += delta
        self.peak = max(self.peak, self.value)

    def hours(self, now: float) -> float:
        return (self.area + self.value * (now - self.at)) / HOUR


@dataclass(slots=True)
class TaskRecord:
    id: str
    submit_s: float  # in the trace
    eligible_s: float  # submitted and its session idle (Jupyter runs cells in order)
    gpus: int
    decided_s: float | None = None
    start_s: float | None = None
    end_s: float | None = None  # execution done (TCT ends here)
    released_s: float | None = None  # GPUs free again (after state write-back)
    path: StartPath | None = None
    unschedulable: str | None = None

    @property
    def delay_s(self) -> float | None:
        return None if self.start_s is None else self.start_s - self.eligible_s

    @property
    def tct_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.submit_s


@dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at ``at``, with the meters' running counts so far."""

    at: float
    fleet: FleetSnapshot
    open_sessions: int
    migrations: int
    scaled_out_hosts: int
    scaled_in_hosts: int


@dataclass(slots=True)
class _KernelMeter:
    replicas: int
    gpus: int
    active: bool = True


@dataclass
class Meters:
    policy: str
    gpus_per_host: int
    start: float
    end: float = 0.0
    events: int = 0
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    migrations: int = 0
    scale_out_events: int = 0
    scale_out_hosts: int = 0
    scale_in_events: int = 0
    scale_in_hosts: int = 0
    evacuations: int = 0
    shrinks: int = 0

    def __post_init__(self) -> None:
        self.billed_hosts = Integral(self.start)
        self.reserved_gpus = Integral(self.start)
        self.standby_replicas = Integral(self.start)
        self._kernels: dict[str, _KernelMeter] = {}

    # ----------------------------------------------------------- hosts
    def hosts_billed(self, now: float, count: int) -> None:
        self.billed_hosts.add(now, count)

    def scaled_out(self, now: float, count: int) -> None:
        self.scale_out_events += 1
        self.scale_out_hosts += count
        self.billed_hosts.add(now, count)

    def scaled_in(self, now: float, count: int) -> None:
        self.scale_in_events += 1
        self.scale_in_hosts += count
        self.billed_hosts.add(now, -count)

    def migrated(self, now: float, for_task: bool) -> None:
        if for_task:
            self.migrations += 1
        else:
            self.evacuations += 1

    # --------------------------------------------------------- kernels
    def replicas_added(self, kernel_id: str, now: float, replicas: int, gpus: int) -> None:
        """A kernel was placed, or grew back replicas it had given up."""
        meter = self._kernels.get(kernel_id)
        if meter is None:
            self._kernels[kernel_id] = _KernelMeter(replicas, gpus)
            self.reserved_gpus.add(now, gpus if replicas else 0)
        else:
            meter.replicas += replicas
        self.standby_replicas.add(now, replicas)

    def replicas_removed(self, kernel_id: str, now: float, replicas: int) -> None:
        self.shrinks += 1
        self._kernels[kernel_id].replicas -= replicas
        self.standby_replicas.add(now, -replicas)

    def _kernel_gone(self, kernel_id: str, now: float) -> None:
        meter = self._kernels.get(kernel_id)
        if meter is None or not meter.active:
            return
        meter.active = False
        self.reserved_gpus.add(now, -(meter.gpus if meter.replicas else 0))
        self.standby_replicas.add(now, -meter.replicas)

    def kernel_closed(self, kernel_id: str, now: float) -> None:
        self._kernel_gone(kernel_id, now)

    # ----------------------------------------------------------- tasks
    def task_submitted(self, task_id: str, submit_s: float, now: float, gpus: int) -> None:
        self.tasks[task_id] = TaskRecord(task_id, submit_s, now, gpus)

    def task_started(self, task_id: str, decided: float, begins: float, ends: float,
                     gpus: int, path: StartPath, *, uses_replica: bool) -> None:
        record = self.tasks[task_id]
        record.decided_s, record.start_s, record.end_s, record.path = decided, begins, ends, path
        record.gpus = gpus
        if uses_replica:  # the executor is billed as running, not as a standby
            self.standby_replicas.add(decided, -1)

    def task_finished(self, task_id: str, kernel_id: str, now: float) -> None:
        record = self.tasks[task_id]
        record.released_s = now
        if record.path is not None and record.path.on_replica:
            meter = self._kernels.get(kernel_id)
            if meter is not None and meter.active:
                self.standby_replicas.add(now, 1)

    def unschedulable(self, task_id: str, reason: str) -> None:
        record = self.tasks.setdefault(task_id, TaskRecord(task_id, 0.0, 0.0, 0))
        record.unschedulable = reason

    # --------------------------------------------------------- samples
    def sample(self, now: float, fleet: FleetSnapshot, open_sessions: int) -> None:
        self.samples.append(Sample(now, fleet, open_sessions, self.migrations,
                                   self.scale_out_hosts, self.scale_in_hosts))

    def finish(self, now: float, events: int) -> None:
        self.end = now
        self.events = events

    def busy_gpu_hours(self) -> float:
        """GPU-hours of task execution proper (start to end, excluding overheads)."""
        return sum(r.gpus * (r.end_s - r.start_s) for r in self.tasks.values()
                   if r.start_s is not None and r.end_s is not None) / HOUR
