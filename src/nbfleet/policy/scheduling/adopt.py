"""Rebuilding a policy's model from what is already true (a control plane that
restarts or takes over the lease).

A fresh policy must not *decide* again where existing kernels go or which GPUs
running cells hold: that would move kernels nobody asked to move, or bind a GPU a
running cell still uses. These functions put the facts back instead: placements
from the database, running cells from the agents' reports.
"""

from __future__ import annotations

from collections.abc import Iterable

from nbfleet.model.errors import DomainError
from nbfleet.policy.scheduling.base import FleetPolicy, KernelState
from nbfleet.policy.scheduling.decisions import KernelRequest, Started, StartPath, TaskRequest


def adopt_kernel(policy: FleetPolicy, request: KernelRequest, host_ids: Iterable[str],
                 reserved: Iterable[int] = (), now: float = 0.0) -> None:
    """Put back a kernel placed before this model existed (a restarted or new
    control plane), on the hosts it was placed on, without deciding anything."""
    kernel = KernelState(request.id, request.spec, last_active=now, placed=True,
                         tenant=request.tenant, priority=request.priority)
    host_ids = list(host_ids)
    if policy.keeps_replicas:
        kernel.want = len(host_ids)
    for host_id in host_ids:
        host = policy.hosts.get(host_id)
        if host is None:
            continue  # that host is gone: the kernel has one replica fewer
        host.subscribe(kernel.id, kernel.spec)
        kernel.hosts.append(host_id)
        indices = tuple(reserved)
        if indices and len(kernel.hosts) == 1:
            host.commit(kernel.id, indices)
    if not kernel.hosts and policy.holds_hosts(kernel):
        kernel.placed = False
        policy.waiting_kernels.append(kernel.id)
    elif len(kernel.hosts) < kernel.want:
        policy.short.add(kernel.id)  # a replica went with a host: ``fill_replicas``
    policy.kernels[kernel.id] = kernel


def adopt_task(policy: FleetPolicy, task: TaskRequest, host_id: str, gpu_indices: Iterable[int],
               path: StartPath = StartPath.LOCAL, now: float = 0.0) -> Started | None:
    """Put back a task an agent reports running with these GPUs (rebuild);
    None when its kernel or host is unknown or a GPU is already bound, so a
    report can never bind a GPU twice."""
    kernel = policy.kernels.get(task.kernel_id)
    host = policy.hosts.get(host_id)
    if kernel is None or host is None or task.id in policy.running:
        return None
    indices = tuple(gpu_indices)
    if path is StartPath.RESERVED:
        if not set(indices) <= set(host.bound(kernel.id)):
            return None
    else:
        try:
            indices = host.commit(task.id, indices)
        except DomainError:
            return None
    started = Started(task.id, kernel.id, host_id, indices, path)
    policy.record_start(task, [started], now)
    return started
