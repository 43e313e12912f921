"""From meters to the figures the paper reports: delays, TCT, GPU-hours, dollars.

Billing (seed 004, section 5.5.1): the provider pays its cloud's host rate for
every host it has asked for, from the request to the release. Users pay
``markup`` (1.15) times the provider's per-GPU rate for what they hold:

* ``reserved`` (reservation): the session's GPUs for its whole life;
* ``replicas`` (notebookos, nbfleet): GPUs while a task executes, plus each
  standby replica at ``standby_share`` (12.5 %) of a host's rate;
* ``usage`` (batch, lcp): GPUs while a task executes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from nbfleet.policy.scheduling.decisions import StartPath
from nbfleet.sim.metrics import Meters, TaskRecord

P3_16XLARGE_USD_PER_HOUR = 24.48


@dataclass(frozen=True, slots=True)
class Billing:
    host_usd_per_hour: float = P3_16XLARGE_USD_PER_HOUR
    markup: float = 1.15
    standby_share: float = 0.125

    def __post_init__(self) -> None:
        if min(self.host_usd_per_hour, self.markup, self.standby_share) < 0:
            raise ValueError("billing rates must not be negative")


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    tasks: int
    started: int
    unschedulable: int
    immediate_fraction: float
    delay_p50_s: float
    delay_p90_s: float
    delay_p99_s: float
    #: The worst delay: a p99 hides the sessions that waited hours.
    delay_max_s: float
    delay_mean_s: float
    tct_p50_s: float
    tct_p90_s: float
    tct_p99_s: float
    gpu_hours_provisioned: float
    gpu_hours_busy: float
    utilization: float
    peak_hosts: int
    migrations: int
    scale_out_hosts: int
    scale_in_hosts: int
    cost_usd: float
    revenue_usd: float
    margin: float
    simulated_hours: float
    events: int
    #: Per GPU width (a task's GPUs): its tasks, immediate fraction and delay
    #: p50/p99/max, since wide tasks wait where narrow ones do not.
    by_width: dict[int, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``values`` (NaN when empty)."""
    if not values:
        return math.nan
    rank = max(1, math.ceil(q * len(values)))
    return values[min(rank, len(values)) - 1]


def revenue_usd(meters: Meters, billing_kind: str, billing: Billing) -> float:
    gpu_rate = billing.host_usd_per_hour / meters.gpus_per_host
    end = meters.end
    if billing_kind == "reserved":
        return billing.markup * gpu_rate * meters.reserved_gpus.hours(end)
    revenue = billing.markup * gpu_rate * meters.busy_gpu_hours()
    if billing_kind == "replicas":
        revenue += (billing.markup * billing.standby_share * billing.host_usd_per_hour
                    * meters.standby_replicas.hours(end))
    return revenue


def summarize(meters: Meters, billing_kind: str, billing: Billing | None = None,
              immediate_s: float = 1.0) -> Summary:
    """``immediate_s``: a task that starts within this many seconds started immediately."""
    billing = billing or Billing()
    records = list(meters.tasks.values())
    started = [r for r in records if r.start_s is not None]
    delays = sorted(r.delay_s for r in started if r.delay_s is not None)
    tcts = sorted(r.tct_s for r in started if r.tct_s is not None)
    provisioned = meters.billed_hosts.hours(meters.end) * meters.gpus_per_host
    busy = meters.busy_gpu_hours()
    cost = billing.host_usd_per_hour * meters.billed_hosts.hours(meters.end)
    revenue = revenue_usd(meters, billing_kind, billing)
    return Summary(
        policy=meters.policy, tasks=len(records), started=len(started),
        unschedulable=sum(1 for r in records if r.unschedulable is not None),
        immediate_fraction=(sum(1 for d in delays if d <= immediate_s) / len(delays)
                            if delays else math.nan),
        delay_p50_s=quantile(delays, 0.5), delay_p90_s=quantile(delays, 0.9),
        delay_p99_s=quantile(delays, 0.99), delay_max_s=delays[-1] if delays else math.nan,
        delay_mean_s=sum(delays) / len(delays) if delays else math.nan,
        tct_p50_s=quantile(tcts, 0.5), tct_p90_s=quantile(tcts, 0.9),
        tct_p99_s=quantile(tcts, 0.99),
        gpu_hours_provisioned=provisioned, gpu_hours_busy=busy,
        utilization=busy / provisioned if provisioned else math.nan,
        peak_hosts=round(meters.billed_hosts.peak), migrations=meters.migrations,
        scale_out_hosts=meters.scale_out_hosts, scale_in_hosts=meters.scale_in_hosts,
        cost_usd=cost, revenue_usd=revenue,
        margin=(revenue - cost) / revenue if revenue else math.nan,
        simulated_hours=(meters.end - meters.start) / 3600.0, events=meters.events,
        by_width=_by_width(started, immediate_s))


def _by_width(started: list[TaskRecord], immediate_s: float) -> dict[int, dict[str, float]]:
    widths: dict[int, list[float]] = {}
    for record in started:
        if record.delay_s is not None:
            widths.setdefault(record.gpus, []).append(record.delay_s)
    out: dict[int, dict[str, float]] = {}
    for gpus, delays in sorted(widths.items()):
        delays.sort()
        out[gpus] = {"tasks": len(delays),
                     "immediate_fraction": sum(1 for d in delays if d <= immediate_s)
                     / len(delays),
                     "delay_p50_s": quantile(delays, 0.5), "delay_p99_s": quantile(delays, 0.99),
                     "delay_max_s": delays[-1]}
    return out


def path_counts(meters: Meters) -> dict[str, int]:
    counts = {path.value: 0 for path in StartPath}
    for record in meters.tasks.values():
        if record.path is not None:
            counts[record.path.value] += 1
    return counts
