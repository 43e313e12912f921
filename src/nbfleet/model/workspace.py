"""Workspace lifecycle: the state table, API request rules and the reconciler's plan.

The API only records a *desired* state; a reconciler moves the observed ``state``
towards it one step at a time. Because :func:`plan` depends only on the pair
(state, desired), re-running it after a crash or a duplicate request repeats the
same, idempotent step. Every state write is checked against :data:`TRANSITIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from nbfleet.model.errors import Conflict


class WorkspaceState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    RESUMING = "resuming"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"


class DesiredState(StrEnum):
    RUNNING = "running"
    SUSPENDED = "suspended"
    DELETED = "deleted"


S = WorkspaceState

#: Every state change the platform may make. Anything else is a bug and raises.
TRANSITIONS: dict[WorkspaceState, frozenset[WorkspaceState]] = {
    S.CREATING: frozenset({S.RUNNING, S.SUSPENDING, S.DELETING, S.FAILED}),
    S.RUNNING: frozenset({S.SUSPENDING, S.RESUMING, S.DELETING, S.FAILED}),
    S.SUSPENDING: frozenset({S.SUSPENDED, S.RUNNING, S.DELETING, S.FAILED}),
    S.SUSPENDED: frozenset({S.RESUMING, S.DELETING}),
    S.RESUMING: frozenset({S.RUNNING, S.SUSPENDING, S.DELETING, S.FAILED}),
    S.DELETING: frozenset({S.DELETED}),
    S.DELETED: frozenset(),
    S.FAILED: frozenset({S.RESUMING, S.SUSPENDING, S.DELETING}),
}

#: States in which the workspace has (or may have) a runtime on some host.
HOLDS_RUNTIME = frozenset({S.CREATING, S.RUNNING, S.RESUMING, S.SUSPENDING, S.FAILED})

#: The state each desired state settles in.
SETTLED: dict[DesiredState, WorkspaceState] = {
    DesiredState.RUNNING: S.RUNNING,
    DesiredState.SUSPENDED: S.SUSPENDED,
    DesiredState.DELETED: S.DELETED,
}

#: For each request, the states that refuse it (409 naming the state).
_REFUSED_BY: dict[DesiredState, frozenset[WorkspaceState]] = {
    DesiredState.RUNNING: frozenset({S.DELETING, S.DELETED}),
    DesiredState.SUSPENDED: frozenset({S.DELETING, S.DELETED}),
    DesiredState.DELETED: frozenset(),
}

_VERB = {
    DesiredState.RUNNING: "resume",
    DesiredState.SUSPENDED: "suspend",
    DesiredState.DELETED: "delete",
}


def check_transition(current: WorkspaceState, new: WorkspaceState) -> None:
    if new not in TRANSITIONS[current]:
        raise Conflict(
            f"workspace cannot go from {current} to {new}",
            current_state=str(current),
        )


def check_request(current: WorkspaceState, desired: DesiredState,
                  requested: DesiredState | None = None) -> None:
    """Raise 409 when the API may not ask for ``desired`` in ``current``, with
    ``requested`` the desired state already recorded. A delete is final from the
    moment it is asked for, not only once the reconciler has begun it: otherwise
    a resume arriving before the reconciler's next pass would undo the delete."""
    deleting = requested is DesiredState.DELETED and desired is not DesiredState.DELETED
    if current in _REFUSED_BY[desired] or deleting:
        raise Conflict(
            f"cannot {_VERB[desired]} a workspace that is "
            f"{'being deleted' if deleting else current}",
            current_state=str(current),
        )


def is_settled(current: WorkspaceState, desired: DesiredState) -> bool:
    return SETTLED[desired] == current


class Action(StrEnum):
    PLACE = "place"  # get a runtime on a host, files materialized, kernels started
    RELEASE = "release"  # sync files back, stop kernels, free the host
    DESTROY = "destroy"  # release, then delete the workspace's blobs


@dataclass(frozen=True, slots=True)
class Step:
    """Enter ``enter`` (if set), perform ``action``, then settle in ``done``."""

    action: Action
    done: WorkspaceState
    enter: WorkspaceState | None = None


def plan(current: WorkspaceState, desired: DesiredState) -> Step | None:
    """The next step that moves ``current`` towards ``desired``; None once settled."""
    if desired is DesiredState.DELETED:
        if current is S.DELETED:
            return None
        enter = None if current is S.DELETING else S.DELETING
        return Step(Action.DESTROY, S.DELETED, enter)
    if current in (S.DELETING, S.DELETED):
        return None  # delete wins; the API refuses other requests by now
    if desired is DesiredState.SUSPENDED or current is S.SUSPENDING:
        # A suspension in flight is finished before any resume, so files are synced.
        if current is S.SUSPENDED:
            return None
        enter = None if current is S.SUSPENDING else S.SUSPENDING
        return Step(Action.RELEASE, S.SUSPENDED, enter)
    # desired is RUNNING
    if current is S.RUNNING:
        return None
    if current in (S.CREATING, S.RESUMING):
        return Step(Action.PLACE, S.RUNNING)
    return Step(Action.PLACE, S.RUNNING, S.RESUMING)  # suspended or failed


def retry_delay_s(attempts: int, base_s: float = 1.0, cap_s: float = 300.0) -> float:
    """Exponential backoff for a failed step (jitter is added by the caller)."""
    return float(min(cap_s, base_s * 2 ** min(max(0, attempts - 1), 64)))
