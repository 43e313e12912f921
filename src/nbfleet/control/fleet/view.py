"""The fleet as an operator sees it: hosts, GPUs (total, subscribed, committed, by
type), subscription ratio, warm pools and the queue of waiting cells. The same
figures are exported as Prometheus gauges."""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

from nbfleet.control.fleet.scheduler import LiveScheduler
from nbfleet.model.cluster import Host
from nbfleet.policy.scheduling.decisions import decision_record

FLEET_HOSTS = Gauge("nbfleet_fleet_hosts", "Hosts in the GPU scheduler's model",
                    ["state"])
FLEET_GPUS = Gauge("nbfleet_fleet_gpus", "GPUs by type: total, subscribed by kernels, "
                   "committed to running cells", ["gpu_type", "state"])
FLEET_SR = Gauge("nbfleet_fleet_subscription_ratio",
                 "Subscribed GPUs / (GPUs x replicas per kernel), fleet-wide")
FLEET_QUEUED = Gauge("nbfleet_fleet_waiting_cells", "Cells waiting for GPUs")
FLEET_RUNNING = Gauge("nbfleet_fleet_running_cells", "Cells running with GPUs bound")
FLEET_WARM = Gauge("nbfleet_fleet_warm_containers", "Warm containers the policy counts")


def host_view(host: Host, scheduler: LiveScheduler) -> dict[str, Any]:
    policy = scheduler.policy
    by_type: dict[str, dict[str, int]] = {}
    for gpu in host.gpus:
        row = by_type.setdefault(gpu.gpu_type, {"total": 0, "committed": 0})
        row["total"] += 1
        if host.holder_of(gpu.index) is not None:
            row["committed"] += 1
    return {
        "id": host.id,
        "gpus": {"total": len(host.gpus), "subscribed": host.subscribed_gpus,
                 "committed": host.committed_gpus, "by_type": by_type},
        "subscription_ratio": round(host.subscription_ratio(policy.config.replicas), 4),
        "kernels": sorted(host.subscriptions),
        "warm": policy.warm.get(host.id, 0),
        "warming": policy.warming.get(host.id, 0),
    }


def fleet_view(scheduler: LiveScheduler) -> dict[str, Any]:
    policy = scheduler.policy
    snapshot = scheduler.snapshot()
    queue = []
    for task, waited in scheduler.queue():
        queue.append({"cell": task.id, "workspace_id": task.kernel_id, "gpus": task.gpus,
                      "waited_s": round(waited, 3), "reason": scheduler.wait_reason(task.id)})
    running = [{"cell": task_id, "workspace_id": cell.binding.workspace_id,
                "host_id": cell.binding.host_id, "gpus": list(cell.binding.gpu_indices),
                "gpu_type": cell.binding.gpu_type, "path": cell.binding.path.value,
                "running_s": round(scheduler.now() - cell.started_at, 3),
                "replied": cell.replied_at is not None, "held": cell.held}
               for task_id, cell in sorted(scheduler.running.items())]
    return {
        "policy": policy.name,
        "replicas": policy.config.replicas,
        "totals": {"hosts": snapshot.hosts, "provisioning": snapshot.provisioning,
                   "gpus": snapshot.gpus, "subscribed_gpus": snapshot.subscribed_gpus,
                   "committed_gpus": snapshot.committed_gpus,
                   "subscription_ratio": round(snapshot.subscription_ratio, 4),
                   "kernels": snapshot.kernels, "running_cells": len(scheduler.running),
                   "waiting_cells": snapshot.queued, "warm": snapshot.warm},
        "hosts": [host_view(h, scheduler) for _, h in sorted(policy.hosts.items())],
        "queue": queue,
        "running": running,
        "autoscaler_passes": scheduler.autoscaler_passes,
    }


def export_gauges(scheduler: LiveScheduler | None) -> None:
    """Set the gauges from the model (the reconciler's tick calls this)."""
    if scheduler is None:
        return
    policy = scheduler.policy
    snapshot = scheduler.snapshot()
    FLEET_HOSTS.labels("ready").set(snapshot.hosts)
    FLEET_HOSTS.labels("provisioning").set(snapshot.provisioning)
    totals: dict[str, dict[str, int]] = {}
    for host in policy.hosts.values():
        for gpu in host.gpus:
            row = totals.setdefault(gpu.gpu_type, {"total": 0, "committed": 0, "subscribed": 0})
            row["total"] += 1
            row["committed"] += host.holder_of(gpu.index) is not None
        for spec in host.subscriptions.values():
            if spec.gpus:
                kind = next((g.gpu_type for g in host.gpus if g.satisfies(spec)), "other")
                totals.setdefault(kind, {"total": 0, "committed": 0, "subscribed": 0})
                totals[kind]["subscribed"] += spec.gpus
    for gpu_type, row in totals.items():
        for state, value in row.items():
            FLEET_GPUS.labels(gpu_type, state).set(value)
    FLEET_SR.set(snapshot.subscription_ratio)
    FLEET_QUEUED.set(snapshot.queued)
    FLEET_RUNNING.set(len(scheduler.running))
    FLEET_WARM.set(snapshot.warm)


def decisions_view(scheduler: LiveScheduler, after: int, limit: int) -> dict[str, Any]:
    """The policy's decisions logged after ``after`` (a ``seq``), oldest first: why
    a kernel is where it is, why a cell waited or moved. ``next`` pages on;
    ``first`` is the oldest still kept (the log is bounded)."""
    items = []
    for logged in scheduler.log:
        if logged.seq <= after:
            continue
        items.append({"seq": logged.seq, "at_s": round(logged.at, 6),
                      **decision_record(logged.decision)})
        if len(items) >= limit:
            break
    first = scheduler.log[0].seq if scheduler.log else scheduler.logged
    return {"items": items, "first": first,
            "next": items[-1]["seq"] if items else max(after, first - 1)}
