"""replay.replay(): recipes are vetted again, isolated, and stopped at the time budget."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nbfleet.kernel.replay import Outcome, replay


def run(recipes: dict[str, list[str]], namespace: dict[str, Any] | None = None,
        budget_s: float = 5.0) -> tuple[Outcome, float]:
    started = time.monotonic()
    outcome = replay(recipes, dict.fromkeys(recipes, "builtins.generator"),
                     {"threading": threading, **(namespace or {})}, {}, budget_s)
    return outcome, time.monotonic() - started


def reasons(outcome: Outcome) -> dict[str, str]:
    return {item["name"]: item["reason"] for item in outcome.lost}


def test_a_safe_recipe_is_recomputed() -> None:
    outcome, _ = run({"lock": ["lock = threading.Lock()"],
                      "gen": ["gen = (i * i for i in range(4))"]})
    assert outcome.lost == []
    assert list(outcome.values["gen"]) == [0, 1, 4, 9]
    assert outcome.values["lock"].acquire(blocking=False)
    assert outcome.programs["lock"] == ["lock = threading.Lock()"]


def test_a_replay_that_sleeps_is_stopped_at_the_budget() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    cell = "import time\ntime.sleep(delay)\nlock = threading.Lock()"
    outcome, elapsed = run({"lock": [cell], "zgen": ["zgen = iter(range(3))"]},
                           {"delay": 60}, budget_s=0.5)
    assert elapsed < 3
    lost = reasons(outcome)
    assert lost["lock"] == ("re-running the cell that made it took longer than 0.5 s, "
                            "so it was stopped")
    assert "the time was used up" in lost["zgen"]  # nothing runs after the budget
    assert outcome.values == {}
    # The kernel's own signal handling is as it was.
    assert signal.getsignal(signal.SIGALRM) is handler
    if handler is signal.SIG_DFL:  # nobody else's timer: none is left running
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize("cell", [
    "while True:\n    pass\nlock = threading.Lock()",
    "import time\ntry:\n    time.sleep(60)\nexcept Exception:\n    pass\nlock = threading.Lock()",
    "import time\nfor _ in range(10 ** 9):\n    try:\n        time.sleep(1)\n"
    "    except (RuntimeError, Exception):\n        continue\nlock = threading.Lock()",
])
def test_loops_and_handlers_cannot_outlast_the_budget(cell: str) -> None:
    outcome, elapsed = run({"lock": [cell]}, budget_s=0.3)
    assert elapsed < 3
    assert "took longer than 0.3 s" in reasons(outcome)["lock"]


def test_the_budget_also_holds_outside_the_main_thread() -> None:
    """No signals there: a trace function checks the clock instead."""
    result: list[tuple[Outcome, float]] = []
    worker = threading.Thread(target=lambda: result.append(
        run({"lock": ["while True:\n    pass\nlock = threading.Lock()"]}, budget_s=0.3)))
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    outcome, elapsed = result[0]
    assert elapsed < 3 and "took longer" in reasons(outcome)["lock"]


def test_an_unsafe_recipe_from_an_older_snapshot_is_not_run(tmp_path: Path) -> None:
    """Snapshots written before recipes were vetted may hold unsafe ones: the replay
    checks again and runs nothing."""
    log = tmp_path / "run.log"
    cell = f"with open({str(log)!r}, 'a') as out:\n    out.write('x\\n')\nlock = threading.Lock()"
    outcome, _ = run({"lock": [cell]})
    assert not log.exists()
    assert reasons(outcome)["lock"] == (
        "the cell that made it writes files (open(..., 'a')), so it is not re-run on resume")


def test_the_replay_cannot_change_the_users_values() -> None:
    rows = [1, 2, 3]
    outcome, _ = run({"gen": ["rows.append(4)\ngen = iter(rows)"]}, {"rows": rows})
    assert list(outcome.values["gen"]) == [1, 2, 3, 4]
    assert rows == [1, 2, 3]  # the replay worked on a copy


def test_a_failing_replay_is_reported_and_the_rest_go_on() -> None:
    outcome, _ = run({"a": ["a = iter([1 / 0])"], "b": ["b = threading.RLock()"]})
    assert "re-running the cell that made it failed: ZeroDivisionError" in reasons(outcome)["a"]
    assert set(outcome.values) == {"b"}


def test_output_of_a_replay_is_not_shown(capsys: pytest.CaptureFixture[str]) -> None:
    run({"gen": ["print('loading')\ngen = iter(range(2))"]})
    assert capsys.readouterr().out == ""
