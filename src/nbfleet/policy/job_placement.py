"""Placing jobs on a fleet of heterogeneous hosts, fast enough for 1,000s of hosts.

``FreeGpus`` indexes each host's free GPUs by (type, VRAM) and free count, so a
pick costs O(types x GPUs per host) instead of a scan of every host:

* **Types in the job's order of preference** (``gpu_fit``'s rule): the first
  preferred type with room wins; with no preference, the smallest VRAM that fits,
  so big GPUs stay free for jobs that need them.
* **Best fit within a type**: the host with the fewest free GPUs that still fit,
  ties to the smaller host id. Packing leaves whole hosts free for wide jobs.
* **Avoided hosts** (where an earlier attempt failed) are skipped while another
  host *could ever* run the job; when none could, avoiding would starve it, so
  they are used.

The hosts are ``model.cluster.Host`` objects; the index commits and releases GPUs
on them, so the binding rules (all or nothing, never two holders) hold here too.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from nbfleet.model.cluster import Gpu, Host, ResourceSpec
from nbfleet.policy.gpu_fit import choose_gpus

__all__ = ["FreeGpus", "Placement"]

_Key = tuple[str, int]  # (GPU type, VRAM GB)


@dataclass(frozen=True, slots=True)
class Placement:
    host_id: str
    gpus: tuple[Gpu, ...]

    @property
    def gpu_type(self) -> str:
        return self.gpus[0].gpu_type if self.gpus else ""

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)


class FreeGpus:
    def __init__(self, hosts: Iterable[Host]) -> None:
        self.hosts: dict[str, Host] = {}
        #: key -> free count -> sorted host ids with exactly that many free of the key
        self._free: dict[_Key, dict[int, list[str]]] = {}
        #: key -> host id -> total GPUs of the key (capacity, for avoid decisions)
        self._capacity: dict[_Key, dict[str, int]] = {}
        for host in hosts:
            self.add_host(host)

    # ----------------------------------------------------------------- index
    @staticmethod
    def _counts(gpus: Iterable[Gpu]) -> dict[_Key, int]:
        counts: dict[_Key, int] = {}
        for gpu in gpus:
            key = (gpu.gpu_type, gpu.vram_gb)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def add_host(self, host: Host) -> None:
        if host.id in self.hosts:
            raise ValueError(f"host {host.id} is indexed twice")
        self.hosts[host.id] = host
        for key, total in self._counts(host.gpus).items():
            self._capacity.setdefault(key, {})[host.id] = total
        for key, free in self._counts(host.free_gpus()).items():
            self._insert(key, free, host.id)

    def _insert(self, key: _Key, free: int, host_id: str) -> None:
        bisect.insort(self._free.setdefault(key, {}).setdefault(free, []), host_id)

    def _remove(self, key: _Key, free: int, host_id: str) -> None:
        bucket = self._free[key][free]
        del bucket[bisect.bisect_left(bucket, host_id)]
        if not bucket:
            del self._free[key][free]

    def _reindex(self, host: Host, before: dict[_Key, int]) -> None:
        after = self._counts(host.free_gpus())
        for key in before.keys() | after.keys():
            old, new = before.get(key, 0), after.get(key, 0)
            if old != new:
                if old:
                    self._remove(key, old, host.id)
                if new:
                    self._insert(key, new, host.id)

    # ------------------------------------------------------------- questions
    def _keys_for(self, spec: ResourceSpec) -> list[_Key]:
        keys = [k for k in self._capacity if k[1] >= spec.vram_gb
                and (not spec.gpu_types or k[0] in spec.gpu_types)]
        if spec.gpu_types:
            rank = {t: i for i, t in enumerate(spec.gpu_types)}
            return sorted(keys, key=lambda k: (rank[k[0]], k[1]))
        return sorted(keys, key=lambda k: (k[1], k[0]))

    def capable_hosts(self, spec: ResourceSpec) -> set[str]:
        """Hosts that could run ``spec`` if they were idle."""
        return {host_id for key in self._keys_for(spec)
                for host_id, total in self._capacity[key].items() if total >= spec.gpus}

    def free_count(self) -> int:
        return sum(free * len(ids) for by_count in self._free.values()
                   for free, ids in by_count.items())

    def place(self, spec: ResourceSpec, avoid: Collection[str] = ()) -> Placement | None:
        """Where ``spec`` would start now, without committing it (None: nowhere)."""
        if spec.gpus == 0:
            raise ValueError("job placement needs at least one GPU")
        strict = bool(avoid) and bool(self.capable_hosts(spec) - set(avoid))
        for key in self._keys_for(spec):
            by_count = self._free.get(key)
            if not by_count:
                continue
            for free in sorted(c for c in by_count if c >= spec.gpus):
                for host_id in by_count[free]:
                    if strict and host_id in avoid:
                        continue
                    typed = ResourceSpec(gpus=spec.gpus, vram_gb=spec.vram_gb,
                                         gpu_types=(key[0],))
                    host = self.hosts[host_id]
                    gpus = choose_gpus([g for g in host.free_gpus() if g.vram_gb == key[1]],
                                       typed)
                    if gpus is not None:
                        return Placement(host_id, gpus)
        return None

    # --------------------------------------------------------------- changes
    def commit(self, holder: str, placement: Placement) -> None:
        host = self.hosts[placement.host_id]
        before = self._counts(host.free_gpus())
        host.commit(holder, placement.indices)
        self._reindex(host, before)

    def release(self, host_id: str, holder: str) -> None:
        host = self.hosts.get(host_id)
        if host is None:
            return
        before = self._counts(host.free_gpus())
        host.release(holder)
        self._reindex(host, before)
