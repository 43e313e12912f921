"""Orgs, projects and users, and the first admin of a fresh installation."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import quotas
from nbfleet.control.auth import hash_token, new_token
from nbfleet.db.engine import Database
from nbfleet.db.ids import new_id
from nbfleet.db.tables import ApiToken, Org, Project, User
from nbfleet.model.errors import Conflict, InvalidInput, NotFound
from nbfleet.model.limits import Limits
from nbfleet.model.quotas import check_override

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
ADMIN_ORG = "system"


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise InvalidInput(
            f"invalid {kind} name {name!r}: use 1-63 letters, digits, '.', '_' or '-'",
            field=kind,
        )
    return name


@dataclass(frozen=True, slots=True)
class CreatedUser:
    user_id: str
    org: str
    project: str
    token: str


def _org(session: Session, name: str, now: datetime) -> Org:
    org = session.execute(select(Org).where(Org.name == name)).scalar_one_or_none()
    if org is None:
        org = Org(id=new_id("org"), name=name, created_at=now)
        session.add(org)
        session.flush()
    return org


def _project(session: Session, org: Org, name: str, now: datetime) -> Project:
    project = session.execute(
        select(Project).where(Project.org_id == org.id, Project.name == name)
    ).scalar_one_or_none()
    if project is None:
        project = Project(id=new_id("prj"), org_id=org.id, name=name, created_at=now)
        session.add(project)
        session.flush()
    return project


def create_user(db: Database, name: str, org_name: str, project_name: str,
                is_admin: bool = False, token: str | None = None) -> CreatedUser:
    for kind, value in (("user", name), ("org", org_name), ("project", project_name)):
        check_name(kind, value)
    token = token or new_token()
    with db.transaction() as session:
        now = db.now(session)
        org = _org(session, org_name, now)
        project = _project(session, org, project_name, now)
        exists = session.execute(
            select(User.id).where(User.org_id == org.id, User.name == name)
        ).first()
        if exists:
            raise Conflict(f"user {name!r} already exists in org {org_name!r}")
        user = User(id=new_id("usr"), org_id=org.id, project_id=project.id, name=name,
                    is_admin=is_admin, created_at=now)
        session.add(user)
        session.flush()
        session.add(ApiToken(id=new_id("tok"), user_id=user.id, token_hash=hash_token(token),
                             created_at=now))
    return CreatedUser(user.id, org_name, project_name, token)


def ensure_admin(db: Database, token_path: str) -> str:
    """Return the admin token kept in ``token_path`` (mode 0600), creating it if needed."""
    if os.path.exists(token_path):
        with open(token_path) as handle:
            token = handle.read().strip()
        with db.transaction(write=False) as session:
            known = session.execute(
                select(ApiToken.id).where(ApiToken.token_hash == hash_token(token))
            ).first()
        if known:
            return token
    token = new_token()
    with db.transaction(write=False) as session:
        admins = session.execute(select(User).where(User.is_admin.is_(True))).scalars().all()
    name = "admin" if not admins else f"admin-{len(admins) + 1}"
    create_user(db, name, ADMIN_ORG, "default", is_admin=True, token=token)
    write_secret(token_path, token)
    return token


def write_secret(path: str, value: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    os.chmod(path, 0o600)


def _locked_project(session: Session, org_name: str, project_name: str) -> Project:
    project = session.execute(
        select(Project).join(Org, Org.id == Project.org_id)
        .where(Org.name == org_name, Project.name == project_name)
        .with_for_update()
    ).scalar_one_or_none()
    if project is None:
        raise NotFound(f"project {org_name}/{project_name} not found")
    return project


def set_project_settings(db: Database, org_name: str, project_name: str,
                         idle_suspend_s: int | None, limits: Limits,
                         network: str | None = None,
                         default_resources: dict[str, Any] | None = None,
                         check: Callable[[Session], None] | None = None) -> None:
    """A project's own idle-suspend timeout (None: the platform default, 0: never),
    kernel limits (each None field: the platform default), network mode and the
    resource request of workspaces created without one (None: nothing asked).
    ``check`` vets the settings once the project is known to exist (so an unknown
    project is 404 before any setting is judged) and raises to refuse them."""
    with db.transaction() as session:
        project = _locked_project(session, org_name, project_name)
        if check is not None:
            check(session)
        project.idle_suspend_s = idle_suspend_s
        project.kernel_limits = limits.as_dict() if limits != Limits() else None
        project.kernel_network = network if network == "egress" else None
        project.default_resources = default_resources


def set_job_settings(db: Database, org_name: str, project_name: str, weight: float,
                     guarantee_gpus: int, max_running: int | None, max_queued: int | None,
                     tiers: list[str] | None = None) -> None:
    """A project's fair-share weight, preemption guarantee, job quotas and the
    tiers it may use (None: all)."""
    with db.transaction() as session:
        project = _locked_project(session, org_name, project_name)
        project.job_weight, project.job_guarantee_gpus = weight, guarantee_gpus
        project.job_max_running, project.job_max_queued = max_running, max_queued
        project.job_tiers = tiers


def set_project_quota(db: Database, org_name: str, project_name: str,
                      totals: dict[str, Any] | None, per_user: dict[str, Any] | None
                      ) -> None:
    """A project's workspace quota totals and the quota of each of its users (each
    a stored override, ``model.quotas.check_override``; None: the defaults)."""
    totals, per_user = check_override(totals), check_override(per_user)
    with db.transaction() as session:
        project = _locked_project(session, org_name, project_name)
        project.quota, project.user_quota = totals, per_user


def _user_in(session: Session, org_name: str, user_name: str, lock: bool = False
             ) -> tuple[Project, User]:
    query = (select(User).join(Org, Org.id == User.org_id)
             .where(Org.name == org_name, User.name == user_name))
    user = session.execute(query.with_for_update(of=User) if lock else query
                           ).scalar_one_or_none()
    if user is None:
        raise NotFound(f"user {org_name}/{user_name} not found")
    return session.get_one(Project, user.project_id), user


def set_user_quota(db: Database, org_name: str, user_name: str,
                   override: dict[str, Any] | None) -> None:
    """One user's own workspace quota (None: the project's per-user quota)."""
    override = check_override(override)
    with db.transaction() as session:
        _, user = _user_in(session, org_name, user_name, lock=True)
        user.quota = override


def user_quota(db: Database, org_name: str, user_name: str) -> dict[str, Any]:
    """A user's stored override, effective limits and usage, with its project's."""
    with db.transaction(write=False) as session:
        project, user = _user_in(session, org_name, user_name)
        return {"org": org_name, "user": user_name, "set": user.quota,
                **quotas.report(session, project, user)}


def project_quota(db: Database, org_name: str, project_name: str) -> dict[str, Any]:
    """A project's stored overrides and effective limits, and what it holds."""
    with db.transaction(write=False) as session:
        project = session.execute(
            select(Project).join(Org, Org.id == Project.org_id)
            .where(Org.name == org_name, Project.name == project_name)).scalar_one_or_none()
        if project is None:
            raise NotFound(f"project {org_name}/{project_name} not found")
        figures = quotas.project_report(session, project)
        return {"org": org_name, "project": project_name, "set": {
            "project": project.quota, "per_user": project.user_quota}, **figures}
