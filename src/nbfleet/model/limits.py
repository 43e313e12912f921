"""What one workspace's sandbox may use: memory, CPU, processes and disk.

The platform sets defaults (``nbfleet agent --kernel-memory 4GiB ...``) and a
project may override any of them; a limit of ``None`` means "not limited".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from nbfleet.model.errors import InvalidInput

_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
          "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
          "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40}

#: The smallest limits a kernel can live with: below them it cannot even start.
MIN_MEMORY_BYTES = 64 << 20
MIN_PIDS = 16
MIN_DISK_BYTES = 16 << 20


def parse_size(text: str, what: str = "size") -> int:
    """``"4GiB"`` -> 4294967296; SI (``GB``) and binary (``GiB``) units, or bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidInput(f"invalid {what} {text!r}: expected a number and a unit, e.g. 4GiB")
    unit = (match["unit"] or "").lower()
    return int(float(match["number"]) * _UNITS[unit])


def format_size(size: int) -> str:
    """4294967296 -> ``"4 GiB"``: how a limit is told to a user."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size} B"


@dataclass(frozen=True, slots=True)
class Limits:
    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
    disk_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes < MIN_MEMORY_BYTES:
            raise InvalidInput(f"memory limit must be at least {format_size(MIN_MEMORY_BYTES)}")
        if self.cpus is not None and not 0.01 <= self.cpus <= 1024:
            raise InvalidInput("cpu limit must be between 0.01 and 1024 CPUs")
        if self.pids is not None and self.pids < MIN_PIDS:
            raise InvalidInput(f"process limit must be at least {MIN_PIDS}")
        if self.disk_bytes is not None and self.disk_bytes < MIN_DISK_BYTES:
            raise InvalidInput(f"disk limit must be at least {format_size(MIN_DISK_BYTES)}")

    @classmethod
    def parse(cls, memory: str | None = None, cpus: str | float | None = None,
              pids: str | int | None = None, disk: str | None = None) -> Limits:
        """From flag values; an empty string, ``"0"`` or ``"none"`` leaves one unlimited."""
        def unset(value: object) -> bool:
            return value is None or str(value).strip().lower() in ("", "0", "none")

        try:
            return cls(
                memory_bytes=None if unset(memory) else parse_size(str(memory), "memory limit"),
                cpus=None if unset(cpus) else float(str(cpus)),
                pids=None if unset(pids) else int(str(pids)),
                disk_bytes=None if unset(disk) else parse_size(str(disk), "disk limit"),
            )
        except ValueError as exc:
            raise InvalidInput(f"invalid limit: {exc}") from exc

    def over(self, override: Limits | None) -> Limits:
        """These defaults with ``override``'s set fields taking precedence."""
        if override is None:
            return self
        return replace(self, **{name: value for name, value in override.as_dict().items()
                                if value is not None})

    def as_dict(self) -> dict[str, Any]:
        return {"memory_bytes": self.memory_bytes, "cpus": self.cpus, "pids": self.pids,
                "disk_bytes": self.disk_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Limits:
        data = data or {}
        return cls(**{name: data.get(name) for name in
                      ("memory_bytes", "cpus", "pids", "disk_bytes")})

    def describe(self) -> str:
        parts = [
            f"memory {format_size(self.memory_bytes)}" if self.memory_bytes else "memory unlimited",
            f"{self.cpus:g} CPU" if self.cpus else "CPU unlimited",
            f"{self.pids} processes" if self.pids else "processes unlimited",
            f"disk {format_size(self.disk_bytes)}" if self.disk_bytes else "disk unlimited",
        ]
        return ", ".join(parts)
