"""The binary registry and safe rollouts: stable, canary, automatic rollback.

Per binary name, one version is ``stable`` and at most one is ``canary``. An
unpinned job goes to the canary when ``model.jobs.routes_to_canary`` says so (a
stable hash of its id against ``canary_percent``), otherwise to stable. Each ended
attempt of a canary counts towards its failure rate, binary failures apart from
infrastructure ones; past the threshold the canary is rolled back: it stops
taking new jobs, and the unpinned jobs queued on it (whether they ran before or
not) move to the stable version. Jobs pinned to a version keep it, rolled back or
not. What a canary's failure costs the job it failed is ``model.jobs.charge``'s
rule; ``jobs.attempts.end`` applies it with ``states`` and ``move_to``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.db.ids import new_id
from nbfleet.db.job_tables import BinaryVersion, Job
from nbfleet.db.queries import among
from nbfleet.jobs.events import transition
from nbfleet.model.errors import Conflict, InvalidInput, NotFound
from nbfleet.model.jobs import (
    Blame,
    CanaryRule,
    JobState,
    VersionState,
    input_fingerprint,
    routes_to_canary,
    should_roll_back,
)
from nbfleet.web.render import iso

STABLE = VersionState.STABLE
CANARY = VersionState.CANARY
ROLLED_BACK = VersionState.ROLLED_BACK
RETIRED = VersionState.RETIRED

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,49}$")


def view(row: BinaryVersion) -> dict[str, Any]:
    failure_rate = row.binary_failures / row.attempts if row.attempts else None
    return {"id": row.id, "name": row.name, "version": row.version, "command": row.command,
            "state": row.state, "canary_percent": row.canary_percent,
            "failure_threshold": row.failure_threshold, "min_samples": row.min_samples,
            "attempts": row.attempts, "binary_failures": row.binary_failures,
            "infra_failures": row.infra_failures, "failure_rate": failure_rate,
            "reason": row.reason, "created_at": iso(row.created_at),
            "updated_at": iso(row.updated_at)}


def _versions(session: Session, name: str, for_update: bool = False) -> list[BinaryVersion]:
    query = select(BinaryVersion).where(BinaryVersion.name == name).order_by(BinaryVersion.id)
    if for_update:
        query = query.with_for_update()
    return list(session.execute(query).scalars())


def versions(session: Session, name: str | None = None) -> list[BinaryVersion]:
    query = select(BinaryVersion).order_by(BinaryVersion.name, BinaryVersion.id)
    if name is not None:
        query = query.where(BinaryVersion.name == name)
    return list(session.execute(query).scalars())


def register(session: Session, name: str, version: str, command: list[str],
             canary_percent: int, rule: CanaryRule, now: datetime) -> BinaryVersion:
    """Add a version. The first version of a name is stable; a later one is a
    canary taking ``canary_percent`` of new jobs (0: registered, not routed yet)."""
    if not _NAME.match(name):
        raise InvalidInput(f"invalid binary name {name!r}: lower-case letters, digits, "
                           "'.', '_' or '-'", field="name")
    if not _VERSION.match(version):
        raise InvalidInput(f"invalid version {version!r}", field="version")
    if not command or any(not part or "\x00" in part for part in command):
        raise InvalidInput("command must be a non-empty list of non-empty strings",
                           field="command")
    if not 0 <= canary_percent <= 100:
        raise InvalidInput("canary_percent must be between 0 and 100", field="canary_percent")
    existing = _versions(session, name, for_update=True)
    if any(row.version == version for row in existing):
        raise Conflict(f"binary {name} {version} is already registered")
    live_canary = [row for row in existing if row.state == CANARY]
    if live_canary:
        raise Conflict(f"binary {name} already has a canary ({live_canary[0].version}); "
                       "promote or roll it back first")
    state = STABLE if not any(row.state == STABLE for row in existing) else CANARY
    row = BinaryVersion(id=new_id("bin"), name=name, version=version, command=list(command),
                        state=state, canary_percent=canary_percent if state == CANARY else 0,
                        failure_threshold=rule.failure_threshold, min_samples=rule.min_samples,
                        attempts=0, binary_failures=0, infra_failures=0, reason=None,
                        created_at=now, updated_at=now)
    session.add(row)
    session.flush()
    return row


def get(session: Session, name: str, version: str, for_update: bool = False) -> BinaryVersion:
    query = select(BinaryVersion).where(BinaryVersion.name == name,
                                        BinaryVersion.version == version)
    if for_update:
        query = query.with_for_update()
    row = session.execute(query).scalar_one_or_none()
    if row is None:
        raise NotFound(f"no binary {name} version {version}")
    return row


def versions_of(session: Session, names: Collection[str]) -> dict[str, list[BinaryVersion]]:
    """Every version of each name, in registration order (one query for a batch)."""
    found: dict[str, list[BinaryVersion]] = {name: [] for name in names}
    query = select(BinaryVersion).where(among(session, BinaryVersion.name, sorted(names)))
    for row in session.execute(query.order_by(BinaryVersion.name, BinaryVersion.id)).scalars():
        found[row.name].append(row)
    return found


def choose(rows: Sequence[BinaryVersion], name: str, version: str | None,
           job_id: str) -> BinaryVersion:
    """Among a name's versions, the one a new job runs (raises if there is none)."""
    if version is not None:
        row = next((r for r in rows if r.version == version), None)
        if row is None:
            raise NotFound(f"no binary {name} version {version}")
        if row.state == RETIRED:
            raise InvalidInput(f"binary {name} {version} is retired", field="version")
        return row
    if not rows:
        raise NotFound(f"no binary named {name}")
    stable = next((r for r in rows if r.state == STABLE), None)
    canary = next((r for r in rows if r.state == CANARY), None)
    if canary is not None and (stable is None or routes_to_canary(job_id, canary.canary_percent)):
        return canary
    if stable is None:
        raise NotFound(f"binary {name} has no stable version")
    return stable


def set_canary_percent(session: Session, name: str, version: str, percent: int,
                       now: datetime) -> BinaryVersion:
    if not 0 <= percent <= 100:
        raise InvalidInput("canary_percent must be between 0 and 100", field="canary_percent")
    row = get(session, name, version, for_update=True)
    if row.state != CANARY:
        raise Conflict(f"{name} {version} is {row.state}, not a canary")
    row.canary_percent = percent
    row.updated_at = now
    return row


def promote(session: Session, name: str, version: str, now: datetime) -> BinaryVersion:
    """Make a version stable; the old stable version is retired from routing
    (pinned jobs may still name it)."""
    rows = _versions(session, name, for_update=True)
    target = next((r for r in rows if r.version == version), None)
    if target is None:
        raise NotFound(f"no binary {name} version {version}")
    for row in rows:
        if row.state == STABLE and row is not target:
            row.state = RETIRED
            row.updated_at = now
    target.state = STABLE
    target.canary_percent = 0
    target.reason = None
    target.updated_at = now
    return target


def roll_back(session: Session, row: BinaryVersion, reason: str, now: datetime) -> int:
    """Stop routing to a canary and move its queued unpinned jobs to stable, each
    with an event row; returns how many moved. The caller holds the version row's
    lock.

    Every queued one moves, not only those that never ran: a job waiting for its
    retry after an infrastructure failure or a preemption must not run a version
    that was rolled back. Idempotent: rolling back a version already rolled back
    (a retried request, an admin after the automatic rollback) keeps its state and
    first reason, and moves only what is still queued on it (nothing, but for a
    job that raced the first rollback).
    """
    if row.state not in (CANARY, ROLLED_BACK):
        raise Conflict(f"{row.name} {row.version} is {row.state}, not a canary")
    if row.state == CANARY:
        row.state = ROLLED_BACK
        row.canary_percent = 0
        row.reason = reason
        row.updated_at = now
    stable = next((r for r in versions(session, row.name) if r.state == STABLE), None)
    if stable is None:
        return 0
    # SKIP LOCKED: a job another transaction holds (a cancel, which then waits for
    # the ledger this transaction may hold) is not waited for under the version's
    # lock; the dispatcher moves it when it claims it (``leave_rolled_back``).
    queued = session.execute(
        select(Job).where(Job.binary == row.name, Job.version == row.version,
                          Job.pinned.is_(False), Job.state == JobState.QUEUED)
        .order_by(Job.id).with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    ).scalars().all()
    for job in queued:
        _fall_back(session, job, row.version, stable.version, now)
    return len(queued)


def _fall_back(session: Session, job: Job, old: str, stable: str, now: datetime) -> None:
    move_to(job, stable, now)
    transition(session, job, JobState.QUEUED, now,
               f"moved to {job.binary} {stable}: {old} was rolled back")


def leave_rolled_back(session: Session, job: Job, rollout: dict[str, str],
                      now: datetime) -> None:
    """An unpinned queued job on a rolled-back version moves to stable before it
    starts (one a rollback's sweep skipped, or that raced it)."""
    stable = stable_version(rollout)
    if not job.pinned and rollout.get(job.version) == ROLLED_BACK and stable is not None:
        _fall_back(session, job, job.version, stable, now)


def states_of(session: Session, names: Collection[str]) -> dict[str, dict[str, str]]:
    """Each version of each name and its rollout state. Columns, not rows: a later
    locked read of a version (``record_attempt``) must not find a stale copy in
    the session."""
    found: dict[str, dict[str, str]] = {name: {} for name in names}
    for name, version, state in session.execute(
            select(BinaryVersion.name, BinaryVersion.version, BinaryVersion.state)
            .where(among(session, BinaryVersion.name, sorted(names)))):
        found[name][version] = state
    return found


def states(session: Session, name: str) -> dict[str, str]:
    return states_of(session, [name])[name]


def stable_version(rollout: dict[str, str]) -> str | None:
    return next((version for version, state in rollout.items() if state == STABLE), None)


def move_to(job: Job, version: str, now: datetime) -> None:
    """Run an unpinned job's next attempt on ``version``. Its input's fingerprint
    names the version, so the quarantine records the version that failed it."""
    job.version = version
    job.fingerprint = input_fingerprint(job.project_id, job.binary, version, job.args)
    job.updated_at = now


def record_attempt(session: Session, name: str, version: str, blame: Blame,
                   now: datetime) -> str | None:
    """Count one ended attempt against its version; roll a failing canary back.

    Returns the rollback reason when this attempt tipped it over.
    """
    row = get(session, name, version, for_update=True)
    if blame == Blame.INFRA:
        row.infra_failures += 1
    else:
        row.attempts += 1
        row.binary_failures += blame == Blame.BINARY
    row.updated_at = now
    rule = CanaryRule(row.failure_threshold, row.min_samples)
    if row.state == CANARY and blame != Blame.INFRA and should_roll_back(
            rule, row.attempts, row.binary_failures):
        reason = (f"rolled back automatically: {row.binary_failures} of {row.attempts} "
                  f"attempts failed (threshold {row.failure_threshold:.0%})")
        roll_back(session, row, reason, now)
        return reason
    return None
