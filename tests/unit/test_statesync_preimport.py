"""statesync.restore(): the modules a snapshot needs are imported while it downloads,
and the report names those the kernel did load, and those it was prepared with."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from nbfleet.agent import statesync

pytestmark = pytest.mark.no_db


class FakeKernel:
    """What statesync.restore() uses of a KernelProcess; ``loaded`` is its sys.modules."""

    def __init__(self, state_dir: Path, loaded: set[str], fails: bool = False) -> None:
        self.id = "k1"
        self.state_dir = str(state_dir)
        self.loaded = loaded
        self.fails = fails
        self.requests: list[tuple[str, dict[str, str] | None]] = []

    def own(self, path: str) -> None:
        pass

    async def execute_internal(self, code: str, timeout_s: float,
                               expressions: dict[str, str] | None = None) -> dict[str, Any]:
        self.requests.append((code, expressions))
        if expressions is None:
            return {"status": "ok"}
        if self.fails:
            raise TimeoutError()
        asked = ast.literal_eval(expressions["loaded"].split("set(", 1)[1].split(")", 1)[0])
        text = " ".join(sorted(set(asked) & self.loaded))
        return {"status": "ok", "user_expressions": {
            "loaded": {"status": "ok", "data": {"text/plain": repr(text)}}}}

    def announce(self, message: str) -> None:
        pass


def restore(kernel: FakeKernel, prepared: frozenset[str],
            preimport: tuple[str, ...]) -> dict[str, Any]:
    return asyncio.run(statesync.restore(None, "ws", kernel, "key", "warm",  # type: ignore
                                         prepared=prepared, preimport=preimport))


@pytest.fixture(autouse=True)
def no_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(statesync, "_install", lambda *args: 10)
    (tmp_path / "restore-report.json").write_text(json.dumps(
        {"restored": ["clf"], "recomputed": [], "lost": [], "imports": []}))


def test_modules_are_imported_before_the_restore_and_reported(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, {"numpy", "sklearn", "sklearn.linear_model", "scipy"})
    report = restore(kernel, frozenset({"sklearn", "sklearn.linear_model"}),
                     ("scipy", "no_such_module"))
    first, second = kernel.requests
    assert first[0].endswith("kernel._preimport('scipy,no_such_module')")
    assert second[0].endswith("kernel.restore(replay_budget_s=10.0)")  # after it
    assert report["prepared"] == ["sklearn", "sklearn.linear_model"]
    assert report["preimported"] == ["scipy"]  # only what did load
    assert report["restored"] == ["clf"]


def test_nothing_to_import_sends_no_request(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, set())
    report = restore(kernel, frozenset(), ())
    assert len(kernel.requests) == 1 and "prepared" not in report
    assert "preimported" not in report


def test_imports_that_time_out_do_not_stop_the_restore(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path, set(), fails=True)
    report = restore(kernel, frozenset(), ("scipy",))
    assert report["restored"] == ["clf"] and "preimported" not in report
