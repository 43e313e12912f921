"""The kernel's checkpoint (``kernel.checkpoint``): written by the capture thread
between cells, exactly as a suspend's flush, and given up when a cell starts
first, so the next cell never waits for it and a torn view is never written."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nbfleet.kernel import snapshot
from nbfleet.kernel.capture import _Checkpoint
from tests.support.kernel_shell import Session, shell


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    kernel = Session(shell(), tmp_path / "state")
    capture = kernel.capture
    capture.checkpoint_writer = lambda seq, epoch: snapshot.checkpoint(capture, seq, epoch)
    capture.checkpoint_dropped = (
        lambda seq, reason: snapshot.mark_checkpoint(capture, seq, False, reason))
    yield kernel
    kernel.close()


def _mark(session: Session, seq: int, timeout: float = 10.0) -> dict[str, Any]:
    path = session.state_dir / snapshot.CHECKPOINT_MARK
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            body: dict[str, Any] = json.loads(path.read_text())
            if body["seq"] == seq:
                return body
        time.sleep(0.005)
    raise TimeoutError(f"no mark for checkpoint {seq}")


def _saved_names(session: Session) -> set[str]:
    document = json.loads((session.state_dir / "manifest.json").read_text())
    return set(document["values"])


def test_a_checkpoint_between_cells_is_what_a_flush_would_write(session: Session) -> None:
    session.cell("shared = [1, 2]\npair = (shared, shared)\nx = 41")
    session.capture.request_checkpoint(1)
    assert _mark(session, 1) == {"seq": 1, "ok": True, "reason": None, "abandoned": False}
    assert {"shared", "pair", "x"} <= _saved_names(session)
    # A mutation the cell scan cannot see is still caught: the check is exact.
    session.cell("def grow():\n    shared.append(3)", pause=True)
    session.cell("grow()")
    session.capture.request_checkpoint(2)
    assert _mark(session, 2)["ok"] is True
    report = session.resume()
    assert session.ns["shared"] == [1, 2, 3] and session.ns["pair"][0] is session.ns["shared"]
    assert "shared" in report["restored"]


def test_a_cell_that_starts_first_abandons_the_checkpoint(session: Session) -> None:
    session.shell.user_ns["np"] = np
    session.cell("big = np.arange(8_000_000.0)\ny = 1")
    capture = session.capture
    epoch = capture._epoch  # the request is taken here, between cells...
    session.cell("big += 1\ny = 2")  # ...and a cell starts before the thread gets to it
    capture._queue.put(_Checkpoint(epoch, 3))
    assert _mark(session, 3) == {"seq": 3, "ok": False, "reason": "a cell started",
                                 "abandoned": True}
    assert not (session.state_dir / "manifest.json").exists()  # nothing torn written
    capture.request_checkpoint(4)
    assert _mark(session, 4)["ok"] is True
    report = session.resume()
    assert session.ns["y"] == 2 and float(session.ns["big"][0]) == 1.0
    assert {"big", "y"} <= set(report["restored"])
