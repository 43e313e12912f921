"""Re-running recipes on restore: vetted again, isolated, and bounded in time.

A replay runs inside the kernel's main thread while the agent waits for the
restore to answer, so one that hangs (a sleep, a loop, a read from a pipe) would
hang the resume. All replays of one kernel share a budget (10 s by default; the
agent passes its own); past it, a timer interrupts the replay in progress and the
values still to be recomputed are reported lost. The interrupt is a
``BaseException`` raised from a SIGALRM handler, re-raised every 50 ms until the
replay gives up, which ``purity`` guarantees it will: a vetted cell never catches
``BaseException``. Outside the main thread (no signals there) a trace function
checks the clock instead.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import io
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbfleet.kernel import purity

BUDGET_ENV = "NBFLEET_REPLAY_BUDGET_S"
DEFAULT_BUDGET_S = 10.0
_REPEAT_S = 0.05


def budget_from_env() -> float:
    try:
        value = float(os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_S))
    except ValueError:
        return DEFAULT_BUDGET_S
    return value if value > 0 else DEFAULT_BUDGET_S


class ReplayTimeout(BaseException):
    """The replay budget is spent (a BaseException so ``except Exception`` cannot eat it)."""


class Deadline:
    """Raises :class:`ReplayTimeout` in the running code once ``seconds`` have passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = 0.0
        self.armed = False
        self._signals = (threading.current_thread() is threading.main_thread()
                         and hasattr(signal, "setitimer"))
        self._old_handler: Any = None
        self._old_timer: tuple[float, float] = (0.0, 0.0)
        self._old_trace: Any = None

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def disarm(self) -> None:
        self.armed = False

    def __enter__(self) -> Deadline:
        self.end = time.monotonic() + self.seconds
        if self._signals:
            self._old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
            self._old_timer = signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.001),
                                               _REPEAT_S)
        else:
            self._old_trace = sys.gettrace()
            sys.settrace(self._trace)
        self.armed = True  # last: nothing raises before the with body runs
        return self

    def __exit__(self, *exc: object) -> None:
        while True:  # the alarm may fire right here: disarm first, whatever happens
            try:
                self.armed = False
                break
            except ReplayTimeout:
                continue
        if self._signals:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old_handler)
            if self._old_timer[0] > 0:  # someone else's timer: give it back
                signal.setitimer(signal.ITIMER_REAL, *self._old_timer)
        else:
            sys.settrace(self._old_trace)

    def _on_alarm(self, signum: int, frame: types.FrameType | None) -> None:
        if self.armed and self.expired():
            raise ReplayTimeout()

    def _trace(self, frame: types.FrameType, event: str, arg: object) -> Any:
        if self.armed and self.expired():
            raise ReplayTimeout()
        return self._trace


@dataclass
class Outcome:
    values: dict[str, Any] = field(default_factory=dict)
    programs: dict[str, list[str]] = field(default_factory=dict)
    """What was run for each recomputed value: its recipe from now on."""
    lost: list[dict[str, str]] = field(default_factory=list)


def _fresh(value: object) -> object:
    """Plain data is copied, so a replay cannot change the user's values in place;
    modules and allowlisted callables are shared."""
    return copy.deepcopy(value) if purity.is_plain(value) else value


def replay(recipes: Mapping[str, list[str]], kinds: Mapping[str, str],
           namespace: Mapping[str, Any], definitions: Mapping[str, str],
           budget_s: float) -> Outcome:
    """Recompute each recipe's value within ``budget_s`` seconds in all."""
    outcome = Outcome()
    env = purity.Namespace(namespace, definitions)
    pending = sorted(recipes)
    done: set[str] = set()

    def lose(name: str, reason: str) -> None:
        outcome.lost.append({"name": name, "type": str(kinds.get(name, "?")), "reason": reason})
        done.add(name)

    try:
        with Deadline(budget_s) as deadline:
            for name in pending:
                if deadline.expired():
                    break
                verdict = purity.check(recipes[name], env)
                if not verdict.safe:
                    lose(name, purity.not_rerun(verdict.reason))
                    continue
                value, error = _run(name, verdict, namespace)
                if isinstance(error, ReplayTimeout | KeyboardInterrupt):
                    deadline.disarm()
                    lose(name, "re-running the cell that made it was interrupted"
                         if isinstance(error, KeyboardInterrupt) else
                         f"re-running the cell that made it took longer than {budget_s:g} s, "
                         "so it was stopped")
                    break
                if error is not None:
                    lose(name, f"re-running the cell that made it failed: {error!r}"[:500])
                else:
                    outcome.programs[name] = list(verdict.program)
                    outcome.values[name] = value
                    done.add(name)
    except (ReplayTimeout, KeyboardInterrupt):  # fired between two replays
        pass
    for name in pending:
        if name not in done:
            outcome.values.pop(name, None)
            lose(name, f"it was not re-run: replays may take {budget_s:g} s in all on resume, "
                       "and the time was used up")
    return outcome


def _run(name: str, verdict: purity.Verdict,
         namespace: Mapping[str, Any]) -> tuple[Any, BaseException | None]:
    scratch: dict[str, Any] = {"__builtins__": builtins, "__name__": "__main__"}
    try:
        for input_name in verdict.inputs:
            scratch[input_name] = _fresh(namespace[input_name])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for index, source in enumerate(verdict.program):
                exec(compile(source, f"<nbfleet replay {name} #{index + 1}>", "exec"), scratch)
        return scratch[name], None
    except BaseException as error:  # SystemExit, timeouts and interrupts included
        return None, error
