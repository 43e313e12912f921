"""statesync.restore(): the agent passes the replay budget, and a restore that outruns
its backstop timeout is interrupted (or the kernel restarted), never waited on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from nbfleet.agent import statesync


class FakeKernel:
    """Just what statesync.restore() uses of a KernelProcess."""

    def __init__(self, state_dir: Path, stops: bool, reply: dict[str, Any] | None = None):
        self.id = "k1"
        self.state_dir = str(state_dir)
        self.stops = stops
        self.reply = reply
        self.code: list[str] = []
        self.calls: list[str] = []
        self.told: list[str] = []

    def own(self, path: str) -> None:
        pass

    async def execute_internal(self, code: str, timeout_s: float) -> dict[str, Any]:
        self.code.append(code)
        if self.reply is not None:
            return self.reply
        raise TimeoutError()

    async def interrupt(self) -> None:
        self.calls.append("interrupt")
        if self.stops:  # the replay loop stops and writes its report
            report = {"restored": ["x"], "recomputed": [], "imports": [],
                      "lost": [{"name": "g", "type": "builtins.generator",
                                "reason": "re-running the cell that made it was interrupted"}]}
            (Path(self.state_dir) / "restore-report.json").write_text(json.dumps(report))

    async def wait_idle(self, timeout_s: float) -> bool:
        return self.stops

    async def restart(self) -> None:
        self.calls.append("restart")

    def announce(self, message: str) -> None:
        self.told.append(message)


@pytest.fixture(autouse=True)
def no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statesync, "_install", lambda *args: 10)


def restore(kernel: FakeKernel) -> dict[str, Any]:
    return asyncio.run(statesync.restore(None, "ws", kernel, "key", "cold"))  # type: ignore[arg-type]


def test_the_replay_budget_is_passed_to_the_kernel(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(statesync.REPLAY_BUDGET_ENV, "2.5")
    (tmp_path / "restore-report.json").write_text(json.dumps(
        {"restored": [], "recomputed": [], "lost": [], "imports": []}))
    kernel = FakeKernel(tmp_path, stops=True, reply={"status": "ok"})
    assert restore(kernel)["files_only"] is False
    assert kernel.code[0].endswith("kernel.restore(replay_budget_s=2.5)")


def test_a_restore_past_the_backstop_is_interrupted_and_keeps_its_report(
        tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, stops=True)
    report = restore(kernel)
    assert kernel.calls == ["interrupt"]
    assert report["files_only"] is False and report["restored"] == ["x"]
    assert report["lost"][0]["reason"] == "re-running the cell that made it was interrupted"
    assert "Not restored: g" in kernel.told[0]


def test_a_kernel_that_ignores_the_interrupt_is_restarted(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, stops=False)
    report = restore(kernel)
    assert kernel.calls == ["interrupt", "restart"]
    assert report["files_only"] is True
    assert "took longer than 300 s" in report["error"]
    assert "corrupt" not in report["error"]  # a timeout is not a corrupt snapshot
