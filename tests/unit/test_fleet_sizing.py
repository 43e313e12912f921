"""The policy a control plane runs, sized for its fleet, and its decision log."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, cast

from nbfleet.control.fleet.provider import HostState, ProvisionedHost
from nbfleet.control.fleet.scaling import Scaler
from nbfleet.control.fleet.scheduler import LiveScheduler
from nbfleet.control.fleet.sizing import FleetSettings, outgrown, policy_config, sized_policy
from nbfleet.control.fleet.view import decisions_view
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.resources import GpuGroup, HostInventory
from nbfleet.policy.scheduling.decisions import Migrated, Started, StartPath, decision_record

ONE_A100 = HostInventory(8000, 64000, (GpuGroup(1, "A100-80GB", 80),))


def test_replicas_never_exceed_the_hosts_the_fleet_can_have() -> None:
    alone = policy_config(FleetSettings(policy="notebookos"), [ONE_A100], static_hosts=1)
    assert alone.replicas == 1
    grown = policy_config(FleetSettings(policy="notebookos", host_gpus="1xA100-80GB",
                                        max_hosts=5), [ONE_A100], static_hosts=1)
    assert grown.replicas == 3 and grown.autoscaler.max_hosts == 5
    assert policy_config(FleetSettings(policy="notebookos", replicas=2), [ONE_A100] * 4,
                         4).replicas == 2


def test_the_autoscaler_never_counts_on_removing_hosts_it_did_not_start() -> None:
    config = policy_config(FleetSettings(host_gpus="1xA100-80GB", max_hosts=4),
                           [ONE_A100] * 2, static_hosts=2)
    assert config.autoscaler.min_hosts == 2
    # A tick with no demand scales in only what exceeds the static hosts.
    policy = sized_policy(FleetSettings(host_gpus="1xA100-80GB", max_hosts=4),
                          [ONE_A100] * 3, static_hosts=2)
    live = LiveScheduler(policy)
    for n in range(3):
        live.host_joined(f"h{n}", ONE_A100)
    live.tick()
    scale_ins = [d.decision for d in live.log if type(d.decision).__name__ == "ScaleIn"]
    assert [len(d.host_ids) for d in scale_ins] == [1]  # type: ignore[union-attr]


def test_a_fleet_that_outgrew_its_policy_is_noticed() -> None:
    settings = FleetSettings(policy="notebookos")
    policy = sized_policy(settings, [], static_hosts=0)  # a fresh start: no host yet
    assert policy.config.replicas == 1
    assert outgrown(policy, settings, [ONE_A100] * 3)
    assert not outgrown(sized_policy(settings, [ONE_A100] * 3, 3), settings, [ONE_A100] * 3)


def test_decisions_are_records_with_their_kind() -> None:
    started = Started("k/1", "ws", "h0", (0, 1), StartPath.MIGRATE_WARM)
    assert decision_record(started) == {
        "kind": "Started", "task_id": "k/1", "kernel_id": "ws", "host_id": "h0",
        "gpu_indices": [0, 1], "path": "migrate_warm"}
    assert decision_record(Migrated("ws", "h0", "h1", True))["for_task"] is True


async def test_the_decision_log_pages_in_order() -> None:
    policy = sized_policy(FleetSettings(), [ONE_A100], 1)
    live = LiveScheduler(policy)
    live.host_joined("h0", ONE_A100)
    live.open_kernel("ws", ResourceSpec(gpus=1))
    await asyncio.wait_for(live.acquire("k/1", "ws", 1), 1)
    everything = decisions_view(live, after=-1, limit=100)
    seqs = [item["seq"] for item in everything["items"]]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 3
    assert everything["items"][-1]["kind"] == "Started"
    first_two = decisions_view(live, after=-1, limit=2)
    assert [i["seq"] for i in first_two["items"]] == [0, 1] and first_two["next"] == 1
    rest = decisions_view(live, after=first_two["next"], limit=100)
    assert [i["seq"] for i in rest["items"]] == seqs[2:]
    assert decisions_view(live, after=seqs[-1], limit=100)["items"] == []


class _TwoHosts:
    """A provider that started a1 and a2 (only ``hosts`` is consulted here)."""

    def hosts(self) -> list[ProvisionedHost]:
        return [ProvisionedHost(f"local-{n}", f"a{n}", HostState.RUNNING,
                                datetime.now(UTC)) for n in (1, 2)]


def test_hosts_on_their_way_out_do_not_raise_the_autoscaler_s_floor() -> None:
    """A host the scaler released is registered until its heartbeats lapse; it is
    not a host someone else started, or the floor would jump to the fleet's peak
    and the autoscaler would scale out again at once."""
    scaler = Scaler(cast(Any, None), cast(Any, _TwoHosts()))
    fleet = ["static", "a1", "a2", "gone-a3", "admin-drained"]
    assert scaler.static_hosts(fleet) == 3
    scaler.draining.add("gone-a3")  # released by this scaler, still registered
    assert scaler.static_hosts(fleet, leaving={"admin-drained"}) == 1
