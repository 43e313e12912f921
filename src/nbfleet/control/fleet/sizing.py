"""The policy a control plane runs, sized for its fleet: one function, so that the
simulator can be handed exactly the policy the live platform runs (the
sim-versus-live equivalence test builds both sides with it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from nbfleet.model.resources import HostInventory, parse_gpu_spec
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.config import P3_16XLARGE, PolicyConfig
from nbfleet.policy.scheduling.registry import default_config, make_policy
from nbfleet.policy.shapes import autoscaled_shape


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """The control plane's settings that shape its policy (``nbfleet up|control``)."""

    policy: str = "nbfleet"
    #: What a scale-out adds (``--host-gpus``); empty: the largest registered host.
    host_gpus: str = ""
    #: Hosts the autoscaler may grow the fleet to (0: the hosts there are).
    max_hosts: int = 0
    #: Replicas per kernel (0: the policy's own, at most the hosts there can be).
    replicas: int = 0
    autoscale_interval_s: float = 60.0
    scale_in_delay_s: float = 600.0
    #: Warm kernels kept on each host (-1: the policy's own).
    prewarm: int = -1


def policy_config(settings: FleetSettings, fleet: Sequence[HostInventory],
                  static_hosts: int) -> PolicyConfig:
    """What a scale-out adds is ``host_gpus`` (else the largest registered host); a
    kernel has no more replicas than the fleet can ever have hosts; and the
    autoscaler never counts on removing the ``static_hosts`` (hosts started by
    someone other than its provider, which it cannot stop)."""
    base = default_config(settings.policy)
    shape = P3_16XLARGE
    if settings.host_gpus:
        shape = autoscaled_shape(parse_gpu_spec(settings.host_gpus), fleet)
    else:
        gpu_hosts = [inv for inv in fleet if inv.gpu_count]
        if gpu_hosts:
            shape = max(gpu_hosts, key=lambda inv: (inv.gpu_count, inv.millicpus))
    most_hosts = max(1, settings.max_hosts, len(fleet))
    replicas = settings.replicas or min(base.replicas, most_hosts)
    idle = min(base.idle_replicas, replicas)
    autoscaler = replace(base.autoscaler, max_hosts=most_hosts,
                         min_hosts=min(static_hosts, most_hosts),
                         interval_s=settings.autoscale_interval_s,
                         scale_in_cooldown_s=settings.scale_in_delay_s)
    prewarm = base.prewarm_per_host if settings.prewarm < 0 else settings.prewarm
    return replace(base, replicas=replicas, idle_replicas=idle, autoscaler=autoscaler,
                   host_shape=shape, prewarm_per_host=prewarm)


def sized_policy(settings: FleetSettings, fleet: Sequence[HostInventory],
                 static_hosts: int) -> FleetPolicy:
    return make_policy(settings.policy, policy_config(settings, fleet, static_hosts))


def outgrown(policy: FleetPolicy, settings: FleetSettings,
             fleet: Sequence[HostInventory]) -> bool:
    """The fleet has more hosts than the policy was sized for (agents that joined
    after it was built, as on a fresh start): it must be rebuilt, or kernels keep
    fewer replicas than the policy wants."""
    wanted = policy_config(settings, fleet, 0)
    return (wanted.replicas != policy.config.replicas
            or wanted.autoscaler.max_hosts != policy.config.autoscaler.max_hosts)
