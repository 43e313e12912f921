"""What a replayed cell may read from the namespace, and how it is recognized.

A replay sees the user's values; only three sorts may reach it: modules (only as
the root of ``module.function``), the allowlisted callables of
:mod:`nbfleet.kernel.allowlist` (matched by identity: ``from threading import
Lock`` binds the very object ``threading.Lock``), and plain data, which cannot run
code of its own because every type in it is a built-in one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

from nbfleet.kernel.allowlist import SAFE_CALLS

__all__ = ["MAX_BYTES", "MAX_ITEMS", "Namespace", "is_plain"]

MAX_ITEMS = 100_000
MAX_BYTES = 64 * 1024 * 1024


class Namespace:
    """What a recipe would see: the user's values and the recorded sources of the
    functions among them."""

    def __init__(self, values: Mapping[str, Any], definitions: Mapping[str, str] | None = None):
        self.values = values
        self.definitions = definitions or {}
        self._known: dict[int, str] | None = None

    def lookup(self, name: str) -> tuple[bool, Any]:
        try:
            return True, self.values[name]
        except KeyError:
            return False, None

    def known(self, value: object) -> str | None:
        """The SAFE_CALLS name of ``value``, matched by identity (``from threading import
        Lock`` binds the very object ``threading.Lock``); only loaded modules are looked at."""
        if self._known is None:
            self._known = dict(_resolve_safe_calls())
        return self._known.get(id(value))


def _resolve_safe_calls() -> Iterator[tuple[int, str]]:
    for dotted in SAFE_CALLS:
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = sys.modules.get(".".join(parts[:cut]))
            if module is not None:
                break
        else:
            continue
        obj: Any = module
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        if obj is not None:
            yield id(obj), dotted
    # IPython puts its own open() in the user namespace: io.open, refusing fds 0-2.
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    ipython_open = getattr(shell_module, "_modified_open", None)
    if ipython_open is not None:
        yield id(ipython_open), "builtins.open"


def is_plain(value: object, strict: bool = True) -> bool:
    """Inert built-in data (numbers, strings, containers of them, numeric arrays),
    bounded in size. ``strict`` refuses subclasses, whose methods could be anything."""
    numpy = sys.modules.get("numpy")
    todo, seen, items, size = [value], set(), 0, 0
    while todo:
        item = todo.pop()
        kind = type(item)
        items += 1
        if items > MAX_ITEMS:
            return False
        if kind in (str, bytes, bytearray) or (not strict and isinstance(item, str | bytes)):
            size += len(item)  # type: ignore[arg-type]
        elif kind in (int, float, complex, bool, type(None), range) or (
                not strict and isinstance(item, int | float)):
            pass
        elif kind in (list, tuple, set, frozenset, dict):
            if id(item) not in seen:
                seen.add(id(item))
                todo.extend(item.items() if isinstance(item, dict) else item)  # type: ignore
        elif (numpy is not None and (kind is numpy.ndarray or isinstance(item, numpy.generic))
              and kind.__module__ == "numpy" and not item.dtype.hasobject):  # type: ignore
            size += int(item.nbytes)  # type: ignore[attr-defined]
        else:
            return False
    return size <= MAX_BYTES
