"""Session traces as the simulator consumes them, whatever format they came from.

A trace is a set of notebook sessions; each session reserves a resource spec for its
lifetime and submits GPU tasks (cell executions) inside it. Readers and generators
build these objects; the invariants are checked here once, so every source gets the
same guarantees: finite non-negative times, tasks sorted by submit time, every task
inside its session, and a task never asks for more GPUs than its session holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path


class TraceError(ValueError):
    """A trace is malformed. ``path`` and ``line`` say where, when it came from a file."""

    def __init__(self, message: str, path: str | Path | None = None,
                 line: int | None = None) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.reason = message
        where = ""
        if self.path is not None:
            where = f"{self.path}:{line}: " if line is not None else f"{self.path}: "
        elif line is not None:
            where = f"line {line}: "
        super().__init__(where + message)


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise TraceError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class Task:
    """One GPU cell execution: submitted at ``submit_s``, runs ``duration_s`` once started."""

    submit_s: float
    duration_s: float
    gpus: int

    def __post_init__(self) -> None:
        _finite("submit_s", self.submit_s)
        _finite("duration_s", self.duration_s)
        if self.submit_s < 0:
            raise TraceError(f"task submit_s must not be negative, got {self.submit_s}")
        if self.duration_s < 0:
            raise TraceError(f"task duration_s must not be negative, got {self.duration_s}")
        if self.gpus < 0:
            raise TraceError(f"task gpus must not be negative, got {self.gpus}")

    @property
    def end_s(self) -> float:
        """When the task would finish if it started the moment it was submitted."""
        return self.submit_s + self.duration_s


def task_problem(task: Task, start_s: float, end_s: float, gpus: int) -> str | None:
    """Why ``task`` cannot belong to a session with these bounds, or None if it can.

    Shared by ``Session`` and the readers, which call it per row to name the line.
    """
    if task.submit_s < start_s:
        return f"task submitted at {task.submit_s} s, before its session starts ({start_s} s)"
    if task.end_s > end_s:
        return f"task ends at {task.end_s} s, after its session ends ({end_s} s)"
    if task.gpus > gpus:
        return f"task asks for {task.gpus} GPUs, its session holds {gpus}"
    return None


@dataclass(frozen=True, slots=True)
class Session:
    """A notebook session: holds ``gpus`` (VRAM floor per GPU, acceptable types) and runs tasks.

    Under a reservation policy the GPUs are bound for ``[start_s, end_s]``; the tasks
    say when they are actually needed.
    """

    id: str
    start_s: float
    end_s: float
    gpus: int
    vram_gb: float = 0.0
    gpu_types: tuple[str, ...] = ()
    tasks: tuple[Task, ...] = ()

    def __post_init__(self) -> None:
        if not self.id:
            raise TraceError("session id must not be empty")
        _finite("start_s", self.start_s)
        _finite("end_s", self.end_s)
        _finite("vram_gb", self.vram_gb)
        if self.start_s < 0:
            raise TraceError(f"session {self.id}: start_s must not be negative")
        if self.end_s < self.start_s:
            raise TraceError(f"session {self.id}: ends ({self.end_s} s) before it starts "
                             f"({self.start_s} s)")
        if self.gpus < 0 or self.vram_gb < 0:
            raise TraceError(f"session {self.id}: gpus and vram_gb must not be negative")
        previous = -math.inf
        for index, task in enumerate(self.tasks):
            problem = task_problem(task, self.start_s, self.end_s, self.gpus)
            if problem is not None:
                raise TraceError(f"session {self.id}, task {index}: {problem}")
            if task.submit_s < previous:
                raise TraceError(f"session {self.id}, task {index}: tasks must be sorted "
                                 "by submit time")
            previous = task.submit_s

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def busy_s(self) -> float:
        """Seconds of task execution (overlapping tasks counted once each)."""
        return sum(t.duration_s for t in self.tasks)

    @property
    def busy_share(self) -> float:
        """Fraction of the lifetime spent executing tasks (paper, Figure 2(c) dashed line)."""
        return self.busy_s / self.duration_s if self.duration_s > 0 else 0.0

    def think_times(self) -> list[float]:
        """Idle gaps from one task's end to the next task's submit (this package's IAT)."""
        return [b.submit_s - a.end_s for a, b in pairwise(self.tasks)]

    def inter_arrivals(self) -> list[float]:
        """Submit-to-submit gaps between consecutive tasks."""
        return [b.submit_s - a.submit_s
                for a, b in pairwise(self.tasks)]


@dataclass(frozen=True, slots=True)
class Trace:
    """Sessions sorted by start time (then id); ids are unique."""

    sessions: tuple[Session, ...]
    name: str = "trace"

    def __post_init__(self) -> None:
        seen: set[str] = set()
        previous: tuple[float, str] | None = None
        for session in self.sessions:
            if session.id in seen:
                raise TraceError(f"duplicate session id {session.id!r}")
            seen.add(session.id)
            key = (session.start_s, session.id)
            if previous is not None and key < previous:
                raise TraceError("sessions must be sorted by start time, then id")
            previous = key

    @classmethod
    def of(cls, sessions: list[Session] | tuple[Session, ...], name: str = "trace") -> Trace:
        """Build a trace from sessions in any order."""
        return cls(tuple(sorted(sessions, key=lambda s: (s.start_s, s.id))), name)

    @property
    def start_s(self) -> float:
        return min((s.start_s for s in self.sessions), default=0.0)

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.sessions), default=0.0)

    @property
    def duration_s(self) -> float:
        """From the first session's start to the last session's end."""
        return self.end_s - self.start_s

    @property
    def task_count(self) -> int:
        return sum(len(s.tasks) for s in self.sessions)

    def tasks(self) -> list[tuple[Session, Task]]:
        """Every task with its session, in submit order (ties: session order)."""
        pairs = [(s, t) for s in self.sessions for t in s.tasks]
        pairs.sort(key=lambda pair: pair[1].submit_s)
        return pairs

    def reserved_gpu_hours(self) -> float:
        """GPU-hours a reservation policy would hold: each session's GPUs for its lifetime."""
        return sum(s.gpus * s.duration_s for s in self.sessions) / 3600.0

    def busy_gpu_hours(self) -> float:
        """GPU-hours the tasks actually execute for."""
        return sum(t.gpus * t.duration_s for s in self.sessions for t in s.tasks) / 3600.0
