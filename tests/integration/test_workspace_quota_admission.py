"""Workspace quotas on the metadata DB: the measured failure (one user creating
workspaces without limit), concurrent creates and kernel starts that must not pass
a quota, idempotent retries that count once, and resumes that count as running.
Real threads, each with its own transactions; they matter most on PostgreSQL
(SQLite serialises its writers), and run on both (``NBFLEET_TEST_PG``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest
from sqlalchemy import func, select, text

from nbfleet.control import kernels, tenancy, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.idempotency import run_idempotent
from nbfleet.control.platform import Platform
from nbfleet.db.engine import Database
from nbfleet.db.ids import new_id
from nbfleet.db.tables import ApiToken, Kernel, User, Workspace
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.errors import InvalidInput
from nbfleet.model.quotas import DEFAULT_USER_QUOTA, QuotaExceeded
from nbfleet.model.workspace import DesiredState, WorkspaceState
from tests.conftest import PG_ADMIN_URL

CONCURRENT = 50


def together(count: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` on ``count`` threads released at once; results or exceptions."""
    barrier = threading.Barrier(count)

    def run(index: int) -> Any:
        barrier.wait()
        try:
            return work(index)
        except Exception as error:
            return error

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def new_user(db: Database, org: str | None = None, project: str = "p") -> tuple[str, Principal]:
    org = org or f"q-{uuid.uuid4().hex[:8]}"
    created = tenancy.create_user(db, f"u{uuid.uuid4().hex[:6]}", org, project)
    with db.transaction(write=False) as session:
        user = session.get_one(User, created.user_id)
        return org, Principal(user.id, user.org_id, user.project_id)


def user_name(db: Database, principal: Principal) -> str:
    with db.transaction(write=False) as session:
        return session.get_one(User, principal.user_id).name


def create(db: Database, principal: Principal, gpus: int = 0) -> str:
    with db.transaction() as session:
        ws = workspaces.create(session, principal, "w", db.now(session), ResourceSpec(gpus=gpus))
        session.flush()
        return ws.id


def count(db: Database, principal: Principal, desired: DesiredState | None = None) -> int:
    query = select(func.count()).select_from(Workspace).where(
        Workspace.owner_id == principal.user_id)
    if desired is not None:
        query = query.where(Workspace.desired_state == desired)
    with db.transaction(write=False) as session:
        return int(session.execute(query).scalar_one())


def suspended(db: Database, workspace_id: str) -> None:
    """As if the reconciler had suspended it (the state machine is not under test)."""
    with db.transaction() as session:
        ws = session.get_one(Workspace, workspace_id)
        ws.state, ws.desired_state, ws.pending = (WorkspaceState.SUSPENDED,
                                                  DesiredState.SUSPENDED, False)


def resume(db: Database, principal: Principal, workspace_id: str) -> None:
    with db.transaction() as session:
        ws = workspaces.get_visible(session, principal, workspace_id, for_update=True)
        workspaces.request_state(ws, DesiredState.RUNNING, db.now(session))


def refusals(outcomes: list[Any]) -> list[QuotaExceeded]:
    unexpected = [o for o in outcomes if isinstance(o, Exception)
                  and not isinstance(o, QuotaExceeded)]
    assert not unexpected, unexpected
    return [o for o in outcomes if isinstance(o, QuotaExceeded)]


def test_one_user_cannot_create_workspaces_without_limit(db: Database) -> None:
    """The measured failure: a script created 26 workspaces, each reserving its
    disk. With the defaults the 11th create while 10 run is refused, naming the
    limit, its value, the count and how to raise it; with those suspended, the
    21st workspace is."""
    org, me = new_user(db)
    made, refused = [], []
    for _ in range(26):
        try:
            made.append(create(db, me))
        except QuotaExceeded as exc:
            refused.append(exc)
    assert len(made) == DEFAULT_USER_QUOTA.running == 10 and len(refused) == 16
    problem = refused[0]
    assert problem.status == 403 and problem.title == "Quota exceeded"
    assert problem.extra == {"reason": "quota_exceeded", "scope": "user", "quota": "running",
                             "limit": 10, "current": 10, "requested": 1}
    assert "limit is 10 running workspaces" in problem.detail
    assert f"PUT /v1/admin/orgs/{org}/users/{user_name(db, me)}/quota" in problem.detail
    for ws in made:
        suspended(db, ws)
    for _ in range(10):
        made.append(create(db, me))
    with pytest.raises(QuotaExceeded) as over:
        create(db, me)
    assert over.value.extra["quota"] == "workspaces"
    assert over.value.extra["limit"] == 20 and over.value.extra["current"] == 20
    assert count(db, me) == 20


def test_concurrent_creates_by_one_user_stay_within_the_quota(db: Database) -> None:
    _, me = new_user(db)
    outcomes = together(CONCURRENT, lambda _: create(db, me))
    assert len(refusals(outcomes)) == CONCURRENT - DEFAULT_USER_QUOTA.running
    assert count(db, me) == DEFAULT_USER_QUOTA.running


def test_concurrent_creates_in_a_project_stay_within_its_totals(db: Database) -> None:
    """Ten users of one project whose admin capped its running workspaces at 7
    (the project row is locked); each user's own default (10) would allow more."""
    org, first = new_user(db)
    users = [first] + [new_user(db, org=org)[1] for _ in range(9)]
    tenancy.set_project_quota(db, org, "p", {"running": 7}, None)
    outcomes = together(CONCURRENT, lambda i: create(db, users[i % len(users)]))
    refused = refusals(outcomes)
    assert len(refused) == CONCURRENT - 7
    assert {exc.extra["scope"] for exc in refused} == {"project"}
    assert sum(count(db, user) for user in users) == 7


def test_gpus_are_counted_per_project(db: Database) -> None:
    org, me = new_user(db)
    tenancy.set_project_quota(db, org, "p", {"gpus": 3}, None)
    create(db, me, gpus=2)
    with pytest.raises(QuotaExceeded) as over:
        create(db, me, gpus=2)
    assert (over.value.extra["quota"], over.value.extra["current"]) == ("gpus", 2)
    create(db, me, gpus=1)
    create(db, me, gpus=0)  # asks none: a full GPU quota refuses only GPUs


def test_an_idempotent_retry_counts_once(db: Database) -> None:
    """Three concurrent sends of one key and one more later make one workspace:
    with a quota of 2, a second key still fits and a third is refused."""
    org, me = new_user(db)
    tenancy.set_user_quota(db, org, user_name(db, me), {"workspaces": 2})

    def action(session: Any) -> tuple[int, dict[str, Any]]:
        ws = workspaces.create(session, me, "w", db.now(session))
        session.flush()
        return 201, {"id": ws.id}

    def send(key: str) -> tuple[tuple[int, dict[str, Any]], bool]:
        return run_idempotent(db, me.user_id, key, "same-request", action)

    outcomes = together(3, lambda _: send("k1"))
    done = [o for o in outcomes if not isinstance(o, Exception)]
    assert done and all(o[0] == done[0][0] for o in done)  # the others got 409 in progress
    assert send("k1") == (done[0][0], True)  # replayed, not run again
    assert count(db, me) == 1
    assert send("k2")[0][0] == 201
    with pytest.raises(QuotaExceeded):
        send("k3")
    assert count(db, me) == 2


def test_a_resume_counts_against_running(db: Database) -> None:
    org, me = new_user(db)
    tenancy.set_user_quota(db, org, user_name(db, me), {"running": 2})
    first, _ = create(db, me), create(db, me)
    suspended(db, first)
    third = create(db, me)  # first's place is free while it is suspended
    with pytest.raises(QuotaExceeded) as over:
        resume(db, me, first)
    assert over.value.extra["quota"] == "running" and over.value.extra["current"] == 2
    suspended(db, third)
    resumes = together(8, lambda _: resume(db, me, first))  # one place: repeats are no-ops
    assert not [o for o in resumes if isinstance(o, Exception)]
    assert count(db, me, DesiredState.RUNNING) == 2
    with pytest.raises(QuotaExceeded):
        resume(db, me, third)


def test_concurrent_kernel_starts_stay_within_the_workspace_limit(db: Database) -> None:
    org, me = new_user(db)
    tenancy.set_project_quota(db, org, "p", None, {"kernels_per_workspace": 3})
    ws = create(db, me)
    platform = cast(Platform, SimpleNamespace(db=db))
    outcomes = together(20, lambda _: kernels._insert_kernel(
        platform, ws, str(uuid.uuid4()), "python3"))
    refused = refusals(outcomes)
    assert len(refused) == 17
    assert refused[0].extra["quota"] == "kernels_per_workspace"
    assert refused[0].extra["limit"] == 3
    with db.transaction(write=False) as session:
        assert session.execute(select(func.count()).select_from(Kernel)).scalar_one() == 3


def test_admins_set_and_read_quotas(db: Database) -> None:
    org, me = new_user(db)
    name = user_name(db, me)
    tenancy.set_project_quota(db, org, "p", {"gpus": 8}, {"workspaces": 5, "running": 1})
    tenancy.set_user_quota(db, org, name, {"running": "unlimited"})
    create(db, me)
    create(db, me)  # the user's own "unlimited" wins over the project's 1
    shown = tenancy.user_quota(db, org, name)
    assert shown["user"]["limits"] == {"workspaces": 5, "running": None,
                                       "kernels_per_workspace": 8, "gpus": None}
    assert shown["user"]["usage"] == {"workspaces": 2, "running": 2, "gpus": 0}
    assert shown["project"]["limits"]["gpus"] == 8
    project = tenancy.project_quota(db, org, "p")
    assert project["set"] == {"project": {"gpus": 8},
                              "per_user": {"workspaces": 5, "running": 1}}
    assert project["project"]["usage"]["workspaces"] == 2
    with pytest.raises(InvalidInput, match="quota running must be 0 to"):
        tenancy.set_user_quota(db, org, name, {"running": -1})
    with pytest.raises(InvalidInput, match="unknown quota"):
        tenancy.set_user_quota(db, org, name, {"disks": 1})


@pytest.mark.skipif(not PG_ADMIN_URL, reason="PostgreSQL's row locks (SQLite has one writer)")
def test_admission_does_not_wait_on_inserts_that_reference_the_user(db: Database) -> None:
    """An open transaction that inserted a row referencing the user (a token here;
    a job or a credit hold alike) holds a key-share lock on the user's row. The
    admission's lock must not wait for it (``FOR UPDATE`` would, and could then
    deadlock): the create runs with a lock timeout while that transaction is open."""
    org, me = new_user(db)
    tenancy.set_project_quota(db, org, "p", {"running": 5}, None)  # the project row too
    inserted, created = threading.Event(), threading.Event()

    def hold_key_share() -> None:
        with db.transaction() as session:
            session.add(ApiToken(id=new_id("tok"), user_id=me.user_id,
                                 token_hash=uuid.uuid4().hex, created_at=db.now(session)))
            session.add(Workspace(id=new_id("ws"), org_id=me.org_id, project_id=me.project_id,
                                  owner_id=me.user_id, name="x", state="suspended",
                                  desired_state="suspended", created_at=db.now(session),
                                  updated_at=db.now(session)))
            session.flush()
            inserted.set()
            created.wait()

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(hold_key_share)
        inserted.wait()
        try:
            with db.transaction() as session:
                session.execute(text("SET LOCAL lock_timeout = '20s'"))
                workspaces.create(session, me, "w", db.now(session))
        finally:
            created.set()
        holder.result()
    assert count(db, me, DesiredState.RUNNING) == 1
