"""What a reconciler step carries, and what it keeps of the agent's answer.

A placement keeps what its restore brought back (the summary the API shows) and,
after a lost host, what that cost (``failover``); a suspend keeps the snapshot it
saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from nbfleet.control import failover
from nbfleet.db.tables import Workspace
from nbfleet.model.workspace import Action, Step, WorkspaceState
from nbfleet.protocol.agent import RuntimePlaced, RuntimeSuspended
from nbfleet.web.render import iso


@dataclass(frozen=True, slots=True)
class Work:
    """What one step will do, captured in its first transaction."""

    workspace_id: str
    step: Step
    generation: int
    expect_state: WorkspaceState
    host_url: str | None
    kernels: tuple[tuple[str, str], ...]
    snapshot: dict[str, Any] | None
    #: The project's own kernel limits (None: the agent's defaults).
    limits: dict[str, Any] | None = None
    #: The project's network mode for its kernels (None: no network).
    network: str | None = None
    #: GPUs the workspace asked for (0: the GPU scheduler has no part in it).
    gpus: int = 0
    #: A release that moves the kernel to another host (its GPU kernel stays open).
    moving: bool = False
    #: kernel id -> what its notebook is told first on this placement (``failover``).
    notices: dict[str, str] = field(default_factory=dict)


def restore_summary(work: Work, result: RuntimePlaced,
                    now: datetime) -> dict[str, Any] | None:
    """What this placement (of ``work.generation``) restored, replacing any earlier one:
    a summary is never shown for a resume it does not belong to.

    An agent that already had the runtime (an earlier attempt placed it, and its answer
    was lost: the control plane timed out) reports nothing for it; such kernels are
    listed as ``unreported`` rather than passed off as restored or lost.
    """
    # Kept as the agent sent them: only the fields its restore set.
    reports = {kid: report.model_dump(mode="json", exclude_unset=True)
               for kid, report in result.restore.items()}
    saved = sorted((work.snapshot or {}).get("kernels") or {})
    lost = failover.report(work.snapshot, [kid for kid, _ in work.kernels])
    if not reports and not saved and lost is None:
        return None
    summary: dict[str, Any] = {
        "generation": work.generation, "at": iso(now), "kernels": reports,
        "packages": result.packages.model_dump(mode="json", exclude_unset=True)}
    if lost is not None:
        summary["host_lost"] = lost
    unreported = [kernel_id for kernel_id in saved if kernel_id not in reports]
    if unreported:
        summary["unreported"] = unreported
    return summary


def record(ws: Workspace, work: Work, result: RuntimePlaced | RuntimeSuspended,
           now: datetime) -> None:
    """Keep what an agent reported: the snapshot a suspend saved, what a resume restored."""
    kernel_ids = {kid for kid, _ in work.kernels}
    # A new runtime starts from the store; its host reports from its first heartbeat.
    ws.files_unsynced_since = None
    if work.step.action is Action.PLACE and isinstance(result, RuntimePlaced):
        ws.restore = restore_summary(work, result, now)
        ws.snapshot = failover.settle(ws.snapshot)
    saved = result.snapshot if isinstance(result, RuntimeSuspended) else None
    if work.step.action is Action.RELEASE and saved is not None:
        previous = (ws.snapshot or {}).get("kernels", {})
        # A kernel that could not flush keeps its last complete snapshot.
        uploaded = {kid: k.model_dump(mode="json") for kid, k in saved.kernels.items()}
        kernels = {kid: key for kid, key in {**previous, **uploaded}.items()
                   if kid in kernel_ids}
        ws.snapshot = {"at": iso(now), "kernels": kernels, "packages": saved.packages,
                       "bytes": sum(int(k.get("bytes", 0)) for k in kernels.values()),
                       "notes": saved.notes}
