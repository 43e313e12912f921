"""Hosts as schedulers see them: typed GPUs, subscriptions and commitments.

A *subscription* is a placed replica's claim on a host (NotebookOS: replicas
subscribe to GPUs without holding them). A *commitment* binds specific GPUs to one
holder while it executes. Subscriptions may exceed capacity (oversubscription);
commitments never do, and no GPU is ever bound to two holders. This module only
keeps and checks that state; which GPUs to bind is a policy decision
(``policy/gpu_fit.py``). The simulator and the live scheduler share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nbfleet.model.errors import Conflict, InvalidInput
from nbfleet.model.resources import HostInventory


@dataclass(frozen=True, slots=True)
class ResourceSpec:
    """What a replica, task or job asks for.

    ``vram_gb`` is a floor per GPU; ``gpu_types`` lists acceptable types in order of
    preference (empty: any type).
    """

    millicpus: int = 0
    memory_mb: int = 0
    gpus: int = 0
    vram_gb: int = 0
    gpu_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("millicpus", "memory_mb", "gpus", "vram_gb"):
            if getattr(self, name) < 0:
                raise InvalidInput(f"{name} must not be negative")
        if self.gpus == 0 and (self.vram_gb or self.gpu_types):
            raise InvalidInput("a GPU type or VRAM floor needs at least one GPU")


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    gpu_type: str
    vram_gb: int

    def satisfies(self, spec: ResourceSpec) -> bool:
        return self.vram_gb >= spec.vram_gb and (
            not spec.gpu_types or self.gpu_type in spec.gpu_types
        )


class Host:
    """One server's capacity, subscriptions and GPU bindings."""

    def __init__(self, host_id: str, millicpus: int, memory_mb: int,
                 gpus: Iterable[Gpu]) -> None:
        self.id = host_id
        self.millicpus = millicpus
        self.memory_mb = memory_mb
        self.gpus: tuple[Gpu, ...] = tuple(gpus)
        if len({g.index for g in self.gpus}) != len(self.gpus):
            raise InvalidInput(f"host {host_id} lists a GPU index twice")
        self._subscriptions: dict[str, ResourceSpec] = {}
        #: Their GPUs, kept as they change: the policies read it on every decision.
        self._subscribed_gpus = 0
        self._bindings: dict[int, str] = {}  # GPU index -> holder
        self._held: dict[str, tuple[int, ...]] = {}  # holder -> GPU indices

    @classmethod
    def from_inventory(cls, host_id: str, inventory: HostInventory) -> Host:
        gpus: list[Gpu] = []
        for group in inventory.gpus:
            for _ in range(group.count):
                gpus.append(Gpu(len(gpus), group.gpu_type, group.vram_gb))
        return cls(host_id, inventory.millicpus, inventory.memory_mb, gpus)

    # ------------------------------------------------------------- subscriptions
    def subscribe(self, holder: str, spec: ResourceSpec) -> None:
        if holder in self._subscriptions:
            raise Conflict(f"{holder} is already subscribed on {self.id}")
        self._subscriptions[holder] = spec
        self._subscribed_gpus += spec.gpus

    def unsubscribe(self, holder: str) -> None:
        """Drop a subscription (and any GPUs the holder still has bound)."""
        spec = self._subscriptions.pop(holder, None)
        if spec is not None:
            self._subscribed_gpus -= spec.gpus
        self.release(holder)

    @property
    def subscriptions(self) -> Mapping[str, ResourceSpec]:
        return dict(self._subscriptions)

    @property
    def subscribed_gpus(self) -> int:
        return self._subscribed_gpus

    def subscription_ratio(self, replicas: int) -> float:
        """NotebookOS's SR: subscribed GPUs / (host GPUs x replicas per kernel)."""
        if not self.gpus:
            return 0.0 if self.subscribed_gpus == 0 else float("inf")
        return self.subscribed_gpus / (len(self.gpus) * replicas)

    # ---------------------------------------------------------------- bindings
    def free_gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.index not in self._bindings)

    @property
    def committed_gpus(self) -> int:
        return len(self._bindings)

    def holder_of(self, gpu_index: int) -> str | None:
        return self._bindings.get(gpu_index)

    def bound(self, holder: str) -> tuple[int, ...]:
        return self._held.get(holder, ())

    def commit(self, holder: str, gpu_indices: Iterable[int]) -> tuple[int, ...]:
        """Bind exactly these GPUs to ``holder``; all or nothing."""
        indices = tuple(sorted(set(gpu_indices)))
        if holder in self._held:
            raise Conflict(f"{holder} already holds GPUs {self._held[holder]} on {self.id}")
        known = {g.index for g in self.gpus}
        for index in indices:
            if index not in known:
                raise InvalidInput(f"host {self.id} has no GPU {index}")
            if index in self._bindings:
                raise Conflict(f"GPU {index} on {self.id} is bound to {self._bindings[index]}")
        for index in indices:
            self._bindings[index] = holder
        self._held[holder] = indices
        return indices

    def release(self, holder: str) -> tuple[int, ...]:
        """Unbind the holder's GPUs (a no-op if it holds none): idempotent."""
        indices = self._held.pop(holder, ())
        for index in indices:
            del self._bindings[index]
        return indices
