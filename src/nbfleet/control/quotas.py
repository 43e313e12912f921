"""Workspace quota admission on the metadata DB (the rules are ``model.quotas``).

Why here and like this: a quota checked in one transaction and acted on in
another lets 50 concurrent creates all see room for one more. So the count and
the insert (or the desired-state change) share one transaction, and the rows the
count is about are locked first, in one order everywhere:

    the workspace row (a resume or a kernel start: the caller locked it), then the
    project row (only when the project has totals set), then the user row.

No other transaction locks a user row, and ``tenancy`` locks only the project
row, so this order never deadlocks with them; the ledger and jobs lock none of
these rows (their inserts take key-share locks on them, which the admission's
``FOR NO KEY UPDATE`` leaves alone). On SQLite every writer holds the database's write lock (``BEGIN
IMMEDIATE``), which serialises the same way. Locking the user row (not the
project's) by default keeps different users' creates in parallel: only a project
whose admin set totals serialises its creates on the project row.

Counts read only the owner's rows (``ix_workspaces_owner``) or the project's
(``ix_workspaces_tenant``, and only when the project has totals), never all
workspaces. A workspace counts as soon as it is asked to exist or run, not when a
host took it: what the quota bounds is what a user can make the fleet reserve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from nbfleet.db.tables import Kernel, Org, Project, User, Workspace
from nbfleet.model.errors import NotFound
from nbfleet.model.quotas import (
    DEFAULT_PROJECT_QUOTA,
    DEFAULT_USER_QUOTA,
    Field,
    Quota,
    Scope,
    Usage,
    first_excess,
    refusal,
)
from nbfleet.model.workspace import DesiredState


@dataclass(frozen=True, slots=True)
class Quotas:
    """A user's effective limits and its project's totals."""

    user: Quota
    project: Quota


def effective(project: Project, user: User) -> Quotas:
    """The nearest set value wins: the user's, the project's per-user, the default."""
    return Quotas(user=DEFAULT_USER_QUOTA.over(project.user_quota).over(user.quota),
                  project=DEFAULT_PROJECT_QUOTA.over(project.quota))


def _locked(session: Session, project_id: str, user_id: str) -> tuple[Project, User]:
    """The project and user rows, locked in the lock order (the project only when
    its totals need counting). Read again on lock: another transaction may have
    changed them while this one waited. ``FOR NO KEY UPDATE`` on PostgreSQL: it
    serialises admissions (and an admin's quota change, ``FOR UPDATE``) but not the
    key-share locks that inserts referencing these rows take (a job, a token, a
    workspace), which a plain ``FOR UPDATE`` would wait on and could deadlock with."""
    project = session.get(Project, project_id)
    if project is None:
        raise NotFound(f"project {project_id} not found")
    if DEFAULT_PROJECT_QUOTA.over(project.quota).limits_anything():
        project = session.execute(
            select(Project).where(Project.id == project_id).with_for_update(key_share=True)
            .execution_options(populate_existing=True)).scalar_one()
    user = session.execute(
        select(User).where(User.id == user_id).with_for_update(key_share=True)
        .execution_options(populate_existing=True)).scalar_one_or_none()
    if user is None:
        raise NotFound(f"user {user_id} not found")
    return project, user


def _gpus(session: Session, *where: Any) -> int:
    """GPUs asked for by the running workspaces matching ``where`` (their resource
    requests are JSON, summed here: the rows are one user's, bounded by its quota,
    or a project's only when its GPU total is set)."""
    return sum(int((resources or {}).get("gpus", 0)) for resources in session.execute(
        select(Workspace.resources).where(
            Workspace.desired_state == DesiredState.RUNNING, *where)).scalars())


def _usage(session: Session, quota: Quota, *where: Any) -> Usage:
    """What the workspaces matching ``where`` hold, counting only what ``quota``
    limits (a GPU sum only where GPUs are limited)."""
    rows: dict[str, int] = {str(state): int(n) for state, n in session.execute(
        select(Workspace.desired_state, func.count())
        .where(Workspace.desired_state != DesiredState.DELETED, *where)
        .group_by(Workspace.desired_state))}
    return Usage(workspaces=sum(rows.values()), running=rows.get(DesiredState.RUNNING, 0),
                 gpus=_gpus(session, *where) if quota.gpus is not None else 0)


def user_usage(session: Session, user_id: str, quota: Quota) -> Usage:
    return _usage(session, quota, Workspace.owner_id == user_id)


def project_usage(session: Session, project: Project, quota: Quota) -> Usage:
    return _usage(session, quota, Workspace.org_id == project.org_id,
                  Workspace.project_id == project.id)


def _raise_with(session: Session, project: Project, user: User, scope: Scope) -> str:
    """Where an admin raises the limit (only read on a refusal)."""
    org = session.execute(select(Org.name).where(Org.id == project.org_id)).scalar_one()
    if scope == "user":
        return (f"PUT /v1/admin/orgs/{org}/users/{user.name}/quota, or `nbfleet admin "
                f"quota --org {org} --user {user.name} ...`")
    return (f"PUT /v1/admin/orgs/{org}/projects/{project.name}/quota, or `nbfleet admin "
            f"quota --org {org} --project {project.name} ...`")


def _judge(session: Session, project: Project, user: User, scope: Scope, quota: Quota,
           usage: Usage, adding: Mapping[Field, int]) -> None:
    excess = first_excess(quota, usage, adding)
    if excess is not None:
        raise refusal(scope, *excess, raise_with=_raise_with(session, project, user, scope))


def _admit(session: Session, project_id: str, user_id: str,
           adding: Mapping[Field, int]) -> None:
    project, user = _locked(session, project_id, user_id)
    quotas = effective(project, user)
    if quotas.user.limits_anything():
        _judge(session, project, user, "user", quotas.user,
               user_usage(session, user.id, quotas.user), adding)
    if quotas.project.limits_anything():
        _judge(session, project, user, "project", quotas.project,
               project_usage(session, project, quotas.project), adding)


def admit_new_workspace(session: Session, project_id: str, user_id: str, gpus: int) -> None:
    """Refuse (403) a new workspace over the owner's or the project's quota. Call in
    the transaction that inserts it, before the insert."""
    _admit(session, project_id, user_id, {"workspaces": 1, "running": 1, "gpus": gpus})


def admit_running(session: Session, ws: Workspace) -> None:
    """Refuse (403) asking ``ws`` (locked by the caller) to run again over its
    owner's or project's running or GPU quota: a resume counts as a new runtime."""
    gpus = int((ws.resources or {}).get("gpus", 0))
    _admit(session, ws.project_id, ws.owner_id, {"running": 1, "gpus": gpus})


def admit_kernel(session: Session, ws: Workspace) -> None:
    """Refuse (403) one more kernel in ``ws`` (locked by the caller, which
    serialises its kernel starts) over the per-workspace kernel limit of its
    owner or its project."""
    project = session.get(Project, ws.project_id)
    user = session.get(User, ws.owner_id)
    if project is None or user is None:
        raise NotFound(f"workspace {ws.id} not found")
    quotas = effective(project, user)
    count = session.execute(select(func.count()).select_from(Kernel)
                            .where(Kernel.workspace_id == ws.id)).scalar_one()
    usage = Usage(kernels_per_workspace=int(count))
    _judge(session, project, user, "user", quotas.user, usage, {"kernels_per_workspace": 1})
    _judge(session, project, user, "project", quotas.project, usage,
           {"kernels_per_workspace": 1})


def report(session: Session, project: Project, user: User) -> dict[str, Any]:
    """Limits and usage, as the API, the CLI and the dashboard show them. The
    project's usage is counted only where it has totals (null otherwise): the
    dashboard's home page shows this, and must not count a big project's rows for
    nothing."""
    quotas = effective(project, user)
    everything = Quota(0, 0, 0, 0)  # count every figure, limited or not
    mine = user_usage(session, user.id, everything)
    ours = (_figures(quotas.project, project_usage(session, project, everything))
            if quotas.project.limits_anything()
            else {"limits": quotas.project.as_dict(), "usage": None})
    return {"user": _figures(quotas.user, mine), "project": ours}


def project_report(session: Session, project: Project) -> dict[str, Any]:
    """A project's totals and usage, and the per-user limits its users get (before
    any user's own override)."""
    everything = Quota(0, 0, 0, 0)
    return {"project": _figures(DEFAULT_PROJECT_QUOTA.over(project.quota),
                                project_usage(session, project, everything)),
            "per_user": {"limits": DEFAULT_USER_QUOTA.over(project.user_quota).as_dict()}}


def _figures(quota: Quota, usage: Usage) -> dict[str, Any]:
    shown: tuple[Field, ...] = ("workspaces", "running", "gpus")
    return {"limits": quota.as_dict(), "usage": {name: usage.count(name) for name in shown}}
