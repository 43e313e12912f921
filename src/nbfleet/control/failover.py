"""What a workspace keeps when its host is lost, and what its notebook is told.

Three records, all in the workspace's ``snapshot`` (one row, one lock: the
database is the serialisation point):

- ``kernels[id]``: the kernel's latest saved state. A suspend writes it; so does
  each cell's checkpoint (``agent/checkpoints.py``), with the count of the last
  cell it includes. A checkpoint is kept only from the host the workspace runs on,
  in the boot and generation it was placed with: a host presumed dead, or an older
  placement, can never overwrite the state a newer one saved (the fencing token).
- ``restarted[id]``: the kernel's process was restarted (by its user, or after a
  crash) and no state was saved since. Its ``kernels`` entry is removed with the
  same fencing, so a placement restores nothing rather than variables the restart
  cleared; the next checkpoint or suspend replaces the mark.
- ``host_lost``: set when the control plane sends the runtime back to be placed
  again (:func:`nbfleet.control.hosts.runtimes_lost`).
- ``cells[id]``: what the kernel's gateway saw when the host went away mid-cell:
  the last completed cell and the cells that were interrupted. They are answered
  with an error at once and never sent again (:mod:`nbfleet.control.fleet.inflight`).

The next placement tells the notebook what came back and what did not
(:func:`notices`), keeps it in the restore summary, and clears the marks.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from nbfleet.db.engine import Database
from nbfleet.db.tables import Kernel, Workspace
from nbfleet.model.errors import NotFound
from nbfleet.model.workspace import WorkspaceState
from nbfleet.protocol.checkpoints import CellCheckpoint, CheckpointRecorded
from nbfleet.web.render import iso

#: At most this many interrupted cells are remembered per kernel.
MAX_INTERRUPTED = 100


#: How a failed cell checkpoint's last error begins (a later good one clears it).
CHECKPOINT_FAILED = "the cell checkpoint"


def record_checkpoint(db: Database, workspace_id: str,
                      body: CellCheckpoint) -> CheckpointRecorded:
    """Keep a kernel's latest state (or, with no key, that it was restarted and holds
    nothing) if the agent still runs the workspace; ``replaced``: the manifest no
    longer named, for the agent to delete if it uploaded it."""
    with db.transaction() as session:
        ws = session.get(Workspace, workspace_id, with_for_update=True)
        if ws is None:
            raise NotFound(f"no workspace {workspace_id}")
        refused = _stale(ws, body)
        if refused is None:
            kernel = session.get(Kernel, body.kernel_id)
            if kernel is None or kernel.workspace_id != workspace_id:
                refused = "the workspace has no such kernel"
        if refused is not None:
            return CheckpointRecorded(kept=False, reason=refused)
        snapshot = dict(ws.snapshot or {})
        at = iso(db.now(session))
        failures = dict(snapshot.get("checkpoint_failures") or {})
        if body.failed is not None:
            # The kept state stays; the workspace says how far behind it is, and why.
            failures[body.kernel_id] = {"cell": body.cell, "at": at, "reason": body.failed}
            snapshot["checkpoint_failures"] = failures
            ws.snapshot = snapshot
            kept = (snapshot.get("kernels") or {}).get(body.kernel_id) or {}
            as_of = (f"cell {kept['cell']}" if isinstance(kept.get("cell"), int)
                     else "its last suspend")
            if ws.last_error is None or ws.last_error.startswith(CHECKPOINT_FAILED):
                # Another operation's failure (a suspend that could not save) says
                # more: it stays, and the snapshot's entry says this one.
                ws.last_error = (f"{CHECKPOINT_FAILED} of kernel {body.kernel_id} after cell "
                                 f"{body.cell} failed: {body.failed}; if its host is lost it "
                                 f"comes back as of {as_of}")[:2000]
            return CheckpointRecorded(kept=True)
        if failures.pop(body.kernel_id, None) is not None:
            if failures:
                snapshot["checkpoint_failures"] = failures
            else:
                snapshot.pop("checkpoint_failures", None)
            if (ws.last_error or "").startswith(f"{CHECKPOINT_FAILED} of kernel {body.kernel_id} "):
                ws.last_error = None
        kernels = dict(snapshot.get("kernels") or {})
        restarted = dict(snapshot.get("restarted") or {})
        previous = kernels.pop(body.kernel_id, None) or {}
        if body.key is None:
            # Nothing to restore: a placement starts the kernel empty, as the restart
            # left it, and says why (``report``).
            restarted[body.kernel_id] = {"at": at, "host": body.agent_id}
        else:
            restarted.pop(body.kernel_id, None)
            kernels[body.kernel_id] = {
                "key": body.key, "bytes": body.bytes, "written": body.written,
                "cell": body.cell, "at": at, "host": body.agent_id}
        snapshot.update(kernels=kernels, at=at,
                        bytes=sum(int(k.get("bytes", 0)) for k in kernels.values()))
        if restarted:
            snapshot["restarted"] = restarted
        else:
            snapshot.pop("restarted", None)
        snapshot.setdefault("packages", None)
        ws.snapshot = snapshot
        replaced = previous.get("key")
        return CheckpointRecorded(kept=True, replaced=replaced if replaced != body.key else None)


def _stale(ws: Workspace, body: CellCheckpoint) -> str | None:
    if ws.state != WorkspaceState.RUNNING:
        return f"the workspace is {ws.state}"
    if ws.host_id != body.agent_id or ws.host_boot_id != body.boot_id:
        return "the workspace runs elsewhere now"
    if ws.placed_generation != body.generation:
        return (f"generation {body.generation} is not the placement's "
                f"({ws.placed_generation})")
    return None


def mark_host_lost(ws: Workspace, now: datetime, reason: str,
                   files_as_of: datetime | None = None) -> None:
    """The runtime on ``ws.host_id`` is gone: its kernels restart from what was saved,
    its files from what the store held (all of them as of ``files_as_of``).

    The generation moves on: a host presumed dead that still runs the old runtime
    is fenced off (its checkpoints are refused, and a placement back on it replaces
    that runtime instead of adopting it: ``RuntimeManager.ensure``)."""
    ws.generation += 1
    snapshot = dict(ws.snapshot or {})
    snapshot["host_lost"] = {"host": ws.host_id, "at": iso(now), "reason": reason[:500],
                             "files_as_of": iso(min(files_as_of, now)) if files_as_of
                             else None}
    ws.snapshot = snapshot


def record_cells(db: Database, workspace_id: str, kernel_id: str, host_id: str,
                 last_completed: int | None, interrupted: int) -> None:
    """The gateway lost the kernel's host with ``interrupted`` cells unanswered."""
    with db.transaction() as session:
        ws = session.get(Workspace, workspace_id, with_for_update=True)
        if ws is None:
            return
        snapshot = dict(ws.snapshot or {})
        cells = dict(snapshot.get("cells") or {})
        seen = dict(cells.get(kernel_id) or {})
        if seen.get("host") != host_id:
            seen = {"host": host_id, "interrupted": 0, "last_completed": None}
        seen["interrupted"] = min(int(seen["interrupted"]) + interrupted, MAX_INTERRUPTED)
        if last_completed is not None:
            seen["last_completed"] = max(last_completed, seen["last_completed"] or 0)
        cells[kernel_id] = seen
        snapshot["cells"] = cells
        ws.snapshot = snapshot


def settle(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """The snapshot once a placement has told what its host loss cost."""
    if not snapshot:
        return snapshot
    return {k: v for k, v in snapshot.items() if k not in ("host_lost", "cells")}


def report(snapshot: dict[str, Any] | None, kernel_ids: list[str]) -> dict[str, Any] | None:
    """For the restore summary: which cell each kernel's state is from, and what the
    host loss cost; None when no host was lost."""
    lost = (snapshot or {}).get("host_lost")
    if not isinstance(lost, dict):
        return None
    saved = (snapshot or {}).get("kernels") or {}
    restarted = (snapshot or {}).get("restarted") or {}
    cells = (snapshot or {}).get("cells") or {}
    kernels: dict[str, Any] = {}
    for kernel_id in kernel_ids:
        entry = saved.get(kernel_id) or {}
        seen = cells.get(kernel_id) or {}
        if seen.get("host") != lost.get("host"):
            seen = {}  # what a gateway saw of another host (a kernel shut down there)
        as_of = entry.get("cell") if entry else None
        last = seen.get("last_completed")
        kernels[kernel_id] = {
            "state": ("after_cell" if as_of is not None
                      else "last_suspend" if entry
                      else "restarted" if kernel_id in restarted else "none"),
            "as_of_cell": as_of,
            "last_completed_cell": last,
            "cells_not_saved": (max(0, last - as_of) if isinstance(last, int)
                                and isinstance(as_of, int) else None),
            "interrupted": int(seen.get("interrupted", 0)),
        }
    return {"host": lost.get("host"), "at": lost.get("at"), "reason": lost.get("reason"),
            "files_as_of": lost.get("files_as_of"), "kernels": kernels}


def _clock(at: object) -> str:
    text = str(at or "")
    return f"{text[:10]} {text[11:19]}"


def rolled_back(snapshot: dict[str, Any] | None, kernel_ids: list[str]) -> str | None:
    """One line for the workspace's events: what a placement after a lost host came
    back to, and what it lost; None when no host was lost."""
    lost = report(snapshot, kernel_ids)
    if lost is None:
        return None
    parts = [f"back after the loss of {lost['host']} ({lost['reason']})"]
    for kernel_id, facts in lost["kernels"].items():
        kernel = f"kernel {kernel_id[:8]}: "
        if facts["state"] == "after_cell":
            kernel += f"variables as after cell [{facts['as_of_cell']}]"
        elif facts["state"] == "last_suspend":
            kernel += "variables as at its last suspend"
        else:
            kernel += "no variables saved"
        if facts["cells_not_saved"]:
            kernel += f", cells up to [{facts['last_completed_cell']}] lost"
        if facts["interrupted"]:
            kernel += f", {facts['interrupted']} cell(s) interrupted"
        parts.append(kernel)
    if lost.get("files_as_of"):
        parts.append(f"files as saved at {_clock(lost['files_as_of'])} UTC, later writes lost")
    return "; ".join(parts)[:2000]


def notices(snapshot: dict[str, Any] | None, kernel_ids: list[str],
            new_host: str) -> dict[str, str]:
    """What each kernel's notebook is told when it comes back after a lost host."""
    lost = report(snapshot, kernel_ids)
    if lost is None:
        return {}
    out = {}
    for kernel_id, facts in lost["kernels"].items():
        out[kernel_id] = _notice(lost, facts, new_host)
    return out


def _notice(lost: dict[str, Any], facts: dict[str, Any], new_host: str) -> str:
    when = _clock(lost.get("at"))
    lines = [f"nbfleet: the host this kernel ran on ({lost['host']}) was lost at {when} UTC "
             f"({lost['reason']}); the kernel was restarted on {new_host}."]
    as_of = facts["as_of_cell"]
    if facts["state"] == "after_cell":
        lines.append(f"Its variables come from the state saved after cell [{as_of}].")
    elif facts["state"] == "last_suspend":
        lines.append("Its variables come from its last suspend: no cell's state had been "
                     "saved since.")
    elif facts["state"] == "restarted":
        lines.append("It had been restarted before the host was lost, and no cell's state "
                     "had been saved since: it had no variables to bring back.")
    else:
        lines.append("None of its variables had been saved: they are lost.")
    last, missing = facts["last_completed_cell"], facts["cells_not_saved"]
    if missing:
        lines.append(f"Cells after [{as_of}] up to [{last}] completed, but their state had "
                     "not reached the store: what they changed is lost; run them again.")
    interrupted = facts["interrupted"]
    if interrupted:
        lines.append(f"{interrupted} cell(s) running or queued when the host was lost were "
                     "interrupted and not run again.")
    if lost.get("files_as_of"):
        lines.append(f"Its files are as the store held them at {_clock(lost['files_as_of'])} "
                     "UTC: what its kernels wrote after that is lost.")
    return " ".join(lines) + "\n"
