"""Idle auto-suspend decisions: quiet is not idle, busy is never culled."""

from __future__ import annotations

import pytest

from nbfleet.control.culler import Candidate, idle_ones
from nbfleet.policy.idle import KernelActivity, idle_seconds, should_suspend
from nbfleet.protocol.agent import KernelModel


def kernel(state: str = "idle", connections: int = 0, idle_s: float = 7200.0) -> KernelActivity:
    return KernelActivity(state, connections, idle_s)


@pytest.mark.parametrize(
    ("kernels", "running_s", "expected"),
    [
        ([kernel(idle_s=100), kernel(idle_s=50)], 1000, 50),  # the most recent activity counts
        ([kernel(idle_s=100)], 30, 30),  # resumed 30 s ago: idle for 30 s at most
        ([], 500, 500),  # no kernel at all: idle since it started
        ([kernel("dead", idle_s=90)], 1000, 90),
        ([kernel("busy", idle_s=99999)], 99999, None),  # silent but running a cell
        ([kernel("starting")], 99999, None),
        ([kernel("restarting")], 99999, None),
        ([kernel(connections=1)], 99999, None),  # a client is attached
        ([kernel(), kernel("busy")], 99999, None),  # one busy kernel keeps it alive
    ],
)
def test_idle_seconds(kernels: list[KernelActivity], running_s: float,
                      expected: float | None) -> None:
    assert idle_seconds(kernels, running_s) == expected


def test_should_suspend_respects_the_timeout_and_zero_means_never() -> None:
    assert should_suspend([kernel(idle_s=600)], 10_000, 600)
    assert not should_suspend([kernel(idle_s=599)], 10_000, 600)
    assert not should_suspend([kernel(idle_s=10**9)], 10**9, 0)
    assert not should_suspend([kernel("busy", idle_s=10**9)], 10**9, 1)


def _candidate(ws: str, kernels: set[str], url: str = "http://h1") -> Candidate:
    return Candidate(ws, url, 1, 10_000.0, 600.0, frozenset(kernels))


def _model(kid: str, state: str = "idle", idle_s: float = 3600.0,
           connections: int = 0) -> KernelModel:
    return KernelModel(id=kid, name="python3", workspace_id="ws", execution_state=state,
                       last_activity="2026-01-01T00:00:00.000000Z", idle_s=idle_s,
                       connections=connections, last_death=None)


def test_idle_ones_picks_only_idle_workspaces_and_skips_unreported_kernels() -> None:
    found = [_candidate("ws_idle", {"k1"}), _candidate("ws_busy", {"k2"}),
             _candidate("ws_missing", {"k3", "k4"}), _candidate("ws_h2", {"k5"}, "http://h2"),
             _candidate("ws_empty", set())]
    models = {"http://h1": [_model("k1"), _model("k2", "busy"), _model("k3"),
                            _model("k9")]}  # k4 unreported; h2 did not answer
    chosen = [c.workspace_id for c in idle_ones(found, models)]
    assert chosen == ["ws_idle", "ws_empty"]
