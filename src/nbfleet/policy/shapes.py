"""Could any host ever satisfy a resource request? And if not, why not.

A *shape* is what one kind of host offers: CPUs, memory and typed GPUs. The
fleet's shapes are the registered agents' inventories plus, when the autoscaler
may add hosts, the shape it provisions. A request no shape can hold would wait
for a place forever, so the API refuses it up front and says what is missing.

This judges capacity only, never current load: a request that fits an empty host
of some shape is satisfiable, however busy the fleet is now. GPU fit is
``policy/gpu_fit.choose_gpus`` on an empty host, so "satisfiable" means exactly
what the placement policies would accept on that host (all GPUs of one type, each
with at least the VRAM floor); the order of preferred types does not matter here.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.limits import format_size
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.policy.gpu_fit import choose_gpus

#: CPU or memory of a shape that is not known, hence not a constraint (an
#: autoscaled host when no agent has registered yet to say what hosts look like).
UNBOUNDED = 1 << 62


def autoscaled_shape(gpus: Sequence[GpuGroup], registered: Sequence[HostInventory]
                     ) -> HostInventory:
    """The host the autoscaler provisions: its configured GPUs, with the CPUs and
    memory of the largest registered host (each the fleet's maximum), since an
    autoscaled host is assumed to be of the machine type the fleet already runs.
    With no host registered those are unknown, so they constrain nothing."""
    millicpus = max((shape.millicpus for shape in registered), default=UNBOUNDED)
    memory_mb = max((shape.memory_mb for shape in registered), default=UNBOUNDED)
    return HostInventory(millicpus, memory_mb, tuple(gpus))


def unsatisfiable_reason(spec: ResourceSpec, shapes: Sequence[HostInventory], *,
                         autoscaled: HostInventory | None = None) -> str | None:
    """None if some host of ``shapes`` (or ``autoscaled``, the autoscaler's shape,
    None when it adds no hosts) could hold ``spec`` on its own; otherwise a
    sentence naming what is missing.

    A request for no GPUs, CPUs or memory always passes, and so does a request
    for no GPUs when there are no hosts at all (they may still be coming); a GPU
    request with no hosts and no autoscaling cannot be placed.
    """
    if spec.gpus == 0 and spec.millicpus == 0 and spec.memory_mb == 0:
        return None
    inventories = [*shapes, *([autoscaled] if autoscaled is not None else [])]
    if not inventories:
        if spec.gpus == 0:
            return None
        return (f"no hosts are registered and the autoscaler adds none, so nothing can "
                f"provide {_gpus(spec)}")
    fleet = [Host.from_inventory(f"shape{i}", shape) for i, shape in enumerate(inventories)]
    gpu_fits = [host for host in fleet if choose_gpus(host.gpus, spec) is not None]
    if any(_cpu_memory_fit(host, spec) for host in gpu_fits):
        return None
    return _why(spec, fleet, gpu_fits) + _autoscaler_note(autoscaled)


def _cpu_memory_fit(host: Host, spec: ResourceSpec) -> bool:
    return host.millicpus >= spec.millicpus and host.memory_mb >= spec.memory_mb


def _why(spec: ResourceSpec, fleet: Sequence[Host], gpu_fits: Sequence[Host]) -> str:
    """The first missing thing, from the most to the least fundamental."""
    if spec.gpus:
        gpu_reason = _why_gpus(spec, fleet)
        if gpu_reason is not None:
            return gpu_reason
    most_cpus = max(host.millicpus for host in fleet)
    if spec.millicpus > most_cpus:
        return f"no host has {_cpus(spec.millicpus)}; the largest has {_cpus(most_cpus)}"
    most_memory = max(host.memory_mb for host in fleet)
    if spec.memory_mb > most_memory:
        return (f"no host has {_memory(spec.memory_mb)} of memory; the largest has "
                f"{_memory(most_memory)}")
    # Each part fits some host, but no one host has them all.
    wanted = [part for part in (_gpus(spec) if spec.gpus else "",
                                _cpus(spec.millicpus) if spec.millicpus else "",
                                f"{_memory(spec.memory_mb)} of memory" if spec.memory_mb else "")
              if part]
    if spec.gpus:
        return (f"no single host has {' together with '.join(wanted)}; the hosts with "
                f"{_gpus(spec)} have at most {_cpus(max(h.millicpus for h in gpu_fits))} "
                f"and {_memory(max(h.memory_mb for h in gpu_fits))} of memory")
    return f"no single host has both {' and '.join(wanted)}"


def _why_gpus(spec: ResourceSpec, fleet: Sequence[Host]) -> str | None:
    """Why no host's GPUs fit (None if some host's do): the type, the VRAM floor,
    then the count on one host, all GPUs of one type."""
    fleet_types = sorted({gpu.gpu_type for host in fleet for gpu in host.gpus})
    types_note = f"types: {', '.join(fleet_types)}" if fleet_types else "it has no GPUs"
    if spec.gpu_types and not set(spec.gpu_types) & set(fleet_types):
        if len(spec.gpu_types) == 1:
            return f"no GPU type {spec.gpu_types[0]} exists in the fleet ({types_note})"
        return (f"none of the GPU types {', '.join(spec.gpu_types)} exists in the fleet "
                f"({types_note})")
    acceptable = [gpu for host in fleet for gpu in host.gpus
                  if not spec.gpu_types or gpu.gpu_type in spec.gpu_types]
    if not acceptable:
        return f"no host has {_gpus(spec)}; the fleet has no GPUs"
    largest = max(gpu.vram_gb for gpu in acceptable)
    if spec.vram_gb > largest:
        return (f"no GPU{_of_types(spec)} has at least {spec.vram_gb} GB of VRAM; the "
                f"largest has {largest} GB")
    most = max(_fitting_count(host, spec) for host in fleet)
    if most >= spec.gpus:
        return None
    if spec.gpu_types or spec.vram_gb:
        return f"no host has {_gpus(spec)}; the largest fitting host has {most}"
    return f"no host has {_gpus(spec)}; the largest has {most}"


def _fitting_count(host: Host, spec: ResourceSpec) -> int:
    """The most GPUs of one acceptable type on ``host`` that meet the VRAM floor."""
    counts: dict[str, int] = {}
    for gpu in host.gpus:
        if gpu.satisfies(spec):
            counts[gpu.gpu_type] = counts.get(gpu.gpu_type, 0) + 1
    return max(counts.values(), default=0)


def _autoscaler_note(autoscaled: HostInventory | None) -> str:
    if autoscaled is None:
        return ", and the autoscaler adds none"
    labels = ", ".join(group.label for group in autoscaled.gpus) or "no GPUs"
    return f", counting the hosts the autoscaler adds ({labels})"


def _of_types(spec: ResourceSpec) -> str:
    return f" of type {'|'.join(spec.gpu_types)}" if spec.gpu_types else ""


def _gpus(spec: ResourceSpec) -> str:
    floor = f" with at least {spec.vram_gb} GB" if spec.vram_gb else ""
    return f"{spec.gpus} GPU{'s' if spec.gpus != 1 else ''}{_of_types(spec)}{floor}"


def _cpus(millicpus: int) -> str:
    cpus = millicpus / 1000
    return f"{cpus:g} CPU{'s' if cpus != 1 else ''}"


def _memory(memory_mb: int) -> str:
    return format_size(memory_mb << 20)
