"""How many hosts the fleet should have: NotebookOS's autoscaler rule, shared by all.

NotebookOS (section 3.4.2) sizes the cluster from the GPUs that are actually
committed, not from what is subscribed: expected capacity is the committed GPUs
times a scaling factor (1.05), plus a buffer of spare hosts for bursts. It scales
out at once when the fleet is below that, and scales in "gradually, 1 to 2 servers
at a time" when it is above. Every policy here uses the same rule with its own
parameters, and adds a floor of its own (e.g. the hosts that its subscriptions
need), so that a policy comparison measures placement, not autoscaler tuning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nbfleet.policy.scheduling.config import AutoscalerConfig


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """``add`` hosts to provision, or up to ``remove`` idle hosts to release."""

    expected_hosts: int
    add: int = 0
    remove: int = 0


def expected_hosts(config: AutoscalerConfig, demanded_gpus: int, gpus_per_host: int,
                   floor_hosts: int = 0) -> int:
    """ceil(factor x demand / GPUs per host) + buffer, within [min_hosts, max_hosts]."""
    if demanded_gpus < 0 or gpus_per_host <= 0:
        raise ValueError("demand must be >= 0 and hosts must have GPUs")
    needed = math.ceil(config.scaling_factor * demanded_gpus / gpus_per_host - 1e-9)
    wanted = max(needed + config.scaling_buffer, config.min_hosts, floor_hosts)
    return min(wanted, config.max_hosts)


def plan(config: AutoscalerConfig, *, ready_hosts: int, provisioning: int,
         demanded_gpus: int, gpus_per_host: int, floor_hosts: int = 0) -> ScalePlan:
    """Compare the fleet with its expected size; pending hosts count as present."""
    expected = expected_hosts(config, demanded_gpus, gpus_per_host, floor_hosts)
    present = ready_hosts + provisioning
    if present < expected:
        return ScalePlan(expected, add=expected - present)
    if ready_hosts > expected and provisioning == 0:
        return ScalePlan(expected, remove=min(config.scale_in_limit, ready_hosts - expected))
    return ScalePlan(expected)
