"""Which host a workspace's runtime is placed on: the reconciler's choice, recorded
on the workspace's row in the transaction that begins the placement."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from nbfleet.control import hosts, standbys
from nbfleet.control.fleet.service import GpuPlacement
from nbfleet.control.workspaces import SHAPES_RECHECK_S, FleetShapes, resources_of, transition
from nbfleet.db.tables import Agent, Workspace
from nbfleet.model.workspace import WorkspaceState, retry_delay_s
from nbfleet.policy.placement import least_loaded

#: How often a GPU workspace waiting for a host looks again (a placement change
#: wakes the reconciler sooner).
GPU_WAIT_RETRY_S = 2.0


def cpu_host(session: Session, ws: Workspace, now: datetime, timeout: float) -> Agent | None:
    """The least loaded host that takes placements, or the one a move names (a drain
    chose it) if it still takes work; None (with a backoff) when there is none."""
    loads = hosts.host_loads(session, now, timeout)
    target, ws.move_to = ws.move_to, None
    chosen = (target if any(load.host_id == target for load in loads)
              else least_loaded(loads))
    if chosen is None:
        ws.last_error = "no host is available"
        ws.attempts += 1
        ws.next_attempt_at = now + timedelta(seconds=retry_delay_s(ws.attempts))
        return None
    host = hosts.alive_agent(session, chosen, now, timeout)
    assert host is not None
    ws.host_id, ws.host_boot_id = host.id, host.boot_id  # recorded before acting
    return host


def gpu_host(session: Session, ws: Workspace, gpu: GpuPlacement, now: datetime,
             timeout: float, shapes: FleetShapes) -> Agent | None:
    """Record the scheduler's placement and return the host to run on, or None
    (the workspace waits, or fails when it can never be placed)."""
    if gpu.refused is not None:
        _refused(session, ws, now, shapes)
        return None
    draining = hosts.draining_hosts(session)
    candidates = [h for h in gpu.hosts if h not in draining]
    if ws.move_to is None and len(candidates) > 1 and not gpu.reserved:
        # A replica host holding a standby serves at once (``standbys``).
        warm = standbys.hosts_with_standbys(session, ws.id, ws.snapshot, now, timeout)
        candidates.sort(key=lambda h: warm.index(h) if h in warm else len(warm))
    if ws.move_to is not None and gpu.waiting is None:
        # Moved for a cell whose GPUs the scheduler bound there.
        if ws.move_to not in draining:
            candidates = [ws.move_to] + [h for h in candidates if h != ws.move_to]
        ws.move_to = None
    if gpu.waiting is None and not candidates:
        # Its sessions own no host between cells (batch, lcp): the kernel lives
        # where there is room, and GPUs come per cell.
        chosen = least_loaded(hosts.host_loads(session, now, timeout))
        candidates = [chosen] if chosen is not None else []
    host = hosts.alive_agent(session, candidates[0], now, timeout) if candidates else None
    if host is None:
        # Waiting for capacity is not a failure: no backoff, and the scheduler
        # wakes the reconciler when a placement changes.
        ws.last_error = gpu.waiting or "waiting for its GPU host to come up"
        ws.next_attempt_at = now + timedelta(seconds=GPU_WAIT_RETRY_S)
        return None
    ws.gpu_placement = {"hosts": list(gpu.hosts), "reserved": list(gpu.reserved)}
    ws.host_id, ws.host_boot_id = host.id, host.boot_id
    return host


def _refused(session: Session, ws: Workspace, now: datetime, shapes: FleetShapes) -> None:
    """The scheduler refused the workspace: it waits, or fails, saying why.

    The scheduler judges by the hosts in its model, which holds only the hosts
    that are up (with none, by the shape it was last sized for): with every host
    away, or every host of the one kind that fits, it refuses what the API
    accepted because registered hosts can hold it. That is a wait, retried like any wait for
    capacity. Only when no registered host (nor the autoscaler's shape) could ever
    hold it does the workspace fail, with the reason; it is not retried behind the
    user's back (nothing would change), and a resume asks again
    (``workspaces.request_state``). A failure is judged on a fresh read of the
    shapes (``FleetShapes``), a wait on the cached one."""
    spec = resources_of(ws)
    reason = shapes.reason(session, spec)
    if reason is not None:
        reason = shapes.reason(session, spec, SHAPES_RECHECK_S)
    if reason is None:
        kinds = " or ".join(spec.gpu_types) or "GPU"
        ws.last_error = (f"waiting for a host with {spec.gpus}x {kinds} to come back: "
                         "none that can hold it is up")
        ws.next_attempt_at = now + timedelta(seconds=GPU_WAIT_RETRY_S)
        return
    ws.last_error = f"cannot place: {reason}"
    transition(session, ws, WorkspaceState.FAILED, now, ws.last_error)
    ws.pending = False
