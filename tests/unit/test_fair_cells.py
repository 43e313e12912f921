"""Waiting cells are served by the fleet's fairness: tiers, weights, decayed usage."""

from __future__ import annotations

from nbfleet.model.cluster import Host, ResourceSpec
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.policy.scheduling.config import AutoscalerConfig, PolicyConfig
from nbfleet.policy.scheduling.decisions import KernelRequest, Started, TaskRequest
from nbfleet.policy.scheduling.registry import make_policy

ONE_GPU = HostInventory(8000, 64000, (GpuGroup(1, "A100-80GB", 80),))
GPU = ResourceSpec(gpus=1)


def policy():  # type: ignore[no-untyped-def]
    config = PolicyConfig(host_shape=ONE_GPU, replicas=1, prewarm_per_host=0,
                          autoscaler=AutoscalerConfig(max_hosts=1))
    fleet = make_policy("batch", config)
    fleet.add_host(Host.from_inventory("h0", ONE_GPU), 0.0)
    return fleet


def started_after(fleet, finished: str, now: float) -> str:  # type: ignore[no-untyped-def]
    decisions = fleet.finish(finished, now)
    starts = [d.task_id for d in decisions if isinstance(d, Started)]
    assert len(starts) == 1, decisions
    return starts[0]


def test_the_tenant_that_used_less_goes_first_however_late_it_asked() -> None:
    fleet = policy()
    for kernel, tenant in (("heavy", "p1"), ("light", "p2")):
        fleet.open_session(KernelRequest(kernel, GPU, tenant=tenant), 0.0)
    # p1 uses the GPU for an hour.
    fleet.submit(TaskRequest("heavy/0", "heavy", 1), 0.0)
    fleet.submit(TaskRequest("heavy/1", "heavy", 1), 10.0)  # waits
    fleet.submit(TaskRequest("light/0", "light", 1), 20.0)  # waits, asked later
    assert started_after(fleet, "heavy/0", 3600.0) == "light/0"
    assert started_after(fleet, "light/0", 3700.0) == "heavy/1"
    fleet.lose_host("h0", 3800.0)  # the last cell ends with its host
    assert fleet.fair._load == {} and not fleet.running, "nothing left charged as running"


def first_served(weight_of_p1: float) -> str:
    """p1 used 100 GPU-seconds, p2 50; each has one cell waiting, p1's first."""
    fleet = policy()
    for kernel, tenant in (("busy", "p3"), ("a", "p1"), ("b", "p2")):
        fleet.open_session(KernelRequest(kernel, GPU, tenant=tenant), 0.0)
    fleet.fair.weights["p1"] = weight_of_p1
    fleet.fair.usage = fleet.fair.usage.record("p1", 100.0, 0.0).record("p2", 50.0, 0.0)
    fleet.submit(TaskRequest("busy/0", "busy", 1), 0.0)
    fleet.submit(TaskRequest("a/0", "a", 1), 1.0)
    fleet.submit(TaskRequest("b/0", "b", 1), 2.0)
    return started_after(fleet, "busy/0", 3.0)


def test_weight_buys_a_larger_share() -> None:
    assert first_served(weight_of_p1=1.0) == "b/0"  # 100 / 1 > 50 / 1
    assert first_served(weight_of_p1=4.0) == "a/0"  # 100 / 4 < 50 / 1


def test_a_higher_tier_always_goes_first() -> None:
    fleet = policy()
    fleet.open_session(KernelRequest("free", GPU, tenant="p1"), 0.0)
    fleet.open_session(KernelRequest("paid", GPU, tenant="p2", priority=10), 0.0)
    fleet.open_session(KernelRequest("free2", GPU, tenant="p3"), 0.0)
    fleet.submit(TaskRequest("free/0", "free", 1), 0.0)
    fleet.submit(TaskRequest("free2/0", "free2", 1), 1.0)
    fleet.submit(TaskRequest("paid/0", "paid", 1), 2.0)
    fleet.fair.weights["p2"] = 0.001  # a tiny weight does not demote a higher tier
    assert started_after(fleet, "free/0", 3.0) == "paid/0"


def test_one_tenant_is_first_come_first_served() -> None:
    fleet = policy()
    fleet.open_session(KernelRequest("a", GPU), 0.0)
    fleet.open_session(KernelRequest("b", GPU), 0.0)
    fleet.open_session(KernelRequest("c", GPU), 0.0)
    fleet.submit(TaskRequest("a/0", "a", 1), 0.0)
    fleet.submit(TaskRequest("c/0", "c", 1), 1.0)
    fleet.submit(TaskRequest("b/0", "b", 1), 2.0)
    assert started_after(fleet, "a/0", 3.0) == "c/0"
    assert started_after(fleet, "c/0", 4.0) == "b/0"
