"""Choosing a host for a workspace runtime.

This is the minimal policy the foundation needs; issue 3 grows the full set
(reservation, batch, notebookos, lcp, nbfleet) behind the same kind of call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostLoad:
    host_id: str
    runtimes: int
    millicpus: int


def least_loaded(hosts: Sequence[HostLoad]) -> str | None:
    """The host with the fewest runtimes per CPU; ties go to the smallest id."""
    if not hosts:
        return None
    best = min(hosts, key=lambda h: (h.runtimes / max(h.millicpus, 1), h.host_id))
    return best.host_id
