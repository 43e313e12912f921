"""What let a burst of resumes queue behind each other in the control plane.

A reconciler tick used to wait for every workspace it had started before it looked
for new ones (and took 8 at a time), and every workspace change woke every waiter
of every workspace. Now each workspace is reconciled by a task of its own, and a
change wakes the waiters of that workspace only.
"""

from __future__ import annotations

import asyncio
import weakref
from types import SimpleNamespace

import pytest

from nbfleet.control import reconciler as reconciler_module
from nbfleet.control.fleet.service import GpuPlacement
from nbfleet.control.fleet.sizing import FleetSettings
from nbfleet.control.platform import Platform
from nbfleet.control.reconciler import NeedsGpuPlacement, Reconciler
from nbfleet.model.cluster import ResourceSpec

pytestmark = pytest.mark.no_db


class FakeFleet:
    token = 7

    async def sync_hosts(self) -> None:
        pass

    async def periodic(self) -> None:
        pass


def test_a_tick_starts_new_work_without_waiting_for_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        wakes: list[bool] = []
        platform = SimpleNamespace(db=None, fleet=FakeFleet(), instance_id="ctl_t",
                                   standbys=SimpleNamespace(kick=lambda: None),
                                   config=SimpleNamespace(lease_ttl_s=10.0, fleet=FleetSettings()),
                                   wake=lambda: wakes.append(True))
        monkeypatch.setattr(reconciler_module.leases, "acquire", lambda *args: 7)
        rec = Reconciler(platform)  # type: ignore[arg-type]
        due: list[str] = []
        gates: dict[str, asyncio.Event] = {}
        started: list[str] = []

        async def reconcile(workspace_id: str) -> None:
            started.append(workspace_id)
            gates[workspace_id] = asyncio.Event()
            await gates[workspace_id].wait()

        monkeypatch.setattr(rec, "_mark_dead_hosts", lambda: None)
        monkeypatch.setattr(rec, "_due", lambda: list(due))
        monkeypatch.setattr(rec, "reconcile", reconcile)

        due[:] = ["ws_a", "ws_b"]
        await asyncio.wait_for(rec.tick(), 1.0)  # returns with both still running
        await asyncio.sleep(0.01)
        assert started == ["ws_a", "ws_b"]
        due[:] = ["ws_a", "ws_c"]  # ws_a asked again while its task runs
        await asyncio.wait_for(rec.tick(), 1.0)
        await asyncio.sleep(0.01)
        assert started == ["ws_a", "ws_b", "ws_c"]  # one task per workspace at a time
        gates["ws_b"].set()
        await asyncio.sleep(0.01)
        assert wakes == []
        gates["ws_a"].set()  # its second request is looked at as soon as it ends
        await asyncio.sleep(0.01)
        assert wakes == [True] and set(rec._running) == {"ws_c"}
        gates["ws_c"].set()
        await asyncio.sleep(0.01)
        assert rec._running == {}

    asyncio.run(main())


def bare_platform() -> Platform:
    platform = object.__new__(Platform)
    platform._changed = None
    platform._changed_for = weakref.WeakValueDictionary()
    platform._loop = None
    return platform


def test_a_change_wakes_the_waiters_of_its_workspace_only() -> None:
    async def main() -> None:
        platform = bare_platform()
        mine, other, anyone = (platform.changed("ws_a"), platform.changed("ws_b"),
                               platform.changed())
        assert platform.changed("ws_a") is mine  # one event per workspace
        platform._fire_changed("ws_a")
        assert mine.is_set() and anyone.is_set() and not other.is_set()
        again = platform.changed("ws_a")
        assert again is not mine and not again.is_set()
        platform._fire_changed(None)  # a change of unknown scope wakes everyone
        assert other.is_set() and again.is_set()

    asyncio.run(main())


def test_an_abandoned_wait_leaves_nothing_behind() -> None:
    platform = bare_platform()
    platform.changed("ws_gone")
    assert "ws_gone" not in platform._changed_for  # nobody holds it: collected


def test_a_gpu_placement_is_never_chosen_while_the_fleet_model_is_rebuilt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice and its record in the database happen together, between rebuilds:
    a rebuild (from the database) in between would forget a placement then carried
    out, and the same GPUs could be given twice."""
    async def main() -> None:
        rebuilding = asyncio.Event()
        rebuilt = asyncio.Event()
        events: list[str] = []

        class RebuildingFleet(FakeFleet):
            token = 0  # not yet the lease's: the duties rebuild the model

            async def take_over(self, token: int) -> None:
                events.append("rebuild starts")
                rebuilding.set()
                await rebuilt.wait()
                events.append("rebuild ends")
                self.token = token

            def place(self, *args: object) -> GpuPlacement:
                events.append("placed")
                return GpuPlacement(("host_a",))

        platform = SimpleNamespace(db=None, fleet=RebuildingFleet(), instance_id="ctl_t",
                                   standbys=SimpleNamespace(kick=lambda: None),
                                   config=SimpleNamespace(lease_ttl_s=10.0, fleet=FleetSettings()),
                                   wake=lambda: None,
                                   notify_changed=lambda *args: None)
        monkeypatch.setattr(reconciler_module.leases, "acquire", lambda *args: 7)
        rec = Reconciler(platform)  # type: ignore[arg-type]
        monkeypatch.setattr(rec, "_mark_dead_hosts", lambda: None)
        monkeypatch.setattr(rec, "_due", lambda: [])

        def begin(workspace_id: str, placement: object = None) -> object:
            if placement is None:
                return reconciler_module.NeedsGpuPlacement(workspace_id, None, "t", 1.0)  # type: ignore[arg-type]
            events.append("recorded")
            return None

        monkeypatch.setattr(rec, "_begin", begin)
        duties = asyncio.create_task(rec.tick())
        await rebuilding.wait()
        placing = asyncio.create_task(rec.reconcile("ws_gpu"))
        await asyncio.sleep(0.05)
        assert events == ["rebuild starts"]  # the placement waits for the rebuild
        rebuilt.set()
        await asyncio.wait_for(asyncio.gather(duties, placing), 1.0)
        assert events == ["rebuild starts", "rebuild ends", "placed", "recorded"]

    asyncio.run(main())


def test_a_tick_that_skipped_the_duties_comes_back_for_them_soon(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wake-up within DUTIES_EVERY_S of the last duties skips them (a burst of
    requests must not renew the lease dozens of times a second); whatever woke it
    (a drain) is then seen to within DUTIES_EVERY_S, not after a whole interval
    (it took a second, measured by bench/replicas.py)."""
    async def main() -> None:
        platform = SimpleNamespace(db=None, fleet=FakeFleet(), instance_id="ctl_t",
                                   standbys=SimpleNamespace(kick=lambda: None),
                                   config=SimpleNamespace(lease_ttl_s=10.0, fleet=FleetSettings()),
                                   wake=lambda: None)
        monkeypatch.setattr(reconciler_module.leases, "acquire", lambda *args: 7)
        rec = Reconciler(platform)  # type: ignore[arg-type]
        monkeypatch.setattr(rec, "_mark_dead_hosts", lambda: None)
        monkeypatch.setattr(rec, "_due", lambda: [])
        await rec.tick()  # the duties ran
        assert rec._next_wait(1.0) == 1.0
        await rec.tick()  # woken again at once: skipped
        assert 0.0 < rec._next_wait(1.0) <= reconciler_module.DUTIES_EVERY_S
    asyncio.run(main())


def test_a_refused_placement_is_asked_again_once_the_hosts_are_fed() -> None:
    """A host that registered since the last duties pass is not in the scheduler's
    model yet: a GPU workspace created at once was refused ("no host shape has GPUs
    that fit") and failed for good. The reconciler now feeds the model the hosts and
    asks again before it takes the refusal (seen in CI on PostgreSQL)."""
    async def main() -> list[GpuPlacement]:
        synced: list[bool] = []

        class Fleet(FakeFleet):
            async def sync_hosts(self) -> None:
                synced.append(True)

            def place(self, workspace_id: str, spec: ResourceSpec, tenant: str,
                      weight: float) -> GpuPlacement:
                if synced:
                    return GpuPlacement(("host_new",))
                return GpuPlacement(refused="no host shape has GPUs that fit 1 x any")

        platform = SimpleNamespace(db=None, fleet=Fleet(), instance_id="ctl_t",
                                   standbys=SimpleNamespace(kick=lambda: None),
                                   config=SimpleNamespace(lease_ttl_s=10.0, fleet=FleetSettings()),
                                   wake=lambda: None)
        rec = Reconciler(platform)  # type: ignore[arg-type]
        rec.token = 7
        seen: list[GpuPlacement] = []

        def begin(workspace_id: str, placement: GpuPlacement | None = None) -> object:
            if placement is None:
                return NeedsGpuPlacement(workspace_id, ResourceSpec(gpus=1), "proj", 1.0)
            seen.append(placement)
            return None  # settled: the test looks only at the placement

        rec._begin = begin  # type: ignore[method-assign]
        await asyncio.wait_for(rec.reconcile("ws_a"), 1.0)
        return seen

    seen = asyncio.run(main())
    assert [p.hosts for p in seen] == [("host_new",)], seen
    assert seen[0].refused is None
