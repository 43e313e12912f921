"""The fleet service's own passes, around a real scheduler and an agent's report:
the reaper, the fair queue's tenants, the warm pool's resize."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from nbfleet.agent.warmpool import WarmPool
from nbfleet.control.fleet.scheduler import LiveScheduler
from nbfleet.control.fleet.service import FleetService, _Effects
from nbfleet.control.fleet.sizing import FleetSettings, sized_policy
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.protocol.agent import ResizeWarmPool, WarmPoolState
from nbfleet.protocol.gpu import ActiveBinding, AgentBindings, CellBinding

ONE_A100 = HostInventory(8000, 64000, (GpuGroup(1, "A100-80GB", 80),))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Agents:
    """An agent's bindings report and warm pool, as ``AgentClient`` returns them."""

    def __init__(self) -> None:
        self.bound: list[ActiveBinding] = []
        self.pool = WarmPoolState(target=0, ready=0)

    async def bindings(self, url: str) -> AgentBindings:
        return AgentBindings(bindings=self.bound)

    async def warm_pool(self, url: str, target: int | None = None) -> WarmPoolState:
        if target is not None:  # the agent's kernels start at once here
            self.pool = WarmPoolState(target=target, ready=target)
        return self.pool


def service() -> tuple[FleetService, LiveScheduler, Clock, Agents]:
    agents, clock = Agents(), Clock()
    fleet = FleetService(SimpleNamespace(agents=agents))  # type: ignore[arg-type]
    scheduler = LiveScheduler(sized_policy(FleetSettings(), [ONE_A100], 1), clock=clock)
    scheduler.host_joined("h0", ONE_A100)
    fleet.scheduler, fleet._host_urls = scheduler, {"h0": "http://h0"}
    return fleet, scheduler, clock, agents


async def test_a_cell_still_on_its_way_to_its_kernel_keeps_its_gpus() -> None:
    """A kernel that moves to its cell's host takes seconds; its agent cannot report
    the cell before it arrives, and the GPUs must not be given away meanwhile."""
    fleet, scheduler, clock, agents = service()
    scheduler.open_kernel("ws", ResourceSpec(gpus=1))
    await scheduler.acquire("k/1", "ws", 1)
    clock.t = 60.0
    assert await fleet.reap_unreported() == 0 and "k/1" in scheduler.running
    scheduler.delivered("k/1")
    agents.bound = [ActiveBinding(kernel_id="k", msg_id="1", age_s=1.0, binding=CellBinding(
        task_id="k/1", host_id="h0", gpu_indices=(0,), gpu_type="A100-80GB"))]
    clock.t = 120.0
    assert await fleet.reap_unreported() == 0, "reported by its agent: still running"
    agents.bound = []
    assert await fleet.reap_unreported() == 1 and "k/1" not in scheduler.running


async def test_a_rebuilt_models_hosts_get_their_warm_containers() -> None:
    """A rebuild asks for each host's warm pool before its scheduler is the
    service's: the containers must still be counted ready when they are."""
    agents = Agents()
    fleet = FleetService(SimpleNamespace(agents=agents))  # type: ignore[arg-type]
    fleet._host_urls = {"h0": "http://h0"}
    effects = _Effects(fleet)
    policy = sized_policy(FleetSettings(policy="notebookos"), [ONE_A100], 1)
    scheduler = effects.scheduler = LiveScheduler(policy, effects=effects)
    scheduler.rebuild([("h0", ONE_A100)], [], [])
    fleet.scheduler = scheduler
    await asyncio.gather(*fleet._prewarms)
    rebuilt = scheduler.policy
    assert (rebuilt.warm["h0"], rebuilt.warming["h0"], agents.pool.target) == (1, 0, 1)


async def test_a_workspace_waits_as_its_project_with_its_weight() -> None:
    fleet, scheduler, _, _ = service()
    fleet.place("ws1", ResourceSpec(gpus=1), tenant="proj-a", weight=3.0)
    fleet.place("ws2", ResourceSpec(gpus=1), tenant="proj-b", weight=1.0)
    assert scheduler.policy.kernels["ws1"].tenant == "proj-a"
    assert scheduler.policy.fair.weights == {"proj-a": 3.0, "proj-b": 1.0}


def test_the_warm_pool_grows_to_the_schedulers_figure_never_below_its_own() -> None:
    async def run() -> list[int]:
        pool = WarmPool(2, new_slot=lambda name: None, sandbox=None)  # type: ignore[arg-type,return-value]
        sizes = [pool.resize(5), pool.resize(1), pool.resize(0)]
        await pool.shutdown()
        return sizes

    assert asyncio.run(run()) == [5, 2, 2]


@pytest.mark.parametrize("target", [-1, 257, "many", None])
def test_a_warm_pool_order_outside_the_contract_is_refused(target: Any) -> None:
    with pytest.raises(ValidationError):
        ResizeWarmPool.model_validate({"target": target})
