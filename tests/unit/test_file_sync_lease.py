"""The live file sync is fenced by a lease: an agent that cannot have heartbeated
recently enough writes nothing, since the control plane may have presumed its host
dead and placed its workspaces elsewhere; a heartbeat's reply names the runtimes
that are no longer placed on it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from nbfleet.agent import filesync
from nbfleet.agent.livesync import DEFAULT_AGENT_TIMEOUT_S, Lease, LiveSync
from nbfleet.agent.service import heartbeat_reply
from nbfleet.control.hosts import Placement, still_placed
from nbfleet.protocol.agent import Heartbeat, HeartbeatReply, HeldRuntime
from nbfleet.storage.blobs import BlobStore
from nbfleet.storage.files import WorkspaceFiles

pytestmark = pytest.mark.no_db


class Clock:
    """``time.monotonic`` as the test sets it."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stored(files: WorkspaceFiles) -> dict[str, bytes]:
    return {b.key: files.get("ws", b.key) for b in files.list("ws")}


def live_sync(tmp_path: Path, lease: Lease, clock: Clock) -> tuple[LiveSync, Path,
                                                                   WorkspaceFiles]:
    work = tmp_path / "work"
    work.mkdir()
    files = WorkspaceFiles(BlobStore(str(tmp_path / "blobs")))
    manifest: filesync.Manifest = {}
    loop = LiveSync(files, "ws", lambda: str(work), lambda: manifest, lambda: True,
                    asyncio.Lock(), interval_s=2.0, lease=lease, clock=clock)
    return loop, work, files


# ------------------------------------------------------------------- the lease
def test_a_lease_is_held_for_half_the_agent_timeout_from_the_heartbeat_sent() -> None:
    lease = Lease()
    assert not lease.held(0.0)  # no heartbeat answered yet
    lease.renew(sent_at=100.0, timeout_s=10.0)
    assert lease.held(100.0) and lease.held(104.9)
    assert not lease.held(105.0)  # the rest is left for a round's uploads to land


def test_a_late_answer_to_an_older_heartbeat_never_moves_the_lease_back() -> None:
    lease = Lease()
    lease.renew(sent_at=100.0, timeout_s=10.0)
    lease.renew(sent_at=90.0, timeout_s=10.0)  # sent before the stall, answered after
    assert lease.sent_at == 100.0
    # An answer that comes long after its heartbeat was sent holds no lease.
    stalled = Lease()
    stalled.renew(sent_at=100.0, timeout_s=10.0)
    assert not stalled.held(120.0)


def test_the_lease_follows_the_timeout_the_control_plane_says() -> None:
    lease = Lease()
    lease.renew(sent_at=0.0, timeout_s=30.0)
    assert lease.held(14.0) and not lease.held(15.0)


# ------------------------------------------------------- the sync under the lease
async def test_a_round_with_a_fresh_lease_syncs(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    lease = Lease()
    lease.renew(sent_at=999.0, timeout_s=10.0)
    loop, work, files = live_sync(tmp_path, lease, clock)
    (work / "out.txt").write_bytes(b"v1")
    assert await loop.round() == []  # seen once: may still be written
    assert await loop.round() == ["out.txt"]
    assert stored(files) == {"out.txt": b"v1"}


async def test_a_round_with_a_stale_lease_writes_nothing_and_logs_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The agent stalled past the agent timeout: the control plane may have placed
    the workspace elsewhere, where its file may be newer. Nothing is written until a
    heartbeat renews the lease; then the paths ready are synced."""
    clock = Clock(1000.0)
    lease = Lease()
    lease.renew(sent_at=980.0, timeout_s=10.0)  # sent 20 s ago
    loop, work, files = live_sync(tmp_path, lease, clock)
    (work / "out.txt").write_bytes(b"stale")
    with caplog.at_level(logging.WARNING, logger="nbfleet.agent.livesync"):
        for _ in range(4):
            assert await loop.round() == []
            clock.now += 2.0
    assert stored(files) == {}
    paused = [r for r in caplog.records if "paused" in r.getMessage()]
    assert len(paused) == 1, caplog.records
    assert "sent 22.0 s ago" in paused[0].getMessage()  # at the first round ready

    lease.renew(sent_at=clock.now, timeout_s=10.0)  # a heartbeat answered
    assert await loop.round() == ["out.txt"]
    assert stored(files) == {"out.txt": b"stale"}
    # A later lapse is logged again, once.
    clock.now += 60.0
    (work / "out.txt").write_bytes(b"later")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nbfleet.agent.livesync"):
        for _ in range(3):
            assert await loop.round() == []
    assert len([r for r in caplog.records if "paused" in r.getMessage()]) == 1
    assert stored(files) == {"out.txt": b"stale"}


async def test_no_heartbeat_answered_yet_holds_no_lease(tmp_path: Path) -> None:
    loop, work, files = live_sync(tmp_path, Lease(), Clock(5.0))
    (work / "out.txt").write_bytes(b"v1")
    await loop.round()
    assert await loop.round() == [] and stored(files) == {}


# ------------------------------------------- which runtimes are no longer the agent's
PLACED = Placement(host_id="host_a", host_boot_id="boot_1", placed_generation=4)


@pytest.mark.parametrize(("placement", "generation", "placed"), [
    (PLACED, 4, True),
    (PLACED, 5, True),  # a placement of generation 5 under way on this host
    (Placement("host_a", "boot_1", None), 1, True),  # the first placement under way
    (None, 4, False),  # the workspace is gone
    (Placement("host_b", "boot_9", 5), 4, False),  # placed elsewhere (presumed dead)
    (Placement(None, None, 4), 4, False),  # suspended, or waiting for a host
    (Placement("host_a", "boot_2", 4), 4, False),  # this host's next boot has it
    (PLACED, 3, False),  # a newer placement completed since
])
def test_a_runtime_is_still_placed_only_on_its_host_boot_and_placement(
        placement: Placement | None, generation: int, placed: bool) -> None:
    assert still_placed(placement, "host_a", "boot_1", generation) is placed


# ------------------------------------------------------------------- the wire
def test_a_heartbeat_reports_its_runtimes_and_old_bodies_still_parse() -> None:
    beat = Heartbeat(boot_id="boot_1",
                     runtimes=[HeldRuntime(workspace_id="ws_1", generation=3)])
    assert Heartbeat.model_validate_json(beat.model_dump_json()) == beat
    assert Heartbeat.model_validate({"boot_id": "boot_1"}).runtimes == []  # older agents


def test_an_older_control_plane_s_empty_reply_names_nothing_stale() -> None:
    reply = heartbeat_reply(httpx.Response(204))
    assert reply == HeartbeatReply(agent_timeout_s=DEFAULT_AGENT_TIMEOUT_S, stale=[])
    body = HeartbeatReply(agent_timeout_s=30.0, stale=["ws_1"]).model_dump(mode="json")
    assert heartbeat_reply(httpx.Response(200, json=body)).stale == ["ws_1"]


# ------------------------------------------------- how far behind the store is
def test_the_sync_says_since_when_the_store_holds_every_file(tmp_path: Path) -> None:
    """What a lost host loses: what its kernels wrote since ``synced_at``."""
    clock = Clock(1000.0)
    lease = Lease()
    lease.renew(sent_at=1000.0, timeout_s=100.0)
    loop, work, files = live_sync(tmp_path, lease, clock)
    assert loop.clean and loop.synced_at == 1000.0  # started from the store
    clock.now = 1002.0
    asyncio.run(loop.round())
    assert loop.clean and loop.synced_at == 1002.0  # nothing differs
    (work / "a.txt").write_text("one")
    clock.now = 1004.0
    asyncio.run(loop.round())  # seen once: not settled yet, nothing uploaded
    assert not loop.clean and loop.synced_at == 1002.0
    assert stored(files) == {}
    clock.now = 1006.0
    asyncio.run(loop.round())  # settled: uploaded
    assert stored(files) == {"a.txt": b"one"}
    assert loop.clean and loop.synced_at == 1006.0


def test_a_round_the_lease_does_not_cover_leaves_the_files_unsynced(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    loop, work, files = live_sync(tmp_path, Lease(), clock)  # no heartbeat answered
    (work / "a.txt").write_text("one")
    for now in (1002.0, 1004.0):
        clock.now = now
        asyncio.run(loop.round())
    assert stored(files) == {} and not loop.clean and loop.synced_at == 1000.0
