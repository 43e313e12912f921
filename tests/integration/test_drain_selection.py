"""Which workspaces hold a drain open, and which it sends away (``control/drain.py``).

Only workspaces that may have a runtime on the host count: a FAILED placement keeps
its host recorded while nothing runs there, and must not keep a drain from ending.
A move that could not suspend its kernel waits out a backoff before the drain asks
again: a kernel that will not suspend is not asked every 0.25 s. A database
decision, so it runs on PostgreSQL too.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from nbfleet.control import drain, leases
from nbfleet.db.engine import Database
from nbfleet.db.tables import Agent, Workspace
from nbfleet.model.workspace import DesiredState, WorkspaceState
from tests.support.ledger import new_tenant

HOST = "host_drained"


def _workspace(db: Database, tenant_ids: tuple[str, str, str], name: str, state: str,
               retry_in_s: float | None = None) -> str:
    org, project, user = tenant_ids
    with db.transaction() as session:
        now = db.now(session)
        ws = Workspace(id=f"ws_{name}", org_id=org, project_id=project, owner_id=user,
                       name=name, state=state, desired_state=DesiredState.RUNNING,
                       pending=False, host_id=HOST, host_boot_id="boot_1",
                       next_attempt_at=(now + timedelta(seconds=retry_in_s)
                                        if retry_in_s is not None else None),
                       created_at=now, updated_at=now)
        session.add(ws)
        return ws.id


def test_failed_placements_do_not_hold_a_drain_and_a_backing_off_move_waits(
        db: Database) -> None:
    tenant = new_tenant(db)
    ids = (tenant.org_id, tenant.project_id, tenant.user_id)
    with db.transaction() as session:
        now = db.now(session)
        session.add(Agent(id=HOST, url="http://127.0.0.1:9", boot_id="boot_1",
                          inventory={}, registered_at=now, last_heartbeat_at=now))
    running = _workspace(db, ids, "running", WorkspaceState.RUNNING)
    _workspace(db, ids, "failed", WorkspaceState.FAILED)
    backing_off = _workspace(db, ids, "backing_off", WorkspaceState.RUNNING, retry_in_s=60)

    with db.transaction() as session:
        now = db.now(session)
        total, leaving = drain._on_host(session, HOST, now)
        sent = {ws.id for ws in session.execute(drain._leaving(HOST, now)).scalars()}
        report = drain.start(session, HOST, now)
    assert (total, leaving) == (2, 1)  # the failed one holds nothing; one waits
    assert sent == {running}
    assert report.workspaces == 2
    # Once its backoff is over, the drain asks it again.
    later = datetime.now(UTC) + timedelta(seconds=120)
    with db.transaction(write=False) as session:
        _, leaving_later = drain._on_host(session, HOST, later)
    assert leaving_later == 2 and backing_off


def test_a_drain_pass_under_a_lost_lease_sends_nothing_away(db: Database) -> None:
    """The moves are written under the reconciler's lease: a replica whose token is
    stale (another took the lease) leaves the host's workspaces where they are."""
    tenant = new_tenant(db)
    ids = (tenant.org_id, tenant.project_id, tenant.user_id)
    with db.transaction() as session:
        now = db.now(session)
        for host in (HOST, "host_other"):
            session.add(Agent(id=host, url="http://127.0.0.1:9", boot_id="boot_1",
                              inventory={}, registered_at=now, last_heartbeat_at=now))
    running = _workspace(db, ids, "running", WorkspaceState.RUNNING)
    stale = leases.acquire(db, leases.WORKSPACES, "replica-a", 0.01)
    assert stale is not None
    time.sleep(0.05)
    current = leases.acquire(db, leases.WORKSPACES, "replica-b", 30.0)
    assert current is not None and current != stale
    homes = drain.Homes({}, "host_other")

    assert drain.empty_host(db, HOST, homes, stale, 10.0) == 1
    with db.transaction(write=False) as session:
        ws = session.get(Workspace, running)
        assert ws is not None and (ws.state, ws.move_to) == (WorkspaceState.RUNNING, None)

    assert drain.empty_host(db, HOST, homes, current, 10.0) == 1  # on its way
    with db.transaction(write=False) as session:
        ws = session.get(Workspace, running)
        assert ws is not None and (ws.state, ws.move_to) == (WorkspaceState.SUSPENDING,
                                                             "host_other")
