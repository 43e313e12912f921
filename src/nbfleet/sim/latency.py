"""Latencies the simulator charges, as parameters.

Figures the NotebookOS paper measured (seed 004, section 5 and Figure 11) are
used as given; the rest are assumptions, marked so, and every one is a parameter.

| parameter | value | source |
| --- | --- | --- |
| state sync (Raft, small objects) | p50 54.79 ms, p99 268.25 ms | paper, Fig. 11 |
| large-object read | up to 3.95 s (p99) | paper, Fig. 11 |
| large-object write | up to 7.07 s (p99) | paper, Fig. 11 |
| executor election | ~ tens of ms | paper, Appendix (Step 4) |
| container cold start | 15 s | assumption: image pull cached, runtime + imports |
| warm (pre-warmed) start | 0.5 s | assumption: attach a started runtime |
| host provisioning (scale-out) | 120 s | assumption: cloud VM boot + agent join |
| migration | sync + write + read + (warm or cold) start | composed, as the paper describes |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Latencies:
    state_sync_s: float = 0.05479
    large_read_s: float = 3.95
    large_write_s: float = 7.07
    election_s: float = 0.03
    cold_start_s: float = 15.0
    warm_start_s: float = 0.5
    host_provision_s: float = 120.0

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 0:
                raise ValueError(f"latency {name} must not be negative")

    def migration_s(self, warm: bool) -> float:
        """Move a replica: sync its state, ship large objects, start the target."""
        start = self.warm_start_s if warm else self.cold_start_s
        return self.state_sync_s + self.large_write_s + self.large_read_s + start
