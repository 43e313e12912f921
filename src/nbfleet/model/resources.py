"""Host inventory: CPUs, memory and typed GPUs, as an agent declares them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbfleet.model.errors import InvalidInput

_GPU_SPEC = re.compile(r"^(?P<count>\d+)x(?P<type>[A-Za-z0-9]+)-(?P<vram>\d+)GB$")


@dataclass(frozen=True, slots=True)
class GpuGroup:
    """``count`` identical GPUs of one type, e.g. 4 of ``A100-80GB``.

    The type names the VRAM variant too, because an A100-40GB and an A100-80GB are
    priced and placed differently.
    """

    count: int
    gpu_type: str
    vram_gb: int

    @property
    def label(self) -> str:
        return f"{self.count}x{self.gpu_type}"


@dataclass(frozen=True, slots=True)
class HostInventory:
    millicpus: int
    memory_mb: int
    gpus: tuple[GpuGroup, ...] = ()
    #: Whether a process may keep one of its GPUs open past a cell, so that the
    #: agent reports a cell's end only once its GPUs are closed (its slots have GPU
    #: nodes, and cgroups to look for holders in). If not, a cell's GPUs are free at
    #: its reply. Unknown reads as True: waiting for the report is the safe side.
    gpu_holds: bool = True

    @property
    def gpu_count(self) -> int:
        return sum(group.count for group in self.gpus)


def parse_gpu_spec(spec: str) -> tuple[GpuGroup, ...]:
    """Parse ``"4xA100-80GB,2xH100-80GB"``; an empty string declares no GPUs."""
    groups: list[GpuGroup] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = _GPU_SPEC.match(part)
        if match is None:
            raise InvalidInput(
                f"invalid GPU spec {part!r}: expected COUNTxTYPE-VRAMGB, e.g. 4xA100-80GB"
            )
        count = int(match["count"])
        if count == 0:
            raise InvalidInput(f"invalid GPU spec {part!r}: count must be at least 1")
        vram = int(match["vram"])
        groups.append(GpuGroup(count, f"{match['type']}-{vram}GB", vram))
    return tuple(groups)


def inventory_from_json(inventory: Mapping[str, Any], missing: int = 0) -> HostInventory:
    """An agent's registered inventory (``agent/service.py registration()``); a CPU or
    memory figure it does not state reads as ``missing``."""
    return HostInventory(
        int(inventory.get("millicpus", missing)), int(inventory.get("memory_mb", missing)),
        tuple(GpuGroup(int(g["count"]), str(g["type"]), int(g["vram_gb"]))
              for g in inventory.get("gpus", ())),
        inventory.get("gpu_holds", True) is not False)
