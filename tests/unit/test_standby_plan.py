"""The standby keeper's plan (``control/standbys.py``): which standbys lack the
workspace's latest checkpoint, and so are sent it again at the next pass.

A standby made after a checkpoint was recorded is given that checkpoint's key with
its order (keys only), so it holds the right state under no cell; the stage that
named the cell may have reached the host before the standby had the kernel, and
been refused. The plan must bring the cell up to date too: the restore report and
the tests read "as of cell N" from it."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from nbfleet.control.standbys import StandbyKeeper
from nbfleet.db.engine import Database
from nbfleet.db.tables import Agent, StandbyReplica
from nbfleet.model.workspace import DesiredState, WorkspaceState
from tests.support.rows import add_workspace

WS, KERNEL, EXECUTOR, REPLICA, GENERATION = "ws_plan", "k1", "host_a", "host_b", 4
LATEST = {"key": "workspaces/ws_plan/snapshots/k1/two", "cell": 2}


def _keeper(db: Database, staged: dict[str, Any] | None) -> StandbyKeeper:
    now = datetime.now(UTC)
    add_workspace(db, WS, KERNEL, "plan", state=WorkspaceState.RUNNING,
                  desired_state=DesiredState.RUNNING, generation=GENERATION,
                  placed_generation=GENERATION, host_id=EXECUTOR, host_boot_id="boot_a",
                  gpu_placement={"hosts": [EXECUTOR, REPLICA]},
                  snapshot={"kernels": {KERNEL: LATEST}, "packages": None})
    with db.transaction() as session:
        for host in (EXECUTOR, REPLICA):
            session.add(Agent(id=host, url=f"http://{host}", boot_id=f"boot_{host[-1]}",
                              inventory={}, registered_at=now, last_heartbeat_at=now))
        session.flush()
        session.add(StandbyReplica(workspace_id=WS, host_id=REPLICA, boot_id="boot_b",
                                   staged=staged, synced_at=now, created_at=now))
    platform = SimpleNamespace(db=db, config=SimpleNamespace(agent_timeout_s=10.0))
    return StandbyKeeper(platform)  # type: ignore[arg-type]


def test_a_standby_holding_the_latest_checkpoint_under_no_cell_is_sent_its_cell(
        db: Database) -> None:
    keeper = _keeper(db, {KERNEL: {"key": LATEST["key"], "cell": None}})
    wanted, stale, lagging = keeper._plan(None)
    assert (wanted, stale) == ([], [])
    assert lagging == [(WS, GENERATION, KERNEL, LATEST["key"], 2)]


def test_a_standby_with_an_older_checkpoint_is_sent_the_latest(db: Database) -> None:
    keeper = _keeper(db, {KERNEL: {"key": "workspaces/ws_plan/snapshots/k1/one",
                                   "cell": 1}})
    assert keeper._plan(None)[2] == [(WS, GENERATION, KERNEL, LATEST["key"], 2)]


def test_a_standby_up_to_date_is_sent_nothing(db: Database) -> None:
    keeper = _keeper(db, {KERNEL: dict(LATEST)})
    assert keeper._plan(None) == ([], [], [])


def test_a_standby_without_the_kernel_is_made_again(db: Database) -> None:
    """Made before the kernel started: the next pass makes it follow the kernels."""
    keeper = _keeper(db, {})
    wanted, stale, lagging = keeper._plan(None)
    assert [(w.workspace_id, w.host_id, w.kernels) for w in wanted] == [
        (WS, REPLICA, ((KERNEL, "python3"),))]
    assert (stale, lagging) == ([], [])
