"""The warnings a notebook has already been shown, and its warning filters.

Python shows a warning under the "default" action once per place: the place's
module keeps a ``__warningregistry__``. A resumed kernel starts with empty
registries, so a cell run after a resume printed again a warning the notebook had
already shown (seen on statsmodels' own examples: a ``ConvergenceWarning`` came
back). Registries are saved as plain data (text, the category's import path, the
line) and put back into the modules loaded by then; filters the notebook changed
(``warnings.simplefilter``) come back too.

A registry only counts while its ``version`` equals the interpreter's filter
version, which CPython does not expose: :func:`_filters_version` reads it from a
registry that a warning of its own sets.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types
import warnings
from typing import Any

__all__ = ["baseline", "capture", "restore"]

REGISTRY = "__warningregistry__"
LIMIT = 2000
#: The module a warning is attributed to while the filter version is read.
_PROBE_MODULE = "nbfleet_warning_version_probe"


def baseline() -> list[Any]:
    return list(warnings.filters)


def _category_ref(category: object) -> list[str] | None:
    if isinstance(category, type) and issubclass(category, Warning):
        return [category.__module__, category.__qualname__]
    return None


def _category(ref: list[str]) -> type[Warning] | None:
    """The class, from a module already loaded (never an import: it could run anything)."""
    value: Any = sys.modules.get(ref[0])
    try:
        for part in ref[1].split("."):
            value = getattr(value, part)
    except Exception:  # a module's __getattr__ may raise anything
        return None
    return value if isinstance(value, type) and issubclass(value, Warning) else None


def _pattern(value: object) -> list[Any] | None:
    """A filter's message or module: a compiled pattern, or (the interpreter's own
    default filters) a plain string that must equal the module's name."""
    if isinstance(value, re.Pattern):
        return ["re", value.pattern, value.flags]
    if isinstance(value, str):
        return ["str", value]
    return None


def _unpattern(saved: list[Any] | None) -> re.Pattern[str] | str | None:
    if not saved:
        return None
    return re.compile(saved[1], saved[2]) if saved[0] == "re" else str(saved[1])


def _shown(registry: object) -> list[list[Any]]:
    if not isinstance(registry, dict):
        return []
    entries = []
    for key, seen in list(registry.items()):
        if not (seen and isinstance(key, tuple) and len(key) == 3):
            continue
        text, category, lineno = key
        ref = _category_ref(category)
        if isinstance(text, str) and isinstance(lineno, int) and ref is not None:
            entries.append([text, ref, lineno])
    return entries


def _namespace(module: object) -> dict[str, Any] | None:
    """A real module's own dict, read without running anything: ``vars()`` would load
    a lazily imported module (``importlib.util.LazyLoader``)."""
    if not isinstance(module, types.ModuleType):
        return None
    try:
        namespace = object.__getattribute__(module, "__dict__")
    except AttributeError:
        return None
    return namespace if isinstance(namespace, dict) else None


def _registry_of(module: object, version: int | None) -> object:
    """The module's registry if it is current: a registry of an older filter version
    is void (the interpreter clears it at the next warning), so it is not kept."""
    namespace = _namespace(module)
    registry = namespace.get(REGISTRY) if namespace is not None else None
    if isinstance(registry, dict) and version is not None and registry.get("version") == version:
        return registry
    return None


def capture(shell: Any, start_filters: list[Any]) -> dict[str, Any]:
    """Picklable data only: no classes, patterns or registries by reference."""
    shown: dict[str, list[list[Any]]] = {}
    total = 0
    version = _filters_version()
    user_ns = getattr(shell, "user_ns", {})
    main = user_ns.get(REGISTRY)
    current = isinstance(main, dict) and version is not None and main.get("version") == version
    modules = [("__main__", _shown(main) if current else [])] + [
        (name, _shown(_registry_of(module, version)))
        for name, module in list(sys.modules.items()) if name != "__main__"]
    for name, entries in modules:
        if entries and total < LIMIT:
            shown[name] = entries[:LIMIT - total]
            total += len(shown[name])
    doc: dict[str, Any] = {"shown": shown}
    if list(warnings.filters) != start_filters:
        doc["filters"] = [[action, _pattern(message), _category_ref(category),
                           _pattern(module), lineno]
                          for action, message, category, module, lineno in warnings.filters]
    return doc


def _rebuilt_filters(saved: list[list[Any]]) -> list[tuple[Any, ...]] | None:
    filters = []
    for action, message, category_ref, module, lineno in saved:
        category = _category(category_ref) if category_ref else None
        if category is None:
            return None
        filters.append((action, _unpattern(message), category, _unpattern(module), lineno))
    return filters


def _filters_version() -> int | None:
    """The interpreter's filter version, read from a registry that a warning of our
    own sets. An ``ignore`` filter for exactly that warning goes first in the list for
    the call, added and removed without ``_filters_mutated()`` (which would change
    the version and void every registry): the notebook's own filters never see it."""
    live: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at runtime
    probe = ("ignore", None, PendingDeprecationWarning, _PROBE_MODULE, 0)
    registry: dict[Any, Any] = {}
    live.insert(0, probe)
    try:
        warnings.warn_explicit("probe", PendingDeprecationWarning, "<nbfleet>", 0,
                               module=_PROBE_MODULE, registry=registry)
    finally:
        with contextlib.suppress(ValueError):  # another thread reset the filters
            live.remove(probe)
    version = registry.get("version")
    return version if isinstance(version, int) else None


def restore(shell: Any, doc: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """(settings put back, [(setting, why not)]); run once the imports are back."""
    done: list[str] = []
    lost: list[tuple[str, str]] = []
    if "filters" in doc:
        filters = _rebuilt_filters(doc["filters"])
        mutated = getattr(warnings, "_filters_mutated", None)  # CPython 3.11 to 3.13
        if filters is None:
            lost.append(("warning filters", "a filter's warning category is not loaded"))
        elif not callable(mutated):
            lost.append(("warning filters", "this Python's warnings module is not supported"))
        else:
            live: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at runtime
            live[:] = filters
            mutated()
            done.append("warning filters")
    shown = doc.get("shown", {})
    if not shown:
        return done, lost
    version = _filters_version()
    if version is None:
        lost.append(("warnings already shown", "the interpreter's filter version is unknown"))
        return done, lost
    applied = skipped = 0
    for name, entries in shown.items():
        owner = shell.user_ns if name == "__main__" else _namespace(sys.modules.get(name))
        registry = owner.setdefault(REGISTRY, {}) if owner is not None else None
        if not isinstance(registry, dict):
            skipped += len(entries)  # not imported again yet: may show once more
            continue
        if registry.get("version") != version:
            registry.clear()
            registry["version"] = version
        for text, ref, lineno in entries:
            category = _category(ref)
            if category is None:
                skipped += 1
            else:
                registry[(text, category, lineno)] = True
                applied += 1
    if applied:
        done.append("warnings already shown")
    if skipped:
        lost.append(("warnings already shown" if not applied else "some warnings already shown",
                     f"{skipped} of {applied + skipped} belong to modules or categories not "
                     "loaded again yet: they may show once more"))
    return done, lost
