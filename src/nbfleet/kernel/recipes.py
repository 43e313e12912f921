"""Cell histories that can recompute a value nobody can pickle (open files, locks,
generators), and the rule for when replaying them on resume is safe.

Replay runs the cells again in a scratch copy of the restored namespace and
keeps only the target name, so it is safe only if those cells did nothing else
that matters: they all succeeded, used no magic, changed no other user object
in place, and read no other value that itself could not be restored.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nbfleet.kernel import cellscan

MAX_CELLS = 20
MAX_BYTES = 256 * 1024

_ATOMIC = (int, float, complex, str, bytes, bool, type(None), range, frozenset,
           types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)


def can_change_in_place(value: object) -> bool:
    """Whether a cell could have mutated ``value`` (a str passed to open() cannot)."""
    if isinstance(value, tuple):
        return len(value) > 64 or any(not isinstance(item, _ATOMIC) for item in value)
    return not isinstance(value, _ATOMIC)


@dataclass(frozen=True)
class CellRecord:
    source: str
    success: bool
    uses_magic: bool
    changes: frozenset[str]
    """User names holding mutable values that the cell may have changed in place."""
    reads: frozenset[str]


@dataclass(frozen=True)
class Recipe:
    sources: list[str]
    reason: str
    """Why there is no recipe, when ``sources`` is empty."""


class RecipeBook:
    """For every user name, the cells that produced its current value."""

    def __init__(self) -> None:
        self._cells: dict[str, list[CellRecord]] = {}
        self._missing: dict[str, str] = {}

    def record(self, cell: CellRecord, defined: Iterable[str], rebuilt: Iterable[str],
               mutated: Iterable[str]) -> None:
        """``defined``: bound afresh here; ``rebuilt``: rebound from its own old value
        (``x = x + 1``) and ``mutated``: changed in place, both extending the history."""
        for name in defined:
            self._missing.pop(name, None)
            self._cells[name] = [cell]
        for name in [*rebuilt, *mutated]:
            cells = self._cells.get(name)
            if cells is None:
                self._missing.setdefault(name, "it existed before its history was recorded")
                continue
            cells.append(cell)
            if len(cells) > MAX_CELLS or sum(len(c.source) for c in cells) > MAX_BYTES:
                del self._cells[name]
                self._missing[name] = (
                    f"its history is longer than {MAX_CELLS} cells or {MAX_BYTES // 1024} KiB")

    def forget(self, name: str) -> None:
        self._cells.pop(name, None)
        self._missing.pop(name, None)

    def seed(self, name: str, sources: list[str], footprints: Mapping[str, frozenset[str]]) -> None:
        """Adopt a recipe carried over from a previous kernel (it was safe there)."""
        records = []
        for source in sources:
            scan = cellscan.scan(source, footprints)
            records.append(CellRecord(source, True, False, frozenset(),
                                      scan.loaded | scan.mutated))
        self._missing.pop(name, None)
        self._cells[name] = records

    def recipe(self, name: str, unpicklable: set[str]) -> Recipe:
        """The cells to replay for ``name``, or why replaying them would not be safe."""
        cells = self._cells.get(name)
        if cells is None:
            return Recipe([], self._missing.get(name, "no recorded cell defined it"))
        for cell in cells:
            if not cell.success:
                return Recipe([], "a cell that defined or changed it raised an exception")
            if cell.uses_magic:
                return Recipe([], "a cell that defined or changed it uses IPython magics")
            others = sorted(cell.changes - {name})
            if others:
                return Recipe([], "a cell that defined it also changed " + ", ".join(others))
            inputs = sorted((cell.reads & unpicklable) - {name})
            if inputs:
                return Recipe([], "it was computed from unpicklable " + ", ".join(inputs))
        return Recipe([cell.source for cell in cells], "")
