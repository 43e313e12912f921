"""What a scheduling policy is asked, and what it answers.

A policy reacts to events (a session opens, a task is submitted, a task ends, a
host joins, the autoscaler ticks) and answers with *decisions*. It applies each
decision to its own model of the fleet before answering, so the answer is a
record of what it did, not a request. The caller carries the decisions out: the
simulator charges their latencies on simulated time, and the live scheduler
turns them into agent calls. Neither needs to know which policy made them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nbfleet.model.cluster import ResourceSpec


@dataclass(frozen=True, slots=True)
class KernelRequest:
    """A notebook session's kernel: the resources it asks for while it lives, and
    whose it is (its cells wait in the fair queue as ``tenant`` in tier ``priority``)."""

    id: str
    spec: ResourceSpec
    tenant: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """One cell execution of ``kernel_id`` that needs ``gpus`` GPUs of the kernel's kind."""

    id: str
    kernel_id: str
    gpus: int


class StartPath(enum.Enum):
    """How a task got its GPUs; the caller prices each path's latency.

    * ``RESERVED``: the kernel already holds its GPUs (nothing to do).
    * ``LOCAL``: a replica already on the host binds free GPUs (executor election).
    * ``WARM``: a pre-warmed container takes the task (and loads the session's state).
    * ``COLD``: a container is created for the task (and loads the session's state).
    * ``MIGRATE_WARM`` / ``MIGRATE_COLD``: a replica moves to a host with free GPUs,
      into a pre-warmed container or a new one.
    """

    RESERVED = "reserved"
    LOCAL = "local"
    WARM = "warm"
    COLD = "cold"
    MIGRATE_WARM = "migrate_warm"
    MIGRATE_COLD = "migrate_cold"

    @property
    def on_replica(self) -> bool:
        """Whether a kernel replica executes the task (it stops being a standby)."""
        return self in (StartPath.LOCAL, StartPath.MIGRATE_WARM, StartPath.MIGRATE_COLD)


@dataclass(frozen=True, slots=True)
class Placed:
    """A kernel's containers were created on these hosts (replicas, or one reserved
    container); none for policies whose sessions hold nothing between tasks."""

    kernel_id: str
    host_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Started:
    """``task_id`` runs on ``host_id`` with these GPU indices, reached by ``path``."""

    task_id: str
    kernel_id: str
    host_id: str
    gpu_indices: tuple[int, ...]
    path: StartPath


@dataclass(frozen=True, slots=True)
class Queued:
    """No GPUs now; the task waits and starts on a later event."""

    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """The task (or kernel) can never fit on any host the fleet may have."""

    task_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Migrated:
    """A replica of ``kernel_id`` moved between hosts: to run a task (``for_task``,
    on the critical path) or to empty a host for scale-in (off it)."""

    kernel_id: str
    from_host: str
    to_host: str
    warm: bool
    for_task: bool = True


@dataclass(frozen=True, slots=True)
class ScaleOut:
    """Provision ``count`` hosts of the fleet's host shape."""

    count: int
    reason: str


@dataclass(frozen=True, slots=True)
class ScaleIn:
    """These hosts hold nothing any more; release them."""

    host_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Prewarm:
    """Start ``count`` containers on ``host_id`` to keep its warm pool at target."""

    host_id: str
    count: int


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """A long-idle kernel gave back the replicas on these hosts; its state stays on
    the replica it kept and in the store."""

    kernel_id: str
    host_ids: tuple[str, ...]


Decision = (Placed | Started | Queued | Unschedulable | Migrated | ScaleOut | ScaleIn
            | Prewarm | Reclaimed)


def decision_record(decision: Decision) -> dict[str, object]:
    """A decision as JSON-ready fields with its ``kind``: the record the live
    scheduler serves (``/v1/admin/fleet/decisions``) and the simulator's log is
    compared with."""
    record: dict[str, object] = {"kind": type(decision).__name__}
    for name in decision.__dataclass_fields__:
        value = getattr(decision, name)
        if isinstance(value, StartPath):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        record[name] = value
    return record
