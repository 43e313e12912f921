"""What a notebook is told after its host was lost, and what the gateway answers
for cells the host never answered (``control/failover.py``, ``fleet/inflight.py``)."""

from __future__ import annotations

import json
from typing import Any

from nbfleet.agent.wire import V1_PROTOCOL, pack_v1, unpack_v1
from nbfleet.control import failover
from nbfleet.control.fleet.frames import execute_reply_parent
from nbfleet.control.fleet.inflight import CellsInFlight

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
