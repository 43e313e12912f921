"""Field parsing shared by the readers: every failure names the file and line."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TextIO, TypeVar

from nbfleet.sim.traces.model import TraceError

T = TypeVar("T")


class Where:
    """A position in a trace file, so errors can say ``path:line: reason``."""

    def __init__(self, path: str | Path, line: int) -> None:
        self.path = path
        self.line = line

    def error(self, message: str) -> TraceError:
        return TraceError(message, self.path, self.line)

    def guard(self, build: Callable[[], T], context: str = "") -> T:
        """Run ``build``; a ``TraceError`` it raises gets this position (and context) added."""
        try:
            return build()
        except TraceError as exc:
            raise self.error(f"{context}: {exc.reason}" if context else exc.reason) from None


def parse_float(where: Where, name: str, raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise where.error(f"{name}: expected a number, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise where.error(f"{name}: expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise where.error(f"{name}: expected a finite number, got {raw!r}")
    return value


def parse_int(where: Where, name: str, raw: object) -> int:
    """Whole numbers only; ``"2.0"`` is accepted, ``"2.5"`` is not."""
    value = parse_float(where, name, raw)
    if not value.is_integer():
        raise where.error(f"{name}: expected a whole number, got {raw!r}")
    return int(value)


def require(where: Where, row: Mapping[str, object], name: str) -> object:
    value = row.get(name)
    if value is None or value == "":
        raise where.error(f"missing {name}")
    return value


def check_columns(where: Where, header: list[str] | None, needed: tuple[str, ...]) -> None:
    if header is None:
        raise where.error("empty file: expected a header row")
    missing = [c for c in needed if c not in header]
    if missing:
        raise where.error(f"header lacks column(s) {', '.join(missing)}; "
                          f"expected {','.join(needed)}")


def open_text(path: Path) -> TextIO:
    """Open a trace for reading; a missing or unreadable file is a ``TraceError``."""
    try:
        return path.open(encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise TraceError(f"cannot read: {exc.strerror or exc}", path) from None


def csv_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[Where, dict[str, str]]]:
    """The rows of a CSV trace with their positions, once its header is checked."""
    with open_text(path) as handle:
        reader = csv.DictReader(handle)
        check_columns(Where(path, 1), list(reader.fieldnames or []) or None, columns)
        for row in reader:
            where = Where(path, reader.line_num)
            if None in row:
                raise where.error("more fields than the header has")
            yield where, row
