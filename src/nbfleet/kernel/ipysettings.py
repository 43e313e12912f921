"""IPython's configuration as state: matplotlib, ``%config``, magics, formatters.

What a notebook configured is captured as a change against the kernel's start
and put back on resume in dependency order: extensions, then the recorded
configuration calls (``%matplotlib inline``, ``init_printing()``: replayed as
typed, since what they register cannot be pickled), matplotlib's backend and
``rcParams`` (styles included), ``%config`` traits, magics and display formatters
defined in cells. The magics and formatters the old kernel had are then looked
for again, so any a replay did not bring back is reported by name.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib
import io
import sys
import types
from dataclasses import dataclass, field
from typing import Any

_OWN_EXTENSION = "nbfleet.kernel"
_MPL_SKIP = frozenset({"backend", "backend_fallback", "interactive"})
_MISSING = object()


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    lost: list[dict[str, str]] = field(default_factory=list)

    def fail(self, name: str, reason: str) -> None:
        self.lost.append({"name": name, "type": "kernel setting", "reason": reason[:500]})


def _magic_args(statement: str) -> list[object] | None:
    try:
        node = ast.parse(statement).body[0]
    except (SyntaxError, IndexError):
        return None
    call = getattr(node, "value", None)
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "run_line_magic" and call.args
            and all(isinstance(arg, ast.Constant) for arg in call.args)):
        return [arg.value for arg in call.args if isinstance(arg, ast.Constant)]
    return None


def magic_of(statement: str) -> str | None:
    """``m`` for a recorded ``get_ipython().run_line_magic('m', ...)`` statement."""
    args = _magic_args(statement)
    return args[0] if args and isinstance(args[0], str) else None


def label(statement: str) -> str:
    """How a recorded call reads in a report: ``%matplotlib inline`` as typed."""
    args = _magic_args(statement)
    return " ".join(["%" + str(args[0]), *map(str, args[1:2])]).strip() if args else statement


def _plain(value: Any, depth: int = 0) -> bool:
    if value is None or type(value) in (bool, int, float, str):
        return True
    if depth > 4:
        return False
    if type(value) in (list, tuple, set, frozenset):
        return all(_plain(item, depth + 1) for item in value)
    if type(value) is dict:
        return all(type(k) is str and _plain(v, depth + 1)
                   for k, v in value.items())
    return False


def _configurables(shell: Any) -> list[Any]:
    """``%config`` targets, and the display formatters (``%precision`` changes one)."""
    found: dict[int, Any] = {id(c): c for c in getattr(shell, "configurables", [])}
    formatter = getattr(shell, "display_formatter", None)
    for child in getattr(formatter, "formatters", {}).values():
        found.setdefault(id(child), child)
    return list(found.values())


def _traits(shell: Any) -> dict[tuple[str, str], object]:
    values: dict[tuple[str, str], object] = {}
    for configurable in _configurables(shell):
        owner = type(configurable).__name__
        for name in configurable.traits(config=True):
            with contextlib.suppress(Exception):
                value = getattr(configurable, name)
                if _plain(value):
                    values[(owner, name)] = copy.deepcopy(value)
    return values


def _magic_keys(shell: Any) -> set[tuple[str, str]]:
    magics = getattr(getattr(shell, "magics_manager", None), "magics", {})
    return {(kind, name) for kind, table in magics.items() for name in table}


def _qualified(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _formatter_keys(shell: Any) -> set[tuple[str, str]]:
    keys: set[tuple[str, str]] = set()
    formatter = getattr(shell, "display_formatter", None)
    for mime, child in getattr(formatter, "formatters", {}).items():
        keys |= {(mime, _qualified(kind)) for kind in getattr(child, "type_printers", {})}
        keys |= {(mime, f"{module}.{name}")
                 for module, name in getattr(child, "deferred_printers", {})}
    return keys


def _extensions(shell: Any) -> set[str]:
    return set(getattr(getattr(shell, "extension_manager", None), "loaded", ())) - {_OWN_EXTENSION}


@dataclass(frozen=True)
class Baseline:
    traits: dict[tuple[str, str], object]
    extensions: frozenset[str]
    magics: frozenset[tuple[str, str]]
    formatters: frozenset[tuple[str, str]]

    @classmethod
    def take(cls, shell: Any) -> Baseline:
        return cls(_traits(shell), frozenset(_extensions(shell)), frozenset(_magic_keys(shell)),
                   frozenset(_formatter_keys(shell)))


def _inline_active(shell: Any) -> bool:
    callbacks = getattr(getattr(shell, "events", None), "callbacks", {}).get("post_execute", [])
    return any(getattr(cb, "__name__", "") == "flush_figures"
               and str(getattr(cb, "__module__", "")).startswith("matplotlib_inline")
               for cb in callbacks)


def _matplotlib(shell: Any) -> dict[str, Any] | None:
    mpl: Any = sys.modules.get("matplotlib")
    if mpl is None:
        return None
    rc, start = mpl.rcParams, getattr(mpl, "rcParamsOrig", mpl.rcParamsDefault)
    changed = {}
    for key, value in dict.items(rc):  # plain dict access: no backend resolution, no warnings
        if key in _MPL_SKIP:
            continue
        try:
            same = bool(dict.get(start, key, _MISSING) == value)
        except Exception:
            same = False
        if not same:
            changed[key] = value
    backend = dict.get(rc, "backend")
    return {"rc": changed, "backend": backend if isinstance(backend, str) else None,
            "inline": _inline_active(shell)}


def _user_function(value: object, shell: Any) -> bool:
    return isinstance(value, types.FunctionType) and value.__globals__ is shell.user_ns


def _magics(shell: Any, base: Baseline) -> dict[str, Any]:
    functions, classes = [], []
    magics = shell.magics_manager.magics
    for kind, name in sorted(_magic_keys(shell) - base.magics):
        func = magics[kind][name]
        owner = getattr(func, "__self__", None)
        if _user_function(func, shell):
            functions.append((kind, name, func))
        elif (owner is not None and type(owner).__module__ == "__main__"
              and type(owner) not in classes):
            classes.append(type(owner))
    return {"functions": functions, "classes": classes,
            "names": sorted(_magic_keys(shell) - base.magics)}


def _formatters(shell: Any, base: Baseline) -> dict[str, Any]:
    functions = []
    for mime, child in shell.display_formatter.formatters.items():
        for kind, func in child.type_printers.items():
            if (mime, _qualified(kind)) not in base.formatters and _user_function(func, shell):
                functions.append((mime, kind, func))
    return {"functions": functions, "names": sorted(_formatter_keys(shell) - base.formatters)}


def capture(shell: Any, base: Baseline, calls: list[str]) -> dict[str, Any]:
    now = _traits(shell)
    traits: dict[str, dict[str, object]] = {}
    for (owner, name), value in now.items():
        before = base.traits.get((owner, name), _MISSING)
        try:
            differs = bool(before != value) if before is not _MISSING else True
        except Exception:
            differs = True
        if differs and before is _MISSING:
            differs = _differs_from_default(shell, owner, name, value)
        if differs:
            traits.setdefault(owner, {})[name] = value
    return {"calls": list(calls), "traits": traits, "matplotlib": _matplotlib(shell),
            "extensions": sorted(_extensions(shell) - base.extensions),
            "magics": _magics(shell, base), "formatters": _formatters(shell, base)}


def _differs_from_default(shell: Any, owner: str, name: str, value: object) -> bool:
    """A configurable created after the kernel started: compare with the trait's default."""
    for configurable in _configurables(shell):
        if type(configurable).__name__ == owner:
            try:
                return bool(configurable.trait_defaults(name) != value)
            except Exception:
                return True
    return True


def finish(shell: Any, doc: dict[str, Any]) -> Outcome:
    outcome = Outcome()
    if not doc:
        return outcome
    for name in doc.get("extensions", []):
        try:
            shell.extension_manager.load_extension(name)
            outcome.done.append(f"extension {name}")
        except Exception as error:
            outcome.fail(f"%load_ext {name}", f"loading it again failed: {error!r}")
    for statement in doc.get("calls", []):
        try:
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                exec(compile(statement, "<nbfleet setting>", "exec"), shell.user_ns)
            outcome.done.append(label(statement))
        except Exception as error:
            outcome.fail(label(statement), f"re-running it failed: {error!r}")
    if doc.get("matplotlib"):
        _finish_matplotlib(shell, doc["matplotlib"], outcome)
    _finish_traits(shell, doc.get("traits", {}), outcome)
    _finish_magics(shell, doc.get("magics", {}), outcome)
    _finish_formatters(shell, doc.get("formatters", {}), outcome)
    return outcome


def _finish_matplotlib(shell: Any, doc: dict[str, Any], outcome: Outcome) -> None:
    try:
        mpl: Any = importlib.import_module("matplotlib")
        if doc["inline"] and not _inline_active(shell):
            shell.enable_matplotlib("inline")
        elif doc["backend"] and not doc["inline"]:
            current = dict.get(mpl.rcParams, "backend")
            if not isinstance(current, str) or current.lower() != doc["backend"].lower():
                mpl.use(doc["backend"])
        outcome.done.append("matplotlib backend")
    except Exception as error:
        outcome.fail("matplotlib backend", f"setting it again failed: {error!r}")
        return
    failed = []
    for key, value in doc["rc"].items():
        try:
            mpl.rcParams[key] = value
        except Exception:
            failed.append(key)
    if doc["rc"]:
        outcome.done.append("matplotlib rcParams")
    for key in failed:
        outcome.fail(f"matplotlib rcParams[{key!r}]", "the saved value is not accepted here")


def _finish_traits(shell: Any, traits: dict[str, dict[str, object]], outcome: Outcome) -> None:
    targets: dict[str, list[Any]] = {}
    for configurable in _configurables(shell):
        targets.setdefault(type(configurable).__name__, []).append(configurable)
    for owner, values in traits.items():
        for name, value in values.items():
            try:
                if owner not in targets:
                    raise LookupError(f"this kernel has no {owner}")
                for configurable in targets[owner]:
                    setattr(configurable, name, copy.deepcopy(value))
                outcome.done.append(f"%config {owner}.{name}")
            except Exception as error:
                outcome.fail(f"%config {owner}.{name}", f"setting it again failed: {error}")


def _finish_magics(shell: Any, doc: dict[str, Any], outcome: Outcome) -> None:
    for kind, name, func in doc.get("functions", []):
        with contextlib.suppress(Exception):
            shell.register_magic_function(func, kind, name)
    for owner in doc.get("classes", []):
        with contextlib.suppress(Exception):
            shell.register_magics(owner)
    present = _magic_keys(shell)
    for kind, name in doc.get("names", []):
        prefix = "%" if kind == "line" else "%%"
        if (kind, name) in present:
            outcome.done.append(f"{prefix}{name}")
        else:
            outcome.fail(f"{prefix}{name}", "the magic is not registered after the resume "
                                            "(it was defined in a way nbfleet cannot repeat)")


def _finish_formatters(shell: Any, doc: dict[str, Any], outcome: Outcome) -> None:
    formatters = shell.display_formatter.formatters
    for mime, kind, func in doc.get("functions", []):
        with contextlib.suppress(Exception):
            formatters[mime].for_type(kind, func)
    present = _formatter_keys(shell)
    names = [tuple(key) for key in doc.get("names", [])]
    for mime, name in names:
        if (mime, name) not in present:
            outcome.fail(f"display formatter {mime} for {name}",
                         "it is not registered after the resume (the call that registered "
                         "it was not recorded)")
    back = sum(key in present for key in names)
    if back:
        outcome.done.append(f"display formatters ({back})")
