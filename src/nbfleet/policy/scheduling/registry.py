"""Policies by name, each with its default configuration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nbfleet.model.resources import HostInventory
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.batch import Batch
from nbfleet.policy.scheduling.config import AutoscalerConfig, PolicyConfig
from nbfleet.policy.scheduling.lcp import LargeContainerPool
from nbfleet.policy.scheduling.nbfleet import NbfleetPolicy
from nbfleet.policy.scheduling.notebookos import NotebookOS
from nbfleet.policy.scheduling.reservation import Reservation

POLICIES: dict[str, type[FleetPolicy]] = {
    cls.name: cls for cls in (Reservation, Batch, NotebookOS, LargeContainerPool, NbfleetPolicy)
}

_DEFAULTS: dict[str, Callable[[], PolicyConfig]] = {
    "reservation": lambda: PolicyConfig(replicas=1, prewarm_per_host=0),
    "batch": lambda: PolicyConfig(replicas=1, prewarm_per_host=0),
    # A large pool: one warm container per GPU on every host, and a spare host.
    "lcp": lambda: PolicyConfig(replicas=1, prewarm_per_host=8,
                                autoscaler=AutoscalerConfig(scaling_buffer=1)),
    # Three replicas, a small prewarm pool (one per host), a spare host for bursts.
    "notebookos": lambda: PolicyConfig(replicas=3, prewarm_per_host=1,
                                       autoscaler=AutoscalerConfig(scaling_buffer=1)),
    "nbfleet": NbfleetPolicy.default_config,
}


def default_config(name: str) -> PolicyConfig:
    try:
        return _DEFAULTS[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None


def make_policy(name: str, config: PolicyConfig | None = None, *,
                max_hosts: int | None = None,
                host_shape: HostInventory | None = None) -> FleetPolicy:
    """A fresh policy; ``config`` replaces its defaults, ``max_hosts`` caps the fleet,
    ``host_shape`` is what a scale-out provisions."""
    base = config if config is not None else default_config(name)
    if host_shape is not None:
        base = replace(base, host_shape=host_shape)
    if max_hosts is not None:
        base = replace(base, autoscaler=replace(base.autoscaler, max_hosts=max_hosts))
    return POLICIES[name](base)
