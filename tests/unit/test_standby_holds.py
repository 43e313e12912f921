"""What a standby says its kernels hold (``Standby.holds``): a promotion skips the
restore only for a kernel that holds the asked checkpoint in memory, exactly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from nbfleet.agent.standbys import Staged, Standby


def _standby(report: dict[str, Any] | None = None) -> tuple[Standby, SimpleNamespace]:
    kernel = SimpleNamespace(restarts=0, execution_state="idle")
    standby = Standby("ws", 1, cast(Any, None))
    standby.kernels["k"] = cast(Any, kernel)
    standby.staged["k"] = Staged("key1", 3, "/nowhere",
                                 report if report is not None else {"restored": ["x"]})
    standby.loaded["k"] = 0
    return standby, kernel


def test_a_loaded_kernel_holds_its_checkpoint_and_no_other() -> None:
    standby, _ = _standby()
    assert standby.holds("k", "key1") and not standby.is_fresh("k")
    assert not standby.holds("k", "key2") and not standby.holds("k", None)
    assert standby.state() == {"k": {"key": "key1", "cell": 3}}


def test_a_kernel_that_restarted_since_its_load_holds_nothing() -> None:
    standby, kernel = _standby()
    kernel.restarts = 1  # it died and came back empty
    assert not standby.holds("k", "key1") and standby.is_fresh("k")
    assert standby.state() == {"k": {"key": None, "cell": None}}


def test_a_dead_kernel_holds_nothing() -> None:
    standby, kernel = _standby()
    kernel.execution_state = "dead"
    assert not standby.holds("k", "key1")


def test_a_load_that_did_not_finish_or_recomputed_values_holds_nothing() -> None:
    standby, _ = _standby()
    standby.staged["k"].report = None
    assert not standby.holds("k", "key1")
    recomputed, _ = _standby({"restored": [], "recomputed": ["log"]})
    assert not recomputed.holds("k", "key1")
