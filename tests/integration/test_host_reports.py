"""What a host's heartbeat says of its files and its disk, as the database keeps
it: since when each workspace's store lacks files (written only when that
changes), what a lost host's workspaces are told they came back to, and no new
placement on a host short of disk."""

from __future__ import annotations

from datetime import timedelta

from nbfleet.control import hosts
from nbfleet.db.engine import Database
from nbfleet.db.tables import Agent, Workspace
from nbfleet.model.workspace import DesiredState, WorkspaceState
from tests.support.rows import add_workspace

HOST, BOOT = "host_a", "boot_1"


def _host(db: Database, host: str = HOST) -> None:
    with db.transaction() as session:
        now = db.now(session)
        session.add(Agent(id=host, url="http://127.0.0.1:9", boot_id=BOOT, inventory={},
                          registered_at=now, last_heartbeat_at=now))


def _running(db: Database, ws: str) -> None:
    add_workspace(db, ws, f"k_{ws}", ws, state=WorkspaceState.RUNNING,
                  desired_state=DesiredState.RUNNING, host_id=HOST,
                  host_boot_id=BOOT, snapshot={"kernels": {f"k_{ws}": {"key": "s/1",
                                                                      "cell": 3}}})


def _unsynced(db: Database, ws: str) -> object:
    with db.transaction(write=False) as session:
        row = session.get(Workspace, ws)
        assert row is not None
        return row.files_unsynced_since


def test_since_when_files_are_unsynced_is_kept_from_the_first_report(db: Database) -> None:
    _host(db)
    _running(db, "ws_a")
    _running(db, "ws_b")
    with db.transaction() as session:
        now = db.now(session)
        hosts.record_file_syncs(session, HOST, BOOT, [("ws_a", 5.0), ("ws_b", None)], now)
    first = _unsynced(db, "ws_a")
    assert first is not None and abs((now - first).total_seconds() - 5.0) < 0.01  # type: ignore[operator]
    assert _unsynced(db, "ws_b") is None
    with db.transaction() as session:  # still unsynced, 7 s now: the start is kept
        hosts.record_file_syncs(session, HOST, BOOT, [("ws_a", 7.0)],
                                db.now(session) + timedelta(seconds=2))
    assert _unsynced(db, "ws_a") == first
    with db.transaction() as session:  # another boot's report changes nothing
        hosts.record_file_syncs(session, HOST, "boot_old", [("ws_a", None)], db.now(session))
    assert _unsynced(db, "ws_a") == first
    with db.transaction() as session:
        hosts.record_file_syncs(session, HOST, BOOT, [("ws_a", None)], db.now(session))
    assert _unsynced(db, "ws_a") is None


def test_a_lost_host_s_workspaces_are_told_what_their_files_came_back_to(
        db: Database) -> None:
    _host(db)
    _running(db, "ws_dirty")
    _running(db, "ws_clean")
    with db.transaction() as session:
        now = db.now(session)
        hosts.heartbeat(session, now, HOST, BOOT, files_lag_s=1.5)
        hosts.record_file_syncs(session, HOST, BOOT, [("ws_dirty", 20.0),
                                                      ("ws_clean", None)], now)
    with db.transaction() as session:
        lost = hosts.runtimes_lost(session, HOST, db.now(session), "host stopped heartbeating")
    assert lost == 2
    with db.transaction(write=False) as session:
        dirty, clean = session.get(Workspace, "ws_dirty"), session.get(Workspace, "ws_clean")
        assert dirty is not None and clean is not None
        assert dirty.files_unsynced_since is None  # the next placement starts clean
        told = {w.id: w.snapshot["host_lost"]["files_as_of"] for w in (dirty, clean)}
    # The dirty one: since its files went unsynced, 20 s before the heartbeat; the
    # clean one: the heartbeat, less the lag its host reported.
    as_of = {k: v[:19] for k, v in told.items()}
    expected_dirty = (now - timedelta(seconds=20)).isoformat()[:19]
    expected_clean = (now - timedelta(seconds=1.5)).isoformat()[:19]
    assert as_of == {"ws_dirty": expected_dirty, "ws_clean": expected_clean}, told


def test_no_new_placement_on_a_host_short_of_disk(db: Database) -> None:
    _host(db, "host_a")
    _host(db, "host_b")
    with db.transaction() as session:
        now = db.now(session)
        hosts.heartbeat(session, now, "host_a", BOOT, disk_short=True)
        hosts.heartbeat(session, now, "host_b", BOOT, disk_short=None)  # no quotas: unsaid
        loads = {load.host_id for load in hosts.host_loads(session, now, 30.0)}
    assert loads == {"host_b"}
    with db.transaction() as session:
        now = db.now(session)
        hosts.heartbeat(session, now, "host_a", BOOT, disk_short=False)
        loads = {load.host_id for load in hosts.host_loads(session, now, 30.0)}
    assert loads == {"host_a", "host_b"}
