"""The standby keeper's plan (``control/standbys.py``): which standbys lack the
workspace's latest checkpoint, and so are sent it again at the next pass.

A standby made after a checkpoint was recorded is given that checkpoint's key with
its order (keys only), so it holds the right state under no cell; the stage that
named the cell may have reached the host before the standby had the kernel, and
been refused. The plan must bring the cell up to date too: the restore report and
the tests read "as of cell N" from it."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from nbfleet.control.standbys import StandbyKeeper
from nbfleet.db.engine import Database
from nbfleet.db.tables import Agent, StandbyReplica
from nbfleet.model.errors import Conflict
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.protocol.checkpoints import StagedKernel, StandbyState
from tests.support.rows import add_workspace

WS, KERNEL, EXECUTOR, REPLICA, GENERATION = "ws_plan", "k1", "host_a", "host_b", 4
LATEST = {"key": "workspaces/ws_plan/snapshots/k1/two", "cell": 2}


class _Agents:
    """The agents' stage calls, answered as a standby that staged what it was sent
    (or refused, with ``refuse``)."""

    def __init__(self) -> None:
        self.staged: list[tuple[str, int | None]] = []
        self.refuse = False

    async def stage(self, url: str, workspace_id: str, generation: int, kernel_id: str,
                    key: str, cell: int | None) -> StandbyState:
        self.staged.append((key, cell))
        if self.refuse:
            raise Conflict("checkpoint not loaded on the standby")
        return StandbyState(kernels={kernel_id: StagedKernel(key=key, cell=cell)})


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
    platform = SimpleNamespace(db=db, config=SimpleNamespace(agent_timeout_s=10.0),
                               agents=_Agents())
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


def test_a_checkpoint_replaced_while_the_pass_ran_is_not_sent(db: Database) -> None:
    """The pass's plan is read before it makes standbys (seconds): a checkpoint
    recorded meanwhile was sent on by itself, and the plan's older one must not
    follow it and put the standby back."""
    keeper = _keeper(db, {KERNEL: {"key": "workspaces/ws_plan/snapshots/k1/one",
                                   "cell": 1}})
    lagging = keeper._plan(None)[2]
    assert keeper._still_latest(lagging) == lagging
    older = [(WS, GENERATION, KERNEL, "workspaces/ws_plan/snapshots/k1/one", 1)]
    assert keeper._still_latest(older) == []
    assert keeper._still_latest([(WS, GENERATION + 1, KERNEL, LATEST["key"], 2)]) == []


async def test_a_standby_whose_stage_failed_is_not_sent_it_again_every_pass(
        db: Database) -> None:
    keeper = _keeper(db, {KERNEL: {"key": None, "cell": None}})
    agents = keeper.platform.agents
    assert isinstance(agents, _Agents)
    agents.refuse = True

    async def catch_up() -> None:
        await keeper.checkpointed(WS, GENERATION, KERNEL, str(LATEST["key"]), 2,
                                  catch_up=True)
        sync = keeper._syncs.get((WS, REPLICA))
        if sync is not None and sync.task is not None:
            await sync.task

    await catch_up()
    assert len(agents.staged) == 1
    await catch_up()  # the next pass, a second later: backing off
    assert len(agents.staged) == 1
    # A new checkpoint is always sent.
    await keeper.checkpointed(WS, GENERATION, KERNEL, "workspaces/ws_plan/snapshots/k1/3",
                              3)
    await asyncio.sleep(0)
    sync = keeper._syncs[(WS, REPLICA)]
    assert sync.task is not None
    await sync.task
    assert len(agents.staged) == 2
    # Once the wait is over, a pass sends it again; a success clears the wait.
    agents.refuse = False
    keeper._stage_backoff[(WS, REPLICA)] = (2, time.monotonic() - 1)
    await catch_up()
    assert agents.staged[-1] == (LATEST["key"], 2)
    assert (WS, REPLICA) not in keeper._stage_backoff


async def test_a_pass_does_not_send_beside_a_send_under_way(db: Database) -> None:
    keeper = _keeper(db, {KERNEL: {"key": None, "cell": None}})
    agents = keeper.platform.agents
    assert isinstance(agents, _Agents)
    gate = asyncio.Event()
    original = agents.stage

    async def slow(*args: Any) -> StandbyState:
        await gate.wait()
        return await original(*args)
    agents.stage = slow  # type: ignore[method-assign]
    newer = "workspaces/ws_plan/snapshots/k1/3"
    await keeper.checkpointed(WS, GENERATION, KERNEL, newer, 3)
    await asyncio.sleep(0)
    await keeper.checkpointed(WS, GENERATION, KERNEL, str(LATEST["key"]), 2, catch_up=True)
    gate.set()
    sync = keeper._syncs[(WS, REPLICA)]
    assert sync.task is not None
    await sync.task
    assert agents.staged == [(newer, 3)]
