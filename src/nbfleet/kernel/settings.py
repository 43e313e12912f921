"""Kernel settings that are state too, though no variable holds them.

A notebook that chdirs, extends ``sys.path``, sets an environment variable or
seeds a random generator continues differently if a resume resets them; so do
``In``, ``Out`` and the execution counter. Each is captured at flush as a change
against the kernel's own start (:class:`Baseline`, taken when the extension
loads), so a resumed kernel gets the notebook's changes on top of its own
defaults. IPython's own configuration (matplotlib, ``%config``, magics, display
formatters) is in :mod:`nbfleet.kernel.ipysettings`. Whatever cannot be put
back is reported by name.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

from nbfleet.kernel import gpu, ipysettings, warnstate
from nbfleet.kernel.ipysettings import Outcome

__all__ = ["SETTING", "Baseline", "CallLog", "Outcome", "capture", "finish", "prepare"]

SETTING = "kernel setting"
"""The ``type`` of a setting in a report's ``lost`` list."""


@dataclass(frozen=True)
class Baseline:
    environ: dict[str, str]
    path: list[str]
    cwd: str
    ipython: ipysettings.Baseline
    warning_filters: list[Any]

    @classmethod
    def take(cls, shell: Any) -> Baseline:
        return cls(dict(os.environ), list(sys.path), os.getcwd(), ipysettings.Baseline.take(shell),
                   warnstate.baseline())


class CallLog:
    """Configuration calls in the order they last ran; one ``%matplotlib`` at most."""

    LIMIT = 50

    def __init__(self, calls: list[str] | None = None) -> None:
        self.calls: list[str] = list(calls or [])

    def record(self, statements: tuple[str, ...] | list[str]) -> None:
        for statement in statements:
            magic = ipysettings.magic_of(statement)
            self.calls = [c for c in self.calls if c != statement
                          and (magic != "matplotlib" or ipysettings.magic_of(c) != magic)]
            self.calls.append(statement)
        del self.calls[:-self.LIMIT]


def _skipped(name: str) -> bool:
    """The kernel's own variables: set per kernel (or per cell), never restored."""
    return name.startswith("NBFLEET_") or name in gpu.ENV_NAMES


def _history(shell: Any) -> Any:
    return getattr(shell, "history_manager", None)


def capture(shell: Any, baseline: Baseline, calls: CallLog) -> dict[str, Any]:
    """The settings as they are now, as changes against ``baseline`` (picklable)."""
    doc: dict[str, Any] = {
        "cwd": {"start": baseline.cwd, "now": os.getcwd()},
        "path": {"start": baseline.cwd, "base": baseline.path, "now": list(sys.path)},
        "env": {"set": {k: v for k, v in os.environ.items()
                        if not _skipped(k) and baseline.environ.get(k) != v},
                "unset": sorted(k for k in baseline.environ
                                if k not in os.environ and not _skipped(k))},
        "random": random.getstate(),
        "execution_count": int(getattr(shell, "execution_count", 1)),
        "ipython": ipysettings.capture(shell, baseline.ipython, calls.calls),
    }
    try:  # a warning registry is a best effort: it never fails a suspend
        doc["warnings"] = warnstate.capture(shell, baseline.warning_filters)
    except Exception as error:
        doc["warnings"] = {"error": repr(error)[:300]}
    np: Any = sys.modules.get("numpy")
    if np is not None:
        doc["numpy.random"] = np.random.get_state()
    history = _history(shell)
    if history is not None:
        doc["inputs"] = (list(history.input_hist_parsed), list(history.input_hist_raw))
    return doc


def _rebase(path: str, old: str, new: str) -> str:
    """A path under the old kernel's start directory, moved under the new one's."""
    if old and new and old != new and (path == old or path.startswith(old.rstrip(os.sep) + os.sep)):
        return new + path[len(old):]
    return path


def prepare(doc: dict[str, Any], baseline: Baseline) -> Outcome:
    """Before imports and values are loaded: the directory, ``sys.path``, the environment."""
    outcome = Outcome()
    env = doc.get("env", {})
    if env.get("set") or env.get("unset"):
        os.environ.update({k: v for k, v in env.get("set", {}).items() if not _skipped(k)})
        for name in env.get("unset", []):
            os.environ.pop(name, None)
        outcome.done.append("environment variables")
    cwd = doc.get("cwd", {})
    if cwd and cwd["now"] != cwd["start"]:
        target = _rebase(cwd["now"], cwd["start"], baseline.cwd)
        try:
            os.chdir(target)
        except OSError as error:
            outcome.fail("working directory", f"cannot change to {target}: {error}")
        else:
            outcome.done.append("working directory")
    path = doc.get("path", {})
    if path and path["now"] != path["base"]:
        _restore_path(path, baseline.cwd)
        outcome.done.append("sys.path")
    return outcome


def _restore_path(path: dict[str, Any], start: str) -> None:
    """The old kernel's order and additions, without its own entries this one lacks."""
    base, now = set(path["base"]), path["now"]
    removed = {_rebase(p, path["start"], start) for p in path["base"] if p not in set(now)}
    result: list[str] = []
    for entry in now:
        moved = _rebase(entry, path["start"], start)
        if (entry in base and moved not in sys.path) or moved in result:
            continue
        result.append(moved)
    result += [p for p in sys.path if p not in result and p not in removed]
    sys.path[:] = result


def finish(shell: Any, doc: dict[str, Any], outputs: dict[Any, object] | None) -> Outcome:
    """After values are loaded: IPython's settings, history, counter, warning filters
    and registries, then the RNGs last (nothing a restore runs may draw from them
    afterwards)."""
    done = ipysettings.finish(shell, doc.get("ipython", {}))
    _restore_history(shell, doc, outputs, done)
    _restore_warnings(shell, doc, done)
    _restore_random(doc, done)
    return done


def advance(shell: Any, doc: dict[str, Any], outputs: dict[Any, object] | None) -> Outcome:
    """What changes with every cell, for a standby brought forward (``delta``):
    history, counter and RNGs. The rest it has already, or ``delta`` says fresh."""
    done = Outcome()
    _restore_history(shell, doc, outputs, done)
    _restore_random(doc, done)
    return done


def _restore_warnings(shell: Any, doc: dict[str, Any], done: Outcome) -> None:
    warned = doc.get("warnings", {})
    try:
        restored, lost = warnstate.restore(shell, warned)
    except Exception as error:  # never a reason to fail the resume
        restored, lost = [], [("warnings already shown", repr(error))]
    if "error" in warned:
        lost.append(("warnings already shown", f"not saved at suspend: {warned['error']}"))
    done.done += restored
    for name, reason in lost:
        done.fail(name, reason)


def _restore_random(doc: dict[str, Any], done: Outcome) -> None:
    """Last: nothing a restore runs may draw from them afterwards."""
    if "random" in doc:
        try:
            random.setstate(doc["random"])
            done.done.append("random state")
        except (TypeError, ValueError) as error:
            done.fail("random state", repr(error))
    if "numpy.random" in doc:
        try:
            importlib.import_module("numpy").random.set_state(doc["numpy.random"])
            done.done.append("numpy.random state")
        except Exception as error:
            done.fail("numpy.random state", repr(error))


def _restore_history(shell: Any, doc: dict[str, Any], outputs: dict[Any, object] | None,
                     outcome: Outcome) -> None:
    history = _history(shell)
    hidden: dict[str, object] = {}
    if history is not None and "inputs" in doc:
        parsed, raw = doc["inputs"]
        history.input_hist_parsed[:] = parsed
        history.input_hist_raw[:] = raw
        hidden.update({f"_i{n}": source for n, source in enumerate(parsed) if n})
        last = [*reversed(parsed[-3:]), "", "", ""]
        hidden.update({"_i": last[0], "_ii": last[1], "_iii": last[2]})
        outcome.done.append("In")
    if history is not None and outputs is not None:
        history.output_hist.clear()
        history.output_hist.update(outputs)
        hidden.update({f"_{n}": value for n, value in outputs.items()})
        recent = [*(outputs[k] for k in reversed(sorted(outputs)[-3:])), "", "", ""]
        for under, value in zip(("_", "__", "___"), recent, strict=False):
            hidden[under] = value
            setattr(shell.displayhook, under, value)
        outcome.done.append("Out")
    shell.user_ns.update(hidden)
    shell.user_ns_hidden.update(hidden)
    if "execution_count" in doc:
        shell.execution_count = doc["execution_count"]
        outcome.done.append("execution count")
