"""The live scheduler around a policy: binding, waiting, cancelling, rebuilding."""

from __future__ import annotations

import asyncio

import pytest

from nbfleet.control.fleet.scheduler import CellFacts, CellRefused, KernelFacts, LiveScheduler
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.policy.scheduling.config import AutoscalerConfig, PolicyConfig
from nbfleet.policy.scheduling.decisions import Started
from nbfleet.policy.scheduling.registry import make_policy

ONE_A100 = HostInventory(8000, 64000, (GpuGroup(1, "A100-80GB", 80),))
A100 = ResourceSpec(gpus=1, gpu_types=("A100-80GB",))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def scheduler(policy: str = "nbfleet", hosts: int = 1) -> LiveScheduler:
    config = PolicyConfig(host_shape=ONE_A100, replicas=1, prewarm_per_host=0,
                          autoscaler=AutoscalerConfig(max_hosts=hosts))
    live = LiveScheduler(make_policy(policy, config), clock=Clock())
    for n in range(hosts):
        live.host_joined(f"h{n}", ONE_A100)
    return live


def committed(live: LiveScheduler) -> int:
    return sum(h.committed_gpus for h in live.policy.hosts.values())


async def test_two_kernels_on_one_gpu_take_turns_and_nothing_leaks() -> None:
    live = scheduler()
    assert live.open_kernel("ws1", A100) == ("h0",)
    assert live.open_kernel("ws2", A100) == ("h0",)
    first = await live.acquire("k1/a", "ws1", 1)
    assert (first.host_id, first.gpu_indices, first.gpu_type) == ("h0", (0,), "A100-80GB")
    second = asyncio.create_task(live.acquire("k2/a", "ws2", 1))
    await asyncio.sleep(0)
    assert not second.done()
    assert live.wait_reason("k2/a") == "waiting for 1x A100-80GB: next in line"
    third = asyncio.create_task(live.acquire("k3/a", "ws2", 1))
    await asyncio.sleep(0)
    assert live.wait_reason("k3/a") == "waiting for 1x A100-80GB: 1 cell ahead"
    live.release("k1/a")
    bound = await asyncio.wait_for(second, 1)
    assert bound.gpu_indices == (0,) and committed(live) == 1
    live.release("k2/a")
    live.release("k2/a")  # the gateway and the agent both report it: harmless
    await asyncio.wait_for(third, 1)
    live.release("k3/a")
    assert committed(live) == 0 and not live.running and not live.policy.queue


async def test_a_cancelled_wait_leaves_the_queue_and_never_holds_a_gpu() -> None:
    live = scheduler()
    live.open_kernel("ws1", A100)
    live.open_kernel("ws2", A100)
    await live.acquire("k1/a", "ws1", 1)
    waiting = asyncio.create_task(live.acquire("k2/a", "ws2", 1))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not live.policy.queue
    live.release("k1/a")
    assert committed(live) == 0, "the withdrawn cell must not be started later"


async def test_a_request_no_host_can_run_is_refused_with_the_reason() -> None:
    live = scheduler()
    with pytest.raises(CellRefused, match="no host shape"):
        live.open_kernel("ws1", ResourceSpec(gpus=2))


async def test_rebuild_puts_back_placements_and_running_cells_without_double_binding() -> None:
    live = scheduler(hosts=2)
    refused = live.rebuild(
        [("h0", ONE_A100), ("h1", ONE_A100)],
        [KernelFacts("ws1", A100, ("h0",)), KernelFacts("ws2", A100, ("h0",))],
        [CellFacts("k1/a", "ws1", "h0", (0,)),
         CellFacts("k2/a", "ws2", "h0", (0,)),  # the same GPU again: refused
         CellFacts("kx/a", "ws-unknown", "h1", (0,))])
    assert refused == ["k2/a", "kx/a"]
    assert live.policy.hosts["h0"].holder_of(0) == "k1/a"
    assert live.policy.hosts["h1"].committed_gpus == 0
    assert set(live.running) == {"k1/a"}
    # ws2 lives on h0, whose one GPU the rebuilt model knows is busy: it must wait
    # (nbfleet migrates it to h1's free GPU rather than bind h0's twice).
    bound = await asyncio.wait_for(live.acquire("k2/b", "ws2", 1), 1)
    assert bound.host_id == "h1"


async def test_a_lost_host_ends_its_cells_and_its_kernels_wait_for_a_new_one() -> None:
    live = scheduler(hosts=1)
    live.open_kernel("ws1", A100)
    await live.acquire("k1/a", "ws1", 1)
    assert live.host_lost("h0") == ["k1/a"]
    assert live.open_kernel("ws1", A100) is None  # waiting for a host
    live.host_joined("h1", ONE_A100)
    assert live.open_kernel("ws1", A100) == ("h1",)


async def test_waiting_says_a_host_is_being_added_only_when_one_is() -> None:
    config = PolicyConfig(host_shape=ONE_A100, replicas=1, prewarm_per_host=0,
                          autoscaler=AutoscalerConfig(max_hosts=2))
    live = LiveScheduler(make_policy("nbfleet", config), clock=Clock())
    live.host_joined("h0", ONE_A100)
    live.open_kernel("ws1", A100)
    live.open_kernel("ws2", A100)
    await live.acquire("k1/a", "ws1", 1)
    waiting = asyncio.create_task(live.acquire("k2/a", "ws2", 1))
    await asyncio.sleep(0)
    assert live.policy.provisioning == 1
    assert live.wait_reason("k2/a") == (
        "waiting for 1x A100-80GB: next in line; a host is being added")
    waiting.cancel()


async def test_closing_a_kernel_releases_its_cell_and_withdraws_its_waiters() -> None:
    live = scheduler()
    live.open_kernel("ws1", A100)
    live.open_kernel("ws2", A100)
    await live.acquire("k1/a", "ws1", 1)
    waiting = asyncio.create_task(live.acquire("k2/a", "ws2", 1))
    await asyncio.sleep(0)
    live.close_kernel("ws2")
    with pytest.raises(asyncio.CancelledError):
        await waiting
    live.close_kernel("ws1")
    assert committed(live) == 0 and not live.running and not live.policy.kernels


async def test_every_decision_is_logged_in_order() -> None:
    live = scheduler()
    live.open_kernel("ws1", A100)
    await live.acquire("k1/a", "ws1", 1)
    started = [e.decision for e in live.log if isinstance(e.decision, Started)]
    assert [s.task_id for s in started] == ["k1/a"]


def test_a_rebuild_gives_a_kernel_that_lost_a_replica_host_a_new_one() -> None:
    """Its placement names a host that is gone (the rebuild follows the host's
    loss): the kernel keeps the replica it has and gets one on a live host, where
    the control plane then makes its standby."""
    config = PolicyConfig(host_shape=ONE_A100, replicas=2, prewarm_per_host=0,
                          autoscaler=AutoscalerConfig(max_hosts=3))
    live = LiveScheduler(make_policy("nbfleet", config), clock=Clock())
    live.rebuild([("h0", ONE_A100), ("h2", ONE_A100)],
                 [KernelFacts("ws1", A100, ("h0", "h1"))], [])
    assert live.policy.kernels["ws1"].hosts == ["h0", "h2"]
    assert live.open_kernel("ws1", A100) == ("h0", "h2")
