"""Which GPUs to bind for a request, on heterogeneous hosts.

A request lists acceptable GPU types in order of preference and a VRAM floor. All
GPUs of one binding are of one type (a job spread over an A100 and an H100 runs at
the slower one's pace and is priced ambiguously). The first preferred type with
enough free, large-enough GPUs wins; with no preference, the type with the least
VRAM that fits, so bigger GPUs stay free for requests that need them.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbfleet.model.cluster import Gpu, ResourceSpec


def choose_gpus(free: Sequence[Gpu], spec: ResourceSpec) -> tuple[Gpu, ...] | None:
    """The GPUs to bind for ``spec`` among ``free``, or None if it cannot fit."""
    if spec.gpus == 0:
        return ()
    by_type: dict[str, list[Gpu]] = {}
    for gpu in free:
        if gpu.satisfies(spec):
            by_type.setdefault(gpu.gpu_type, []).append(gpu)
    if spec.gpu_types:
        order = [t for t in spec.gpu_types if t in by_type]
    else:
        order = sorted(by_type, key=lambda t: (min(g.vram_gb for g in by_type[t]), t))
    for gpu_type in order:
        candidates = sorted(by_type[gpu_type], key=lambda g: (g.vram_gb, g.index))
        if len(candidates) >= spec.gpus:
            return tuple(candidates[: spec.gpus])
    return None
