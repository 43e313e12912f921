"""What a notebook is told after its host was lost, and what the gateway answers
for cells the host never answered (``control/failover.py``, ``fleet/inflight.py``);
what the control plane records of a kernel's checkpoints and restarts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from nbfleet.agent.wire import V1_PROTOCOL, pack_v1, unpack_v1
from nbfleet.control import failover
from nbfleet.control.fleet.frames import execute_reply_parent
from nbfleet.control.fleet.inflight import CellsInFlight
from nbfleet.control.workspaces import HostLoss
from nbfleet.db.engine import Database
from nbfleet.db.tables import Workspace
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.protocol.checkpoints import CellCheckpoint
from tests.support.rows import add_workspace

LOST = {"host": "host-a", "at": "2026-11-28T01:02:03.000000+00:00",
        "reason": "host stopped heartbeating"}


def _snapshot(**extra: Any) -> dict[str, Any]:
    return {"kernels": {"k1": {"key": "s/1", "cell": 5}, "k2": {"key": "s/2"}},
            "host_lost": LOST, **extra}


def test_no_loss_no_report_and_no_notice() -> None:
    snapshot = {"kernels": {"k1": {"key": "s/1", "cell": 5}}}
    assert failover.report(snapshot, ["k1"]) is None
    assert failover.notices(snapshot, ["k1"], "host-b") == {}
    assert failover.report(None, ["k1"]) is None


def test_each_kernel_says_which_cell_its_state_is_from() -> None:
    snapshot = _snapshot(cells={"k1": {"host": "host-a", "last_completed": 7,
                                       "interrupted": 1}})
    facts = failover.report(snapshot, ["k1", "k2", "k3"])
    assert facts is not None and facts["host"] == "host-a"
    assert facts["kernels"] == {
        "k1": {"state": "after_cell", "as_of_cell": 5, "last_completed_cell": 7,
               "cells_not_saved": 2, "interrupted": 1},
        "k2": {"state": "last_suspend", "as_of_cell": None, "last_completed_cell": None,
               "cells_not_saved": None, "interrupted": 0},
        "k3": {"state": "none", "as_of_cell": None, "last_completed_cell": None,
               "cells_not_saved": None, "interrupted": 0},
    }
    told = failover.notices(snapshot, ["k1", "k2", "k3"], "host-b")
    assert "(host-a) was lost at 2026-11-28 01:02:03 UTC (host stopped heartbeating)" \
        in told["k1"]
    assert "restarted on host-b" in told["k1"]
    assert "come from the state saved after cell [5]" in told["k1"]
    assert "Cells after [5] up to [7] completed, but their state had not reached" in told["k1"]
    assert "1 cell(s) running or queued" in told["k1"]
    assert "from its last suspend" in told["k2"] and "interrupted" not in told["k2"]
    assert "they are lost" in told["k3"]


def test_what_a_gateway_saw_of_another_host_is_not_blamed_on_this_loss() -> None:
    """A kernel shut down mid-cell on host-z left a record; host-a is the one lost."""
    snapshot = _snapshot(cells={"k1": {"host": "host-z", "last_completed": 9,
                                       "interrupted": 2}})
    facts = failover.report(snapshot, ["k1"])
    assert facts is not None
    assert facts["kernels"]["k1"]["interrupted"] == 0
    assert facts["kernels"]["k1"]["last_completed_cell"] is None


def test_settle_clears_the_marks_and_keeps_the_state() -> None:
    snapshot = _snapshot(cells={"k1": {"host": "host-a", "interrupted": 1}})
    settled = failover.settle(snapshot)
    assert settled == {"kernels": snapshot["kernels"]}
    assert failover.settle(None) is None


def _legacy(msg_type: str, msg_id: str, parent: str | None = None, channel: str = "shell",
            content: dict[str, Any] | None = None) -> str:
    return json.dumps({"header": {"msg_id": msg_id, "msg_type": msg_type, "session": "s"},
                       "parent_header": {"msg_id": parent} if parent else {},
                       "metadata": {}, "content": content or {}, "channel": channel},
                      separators=(",", ":"))


def test_unanswered_cells_are_answered_once_in_order_with_host_lost() -> None:
    cells = CellsInFlight(None)
    for msg_id in ("c1", "c2", "c3"):
        cells.sent(_legacy("execute_request", msg_id, content={"code": "1"}))
    cells.sent(_legacy("kernel_info_request", "i1"))  # not a cell
    cells.sent(_legacy("comm_msg", "m1", channel="iopub"))
    cells.received(_legacy("execute_reply", "r1", parent="c1",
                           content={"status": "ok", "execution_count": 4}))
    assert list(cells.pending) == ["c2", "c3"] and cells.last_completed == 4
    frames = cells.interrupted("host-a")
    assert cells.pending == {} and cells.interrupted("host-a") == []
    messages = [json.loads(frame) for frame in frames]
    assert [(m["channel"], m["msg_type"], m["parent_header"]["msg_id"]) for m in messages] == [
        ("iopub", "error", "c2"), ("shell", "execute_reply", "c2"), ("iopub", "status", "c2"),
        ("iopub", "error", "c3"), ("shell", "execute_reply", "c3"), ("iopub", "status", "c3")]
    assert messages[1]["content"]["status"] == "error"
    assert messages[1]["content"]["ename"] == "HostLost"
    assert "(host-a) ended while this cell ran" in messages[0]["content"]["evalue"]
    assert "ended before this cell ran: it did not run" in messages[3]["content"]["evalue"]
    # The gate must see our reply as the cell's end, or it would hold its GPUs.
    assert execute_reply_parent(frames[1], None) == "c2"


def test_v1_frames_are_tracked_too() -> None:
    cells = CellsInFlight(V1_PROTOCOL)
    header = json.dumps({"msg_id": "c9", "msg_type": "execute_request"}).encode()
    cells.sent(pack_v1("shell", [header, b"{}", b"{}", b'{"code":"1"}'], []))
    assert list(cells.pending) == ["c9"]
    frames = cells.interrupted("host-z")
    channel, parts, _ = unpack_v1(frames[1])
    assert channel == "shell" and json.loads(parts[3])["ename"] == "HostLost"
    assert execute_reply_parent(frames[1], V1_PROTOCOL) == "c9"


def test_a_kernel_restarted_since_its_last_save_is_said_to_have_nothing_to_bring_back(
        ) -> None:
    """Its saved state was removed by the restart's report: it is not "lost", the
    user cleared it, and no cell is claimed."""
    snapshot = {"kernels": {"k1": {"key": "s/1", "cell": 5}},
                "restarted": {"k2": {"at": "2026-11-28T01:00:00+00:00", "host": "host-a"}},
                "host_lost": LOST}
    facts = failover.report(snapshot, ["k1", "k2"])
    assert facts is not None
    assert facts["kernels"]["k2"] == {
        "state": "restarted", "as_of_cell": None, "last_completed_cell": None,
        "cells_not_saved": None, "interrupted": 0}
    HostLoss.model_validate(facts)  # the restore summary's model takes it
    told = failover.notices(snapshot, ["k1", "k2"], "host-b")
    assert "had been restarted before the host was lost" in told["k2"]
    assert "no variables to bring back" in told["k2"]
    assert "cell [" not in told["k2"] and "they are lost" not in told["k2"]
    assert "saved after cell [5]" in told["k1"]
    # Told once, the loss's marks go; the restart's stays until a save replaces it.
    assert failover.settle(snapshot) == {"kernels": snapshot["kernels"],
                                         "restarted": snapshot["restarted"]}


WS, KERNEL = "ws_failover", "k_failover"


@pytest.fixture
def running(db: Database) -> Database:
    """A workspace running on host-a (boot b1), placed with generation 4."""
    add_workspace(db, WS, KERNEL, "f", state=WorkspaceState.RUNNING,
                  desired_state=DesiredState.RUNNING, generation=4, host_id="host-a",
                  host_boot_id="b1", placed_generation=4)
    return db


def _report(key: str | None, cell: int, **fence: Any) -> CellCheckpoint:
    body = {"agent_id": "host-a", "boot_id": "b1", "generation": 4, "kernel_id": KERNEL,
            "key": key, "bytes": 10 if key else 0, "written": 10 if key else 0,
            "cell": cell, **fence}
    return CellCheckpoint.model_validate(body)


def _recorded(db: Database) -> dict[str, Any]:
    with db.transaction(write=False) as session:
        ws = session.get(Workspace, WS)
        assert ws is not None
        return dict(ws.snapshot or {})


def test_a_restart_s_report_removes_the_kernel_s_state_and_a_checkpoint_replaces_it(
        running: Database) -> None:
    db = running
    assert failover.record_checkpoint(db, WS, _report("s/1", 3)).kept
    recorded = failover.record_checkpoint(db, WS, _report(None, 0))
    assert recorded.kept and recorded.replaced == "s/1"  # the agent deletes it
    snapshot = _recorded(db)
    assert snapshot["kernels"] == {} and snapshot["bytes"] == 0
    assert snapshot["restarted"][KERNEL]["host"] == "host-a"
    # A host loss now restores nothing for it, and says why.
    lost = failover.report({**snapshot, "host_lost": LOST}, [KERNEL])
    assert lost is not None and lost["kernels"][KERNEL]["state"] == "restarted"
    # Again (a second restart): nothing more to delete.
    assert failover.record_checkpoint(db, WS, _report(None, 0)).replaced is None
    # The new process's first cell: its state counts again, the mark goes.
    recorded = failover.record_checkpoint(db, WS, _report("s/2", 1))
    assert recorded.kept and recorded.replaced is None
    snapshot = _recorded(db)
    assert snapshot["kernels"][KERNEL]["key"] == "s/2" and "restarted" not in snapshot


def test_a_stale_host_s_restart_report_is_refused_like_its_checkpoints(
        running: Database) -> None:
    db = running
    assert failover.record_checkpoint(db, WS, _report("s/1", 3)).kept
    before = _recorded(db)
    for stale, why in (({"boot_id": "an-old-boot"}, "runs elsewhere"),
                       ({"agent_id": "host-z"}, "runs elsewhere"),
                       ({"generation": 3}, "generation"),
                       ({"kernel_id": "not-a-kernel"}, "no such kernel")):
        recorded = failover.record_checkpoint(db, WS, _report(None, 0, **stale))
        assert not recorded.kept and why in str(recorded.reason), recorded
        assert recorded.replaced is None
    assert _recorded(db) == before  # the state of cell 3 still counts


def test_a_restart_s_report_names_no_state() -> None:
    with pytest.raises(ValidationError):
        _report(None, 3)  # a cell, yet nothing saved
    with pytest.raises(ValidationError):
        CellCheckpoint.model_validate({**_report("s/1", 1).model_dump(), "key": None})


def _last_error(db: Database) -> str | None:
    with db.transaction(write=False) as session:
        ws = session.get(Workspace, WS)
        assert ws is not None
        return ws.last_error


def _set_last_error(db: Database, text: str | None) -> None:
    with db.transaction() as session:
        ws = session.get(Workspace, WS)
        assert ws is not None
        ws.last_error = text


def test_a_failed_checkpoint_keeps_the_state_says_why_and_clears_once_one_is_kept(
        running: Database) -> None:
    db = running
    assert failover.record_checkpoint(db, WS, _report("s/1", 3)).kept
    failed = CellCheckpoint.model_validate({**_report(None, 0).model_dump(), "cell": 4,
                                            "failed": "OSError: disk full"})
    failover.record_checkpoint(db, WS, failed)
    recorded = _recorded(db)
    assert recorded["kernels"][KERNEL]["key"] == "s/1", "the kept state stays"
    assert recorded["checkpoint_failures"][KERNEL]["cell"] == 4
    error = _last_error(db)
    assert error is not None and "after cell 4 failed: OSError: disk full" in error
    assert "comes back as of cell 3" in error
    # Another operation's failure is not overwritten by a checkpoint's.
    _set_last_error(db, "suspend failed: could not save the workspace")
    failover.record_checkpoint(db, WS, failed)
    assert _last_error(db) == "suspend failed: could not save the workspace"
    # A kept checkpoint clears the entry, and only its own kind of last error.
    assert failover.record_checkpoint(db, WS, _report("s/2", 5)).kept
    assert "checkpoint_failures" not in _recorded(db)
    assert _last_error(db) == "suspend failed: could not save the workspace"
    _set_last_error(db, None)
    failover.record_checkpoint(db, WS, failed)
    assert failover.record_checkpoint(db, WS, _report("s/3", 6)).kept
    assert _last_error(db) is None


def test_a_failed_checkpoint_names_no_state() -> None:
    with pytest.raises(ValidationError):
        CellCheckpoint.model_validate({**_report("s/1", 1).model_dump(), "failed": "x"})
