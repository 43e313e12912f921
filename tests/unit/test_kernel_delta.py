"""A standby's namespace brought forward checkpoint by checkpoint (``kernel.delta``):
only changed groups are loaded, unchanged ones keep their objects, deleted names
go, and what cannot be brought forward exactly is refused without a change."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nbfleet.kernel import delta
from nbfleet.kernel.capture import Capture
from nbfleet.kernel.restore import restore
from tests.support.kernel_shell import Session, shell


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    kernel = Session(shell(), tmp_path / "state")
    yield kernel
    kernel.close()


def _checkpoint(session: Session, into: Path) -> Path:
    """What the executor's checkpoint would hold now, kept in ``into``."""
    session.suspend()
    shutil.copytree(session.state_dir, into)
    return into


def _checkpoints(session: Session, tmp_path: Path, *cells: str) -> list[Path]:
    """Run each cell, keeping the checkpoint after each."""
    kept = []
    for index, code in enumerate(cells):
        session.cell(code)
        kept.append(_checkpoint(session, tmp_path / f"checkpoint-{index}"))
    return kept


def _standby(session: Session, first: Path, state_dir: Path) -> Capture:
    """A fresh kernel (the emptied shell) loaded from ``first``, as a standby is."""
    session.capture.stop()
    session._empty()
    shutil.copytree(first, state_dir)
    capture = Capture(session.shell, state_dir)
    capture.start()
    report = restore(session.shell, state_dir, capture, 5.0)
    assert not report["lost"], report
    session.capture = capture
    return capture


def _stage(later: Path, state_dir: Path) -> None:
    """The agent installs the later checkpoint as the kernel's state directory."""
    shutil.rmtree(state_dir)
    shutil.copytree(later, state_dir)


def _apply(session: Session, state_dir: Path) -> dict[str, Any]:
    return delta.apply(session.shell, state_dir, session.capture)


def test_only_what_changed_is_loaded_and_the_rest_keeps_its_objects(
        session: Session, tmp_path: Path) -> None:
    session.cell("big = list(range(100_000))\nshared = [1]\npair = (shared, shared)\n"
                 "gone = 'soon deleted'\nx = 1")
    session.cell("x")  # an Out entry
    first = _checkpoint(session, tmp_path / "a")
    session.cell("import numpy as np\nx = 2\nshared.append(2)\ndel gone\narr = np.arange(5)")
    session.cell("x * 10")
    later = _checkpoint(session, tmp_path / "b")

    state_dir = tmp_path / "standby"
    _standby(session, first, state_dir)
    big = session.ns["big"]
    assert session.ns["x"] == 1 and session.ns["gone"] == "soon deleted"

    _stage(later, state_dir)
    report = _apply(session, state_dir)
    assert "fresh" not in report, report
    ns = session.ns
    assert ns["x"] == 2 and ns["shared"] == [1, 2] and ns["pair"][0] is ns["shared"]
    assert "gone" not in ns and report["delta"]["removed"] == ["gone"]
    assert np.array_equal(ns["arr"], np.arange(5))
    assert ns["big"] is big, "an unchanged group was loaded again"
    assert report["delta"]["kept"] >= 1 and report["delta"]["loaded"] >= 2
    assert {"x", "shared", "pair", "arr", "big"} <= set(report["restored"])
    assert session.shell.execution_count == 5 and ns["_"] == 20
    assert report["lost"] == [] and report["changed"] == []


def test_a_setting_changed_since_is_refused_and_nothing_changes(
        session: Session, tmp_path: Path) -> None:
    session.cell("x = 1")
    first = _checkpoint(session, tmp_path / "a")
    try:
        session.cell("import os\nos.environ['NBF_DELTA_TEST'] = '1'\nx = 2")
        later = _checkpoint(session, tmp_path / "b")
        state_dir = tmp_path / "standby"
        _standby(session, first, state_dir)
        _stage(later, state_dir)
        report = _apply(session, state_dir)
    finally:
        os.environ.pop("NBF_DELTA_TEST", None)
    assert report == {"fresh": "settings changed (env)"}
    assert session.ns["x"] == 1


def test_no_apply_once_a_cell_ran_on_the_namespace(session: Session, tmp_path: Path) -> None:
    first, later = _checkpoints(session, tmp_path, "x = 1", "x = 2")
    state_dir = tmp_path / "standby"
    _standby(session, first, state_dir)
    session.cell("y = 3")  # a promoted kernel runs cells: its namespace is its own
    _stage(later, state_dir)
    assert _apply(session, state_dir) == {"fresh": "nothing loaded yet"}
    assert session.ns["x"] == 1 and session.ns["y"] == 3


def test_an_apply_that_fails_half_way_makes_the_next_one_fresh(
        session: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second, third = _checkpoints(session, tmp_path, "x = 1\ngone = 0",
                                        "x = 2\ndel gone\nnew = 3", "x = 4")
    state_dir = tmp_path / "standby"
    _standby(session, first, state_dir)
    _stage(second, state_dir)

    def broken(*args: object) -> object:
        raise RuntimeError("the kernel failed half-way")
    monkeypatch.setattr(delta.settings, "advance", broken)
    with pytest.raises(RuntimeError):
        _apply(session, state_dir)  # 'gone' is deleted and 'new' set already
    monkeypatch.undo()
    # The namespace is neither checkpoint's: the next apply is refused (the agent
    # then loads it into a new kernel).
    _stage(third, state_dir)
    assert _apply(session, state_dir) == {"fresh": "the last load was not exact"}


#: Set by a test: a Fragile value's unpickling then fails, as a value whose class
#: changed since it was saved would.
FRAGILE = {"fail": False}


def _fragile(value: int) -> Fragile:
    if FRAGILE["fail"]:
        raise RuntimeError("this value cannot be loaded here")
    return Fragile(value)


class Fragile:
    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _fragile, (self.value,)


def test_a_changed_value_that_does_not_load_is_gone_not_left_as_before(
        session: Session, tmp_path: Path) -> None:
    first, later = _checkpoints(
        session, tmp_path, "from tests.unit.test_kernel_delta import Fragile\n"
        "x = Fragile(1)\ny = 1", "x = Fragile(2)\ny = 2")
    state_dir = tmp_path / "standby"
    _standby(session, first, state_dir)
    assert session.ns["x"].value == 1
    _stage(later, state_dir)
    FRAGILE["fail"] = True
    try:
        report = _apply(session, state_dir)
    finally:
        FRAGILE["fail"] = False
    # A restore of the later checkpoint would not have x: neither has the standby,
    # and the report says it is lost, not restored.
    assert "x" not in session.ns and session.ns["y"] == 2
    assert "x" in {item["name"] for item in report["lost"]}, report
    assert "x" not in report["restored"] and "y" in report["restored"]
    _stage(later, state_dir)
    assert _apply(session, state_dir) == {"fresh": "the last load was not exact"}


def test_values_recomputed_at_the_last_load_are_not_brought_forward(
        session: Session, tmp_path: Path) -> None:
    first, later = _checkpoints(session, tmp_path, "x = 1", "x = 2")
    state_dir = tmp_path / "standby"
    capture = _standby(session, first, state_dir)
    assert capture.applied is not None
    # As if an unpicklable value (an open file) had been re-run from its cell.
    capture.applied.recomputed = ["log"]
    _stage(later, state_dir)
    assert _apply(session, state_dir) == {"fresh": "values were recomputed from their cells"}
    assert session.ns["x"] == 1
