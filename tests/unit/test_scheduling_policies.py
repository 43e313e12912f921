"""Decisions of each placement policy on small hand-made clusters."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nbfleet.model.cluster import Gpu, Host, ResourceSpec
from nbfleet.policy.scheduling import autoscaler
from nbfleet.policy.scheduling.base import FleetPolicy
from nbfleet.policy.scheduling.config import AutoscalerConfig, PolicyConfig
from nbfleet.policy.scheduling.decisions import (
    Decision,
    KernelRequest,
    Migrated,
    Placed,
    Prewarm,
    Queued,
    Reclaimed,
    ScaleIn,
    ScaleOut,
    Started,
    StartPath,
    TaskRequest,
    Unschedulable,
)
from nbfleet.policy.scheduling.notebookos import NotebookOS
from nbfleet.policy.scheduling.registry import POLICIES, default_config, make_policy


def host(host_id: str, gpus: int = 8, gpu_type: str = "V100-16GB", vram_gb: int = 16) -> Host:
    return Host(host_id, 64_000, 488_000, [Gpu(i, gpu_type, vram_gb) for i in range(gpus)])


def fleet(policy: FleetPolicy, *hosts: Host, now: float = 0.0) -> list[Decision]:
    out: list[Decision] = []
    for h in hosts:
        out += policy.add_host(h, now)
    return out


def busy(h: Host, count: int, holder: str = "outside") -> None:
    """Bind ``count`` free GPUs of ``h`` (lowest first) to work the policy does not run."""
    h.commit(f"{holder}-{h.id}", [g.index for g in h.free_gpus()[:count]])


def open_k(policy: FleetPolicy, kernel_id: str, gpus: int, now: float = 0.0,
           gpu_types: tuple[str, ...] = ()) -> list[Decision]:
    spec = ResourceSpec(gpus=gpus, gpu_types=gpu_types)
    return policy.open_session(KernelRequest(kernel_id, spec), now)


def submit(policy: FleetPolicy, task_id: str, kernel_id: str, gpus: int,
           now: float = 0.0) -> list[Decision]:
    return policy.submit(TaskRequest(task_id, kernel_id, gpus), now)


def only(decisions: list[Decision], kind: type) -> list[Decision]:
    return [d for d in decisions if isinstance(d, kind)]


def scale_outs(decisions: list[Decision]) -> list[int]:
    """The host counts of the ``ScaleOut`` decisions (their reasons are prose)."""
    return [d.count for d in decisions if isinstance(d, ScaleOut)]


def no_prewarm(replicas: int = 1, *, sr_high_watermark: float = 3.0,
               autoscaler: AutoscalerConfig | None = None) -> PolicyConfig:
    return PolicyConfig(replicas=replicas, prewarm_per_host=0,
                        sr_high_watermark=sr_high_watermark,
                        autoscaler=autoscaler or AutoscalerConfig())


# ------------------------------------------------------------------ reservation
def test_reservation_commits_on_the_best_fitting_host_at_open() -> None:
    p = make_policy("reservation")
    a, b, c = host("a", 8), host("b", 4), host("c", 2)
    assert fleet(p, a, b, c) == []  # no prewarm pool, nothing waiting
    # 4 GPUs: c is too small, b (4 free) fits tighter than a (8 free).
    assert open_k(p, "k1", 4) == [Placed("k1", ("b",))]
    assert b.bound("k1") == (0, 1, 2, 3) and b.committed_gpus == 4
    assert open_k(p, "k2", 2) == [Placed("k2", ("c",))]
    # b and c are full now: the next kernel goes to a.
    assert open_k(p, "k3", 1) == [Placed("k3", ("a",))]
    assert (a.committed_gpus, b.committed_gpus, c.committed_gpus) == (1, 4, 2)
    # Among equally full hosts the one with fewer free GPUs wins: a has 7, d has 8.
    d = host("d", 8)
    fleet(p, d)
    assert open_k(p, "k4", 2) == [Placed("k4", ("a",))]
    assert a.bound("k4") == (1, 2)


def test_reservation_tasks_run_on_the_reserved_gpus_and_close_releases_them() -> None:
    p = make_policy("reservation")
    a, b = host("a", 8), host("b", 8)
    fleet(p, a, b)
    busy(a, 4)
    assert open_k(p, "k1", 4) == [Placed("k1", ("a",))]
    assert a.bound("k1") == (4, 5, 6, 7)
    started = submit(p, "t1", "k1", 2)
    assert started == [Started("t1", "k1", "a", (4, 5), StartPath.RESERVED)]
    assert a.committed_gpus == 8 and b.committed_gpus == 0  # nothing new is bound
    assert p.finish("t1", 10.0) == []
    assert a.bound("k1") == (4, 5, 6, 7)  # the session keeps its GPUs between tasks
    assert p.close_session("k1", 20.0) == []
    assert a.bound("k1") == () and a.committed_gpus == 4
    assert "k1" not in p.kernels


def test_reservation_session_that_fits_nowhere_waits_and_scales_out() -> None:
    p = make_policy("reservation")
    a, b = host("a", 8), host("b", 8)
    fleet(p, a, b)
    assert open_k(p, "k1", 6) == [Placed("k1", ("a",))]
    assert open_k(p, "k2", 6) == [Placed("k2", ("b",))]
    out = open_k(p, "k3", 4, now=5.0)
    # 12 committed + 4 waiting = 16 GPUs -> ceil(1.05 x 2) = 3 hosts: one more.
    assert len(out) == 1 and isinstance(out[0], ScaleOut) and out[0].count == 1
    assert p.provisioning == 1 and list(p.waiting_kernels) == ["k3"]
    assert a.bound("k3") == b.bound("k3") == ()
    queued = submit(p, "t3", "k3", 4, now=6.0)
    assert queued == [Queued("t3", "waiting for its kernel to be placed")]  # no 2nd ScaleOut
    assert p.provisioning == 1
    # Closing k1 frees 6 GPUs on a: k3 is placed there and its queued task starts.
    out = p.close_session("k1", 7.0)
    assert out == [Placed("k3", ("a",)),
                   Started("t3", "k3", "a", (0, 1, 2, 3), StartPath.RESERVED)]
    assert not p.waiting_kernels and not p.queue
    # The host that was provisioned joins; it only lowers the provisioning count.
    assert p.add_host(host("c"), 8.0) == [] and p.provisioning == 0


# ------------------------------------------------------------------------ batch
def test_batch_is_strict_fcfs_cold_and_releases_on_finish() -> None:
    p = make_policy("batch")
    a, b = host("a", 4), host("b", 4)
    fleet(p, a, b)
    for k in ("k1", "k2", "k3", "k4"):
        assert open_k(p, k, 4) == [Placed(k, ())]  # nothing is created before a task
    assert a.committed_gpus == b.committed_gpus == 0
    assert submit(p, "t1", "k1", 4) == [Started("t1", "k1", "a", (0, 1, 2, 3), StartPath.COLD)]
    # Best fit: a has no room, b takes the 1-GPU job.
    assert submit(p, "t2", "k2", 1) == [Started("t2", "k2", "b", (0,), StartPath.COLD)]
    out = submit(p, "t3", "k3", 4, now=1.0)
    assert out[0] == Queued("t3", "no free GPUs")
    # 5 committed + 4 queued = 9 GPUs on 8-GPU shapes -> ceil(1.05 x 9 / 8) = 2 hosts:
    # the sums fit, the pieces do not, so one host is asked for anyway.
    assert [type(d) for d in out[1:]] == [ScaleOut]
    # b has 3 free GPUs, but the 1-GPU job may not overtake the queued 4-GPU head.
    assert submit(p, "t4", "k4", 1, now=2.0) == [Queued("t4", "no free GPUs")]
    assert b.committed_gpus == 1
    assert [t.id for t in p.queue] == ["t3", "t4"]
    # t2 ends: the head starts on b; t4 still has no room (a full, b full).
    assert p.finish("t2", 3.0) == [Started("t3", "k3", "b", (0, 1, 2, 3), StartPath.COLD)]
    assert b.bound("t2") == () and b.bound("t3") == (0, 1, 2, 3)
    assert [t.id for t in p.queue] == ["t4"]
    assert p.finish("t1", 4.0) == [Started("t4", "k4", "a", (0,), StartPath.COLD)]
    assert a.bound("t1") == () and a.holder_of(0) == "t4" and a.committed_gpus == 1
    p.finish("t3", 5.0)
    p.finish("t4", 5.0)
    assert a.committed_gpus == b.committed_gpus == 0 and not p.running


# -------------------------------------------------------------------------- lcp
def test_lcp_takes_warm_containers_then_cold_and_returns_them_to_the_pool() -> None:
    p = make_policy("lcp", PolicyConfig(replicas=1, prewarm_per_host=1))
    a, b = host("a", 4), host("b", 4)
    assert fleet(p, a, b) == [Prewarm("a", 1), Prewarm("b", 1)]
    assert p.warm == {"a": 0, "b": 0} and p.warming == {"a": 1, "b": 1}
    open_k(p, "k1", 1)
    open_k(p, "k2", 1)
    open_k(p, "k3", 1)
    assert p.prewarmed("a", 1, 1.0) == []
    assert p.warm["a"] == 1 and p.warming["a"] == 0
    assert submit(p, "t1", "k1", 1, 2.0) == [Started("t1", "k1", "a", (0,), StartPath.WARM)]
    assert p.warm["a"] == 0  # taken, and not refilled: it comes back after the task
    # No warm container anywhere: cold, best fit (a has 3 free, b 4).
    assert submit(p, "t2", "k2", 1, 3.0) == [Started("t2", "k2", "a", (1,), StartPath.COLD)]
    assert p.finish("t1", 4.0) == []
    assert p.warm["a"] == 1 and a.bound("t1") == ()
    # The cold container joins the pool too, but the pool stays at its target.
    assert p.finish("t2", 5.0) == []
    assert p.warm["a"] == 1 and a.committed_gpus == 0
    # A warm host goes before a better-fitting cold one (b: 1 free, still warming).
    busy(b, 3)
    assert submit(p, "t3", "k3", 1, 6.0) == [Started("t3", "k3", "a", (0,), StartPath.WARM)]
    assert p.warm["a"] == 0
    # b's container is ready: now b is the warm host, and a is passed over.
    assert p.prewarmed("b", 1, 7.0) == []
    open_k(p, "k4", 1)
    assert submit(p, "t4", "k4", 1, 8.0) == [Started("t4", "k4", "b", (3,), StartPath.WARM)]
    assert p.warm == {"a": 0, "b": 0}


def test_lcp_warm_pool_never_exceeds_its_target() -> None:
    p = make_policy("lcp", PolicyConfig(replicas=1, prewarm_per_host=1))
    a = host("a", 4)
    assert fleet(p, a) == [Prewarm("a", 1)]
    open_k(p, "k1", 1)
    assert submit(p, "t1", "k1", 1, 1.0)[0] == Started("t1", "k1", "a", (0,), StartPath.COLD)
    p.finish("t1", 2.0)
    p.prewarmed("a", 1, 3.0)
    assert p.warm["a"] <= p.prewarm_target(a)


# ------------------------------------------------------------------- notebookos
def test_notebookos_places_three_replicas_on_distinct_hosts_with_most_idle_gpus() -> None:
    p = make_policy("notebookos", no_prewarm(3))
    a, b, c, d = host("a"), host("b"), host("c"), host("d")
    fleet(p, a, b, c, d)
    busy(a, 6)
    busy(b, 2)
    busy(d, 4)
    # Idle GPUs: a 2, b 6, c 8, d 4 -> c, b, d.
    assert open_k(p, "k1", 2) == [Placed("k1", ("c", "b", "d"))]
    assert p.kernels["k1"].hosts == ["c", "b", "d"]
    for h in (b, c, d):
        assert h.subscriptions == {"k1": ResourceSpec(gpus=2)}
        assert h.bound("k1") == ()  # replicas subscribe, they bind nothing
    assert a.subscriptions == {}


@pytest.mark.parametrize("name", ["notebookos", "nbfleet"])
def test_a_replica_lost_with_its_host_is_placed_again_on_another_host(name: str) -> None:
    """The live platform keeps a standby on each replica host: one that died is
    made again where the policy puts the kernel's new replica."""
    p = make_policy(name, no_prewarm(2))
    fleet(p, host("a"), host("b"), host("c"))
    (placed,) = only(open_k(p, "k1", 1), Placed)
    assert isinstance(placed, Placed) and len(placed.host_ids) == 2
    spare = next(h for h in ("a", "b", "c") if h not in placed.host_ids)
    lost, kept = placed.host_ids
    out = p.lose_host(lost, 5.0)
    assert Placed("k1", (spare,)) in out, "a repair names only the host it adds"
    assert p.kernels["k1"].hosts == [kept, spare]
    assert p.hosts[spare].subscriptions == {"k1": ResourceSpec(gpus=1)}
    # With nowhere left to go, the kernel keeps the replica it has...
    assert only(p.lose_host(spare, 6.0), Placed) == []
    assert p.kernels["k1"].hosts == [kept] and p.kernels["k1"].placed
    assert p.short == {"k1"}
    # ... until a host joins: the kernel (and only it) is made whole there.
    assert only(p.add_host(host("d"), 7.0), Placed) == [Placed("k1", ("d",))]
    assert p.kernels["k1"].hosts == [kept, "d"] and p.short == set()


def test_a_host_join_never_gives_back_a_replica_nbfleet_shrank_on_purpose() -> None:
    """Measured at a0f6044 on two days of a real month: 8,001 idle shrinks, 7,865
    re-growths by ``fill_replicas`` at 222 host joins. A host join repairs only
    what a lost host took; the kernel's next task grows it back."""
    config = dataclasses.replace(default_config("nbfleet"), prewarm_per_host=0)
    p = make_policy("nbfleet", config)
    fleet(p, host("a"), host("b"), host("c"))
    open_k(p, "k1", 1)
    assert len(p.kernels["k1"].hosts) == 3
    shrunk = only(p.tick(config.shrink_idle_s + 1), Reclaimed)
    assert len(shrunk) == 1 and len(p.kernels["k1"].hosts) == config.idle_replicas
    assert only(p.add_host(host("d"), config.shrink_idle_s + 2), Placed) == []
    assert len(p.kernels["k1"].hosts) == config.idle_replicas
    # A host lost now is repaired to the two it kept, not to three.
    lost = p.kernels["k1"].hosts[0]
    (repaired,) = only(p.lose_host(lost, config.shrink_idle_s + 2.5), Placed)
    assert isinstance(repaired, Placed) and len(repaired.host_ids) == 1
    assert len(p.kernels["k1"].hosts) == config.idle_replicas
    # Activity grows it back, and the decision names only the host it adds.
    started = submit(p, "t1", "k1", 1, now=config.shrink_idle_s + 3)
    (grown,) = only(started, Placed)
    assert isinstance(grown, Placed) and len(grown.host_ids) == 1
    assert len(p.kernels["k1"].hosts) == 3


def test_notebookos_waits_for_three_hosts() -> None:
    p = make_policy("notebookos", no_prewarm(3))
    fleet(p, host("a"), host("b"))
    out = open_k(p, "k1", 1)
    assert [type(d) for d in out] == [ScaleOut]  # floor: never fewer than 3 hosts
    assert list(p.waiting_kernels) == ["k1"]
    assert p.add_host(host("c"), 1.0) == [Placed("k1", ("a", "b", "c"))]


@pytest.mark.parametrize(("watermark", "placed"), [(3.0, ("a", "b", "c")),
                                                    (0.5, ("b", "c", "d"))])
def test_notebookos_sr_high_watermark_rejects_a_host(
        watermark: float, placed: tuple[str, ...]) -> None:
    p = make_policy("notebookos", no_prewarm(3, sr_high_watermark=watermark))
    a, b, c, d = host("a"), host("b"), host("c"), host("d")
    fleet(p, a, b, c, d)
    a.subscribe("other", ResourceSpec(gpus=10))  # a is idle but heavily subscribed
    for h in (b, c, d):
        busy(h, 2)
    # a's SR after placing 4 more GPUs: 14 / (8 x 3) = 0.58 > 0.5 when the watermark
    # caps the limit; with the default watermark the limit is the floor, 1.
    assert isinstance(p, NotebookOS)
    assert p.sr_limit(12) == pytest.approx(min(watermark, 1.0))
    assert open_k(p, "k1", 4) == [Placed("k1", placed)]


def notebookos_kernel(prewarm: int = 0) -> tuple[FleetPolicy, dict[str, Host]]:
    """k1 (1 GPU) with replicas on hosts a, b and c."""
    p = make_policy("notebookos", PolicyConfig(replicas=3, prewarm_per_host=prewarm))
    hosts = {i: host(i) for i in "abc"}
    fleet(p, *hosts.values())
    assert open_k(p, "k1", 1) == [Placed("k1", ("a", "b", "c"))]
    return p, hosts


def test_notebookos_executor_prefers_the_last_executor() -> None:
    p, h = notebookos_kernel()
    busy(h["a"], 2)
    # No last executor yet: the replica host with the most free GPUs (b, then c by id).
    assert submit(p, "t1", "k1", 1) == [Started("t1", "k1", "b", (0,), StartPath.LOCAL)]
    p.finish("t1", 1.0)
    assert p.kernels["k1"].last_executor == "b"
    busy(h["b"], 4)  # b now has 4 free, c 8: the last executor still goes first
    assert submit(p, "t2", "k1", 1, 2.0) == [Started("t2", "k1", "b", (4,), StartPath.LOCAL)]
    p.finish("t2", 3.0)
    busy(h["b"], 4, holder="more")  # b is full: the most free among the others
    assert submit(p, "t3", "k1", 1, 4.0) == [Started("t3", "k1", "c", (0,), StartPath.LOCAL)]


@pytest.mark.parametrize("warm", [True, False])
def test_notebookos_migrates_a_replica_to_a_host_with_free_gpus(warm: bool) -> None:
    p, h = notebookos_kernel(prewarm=1 if warm else 0)
    d, e = host("d"), host("e")
    fleet(p, d, e)
    for i in "abc":
        busy(h[i], 8)
    busy(e, 6)  # d has 8 free, e 2
    h["b"].subscribe("other", ResourceSpec(gpus=4))  # b is the most subscribed replica
    if warm:
        p.prewarmed("e", 1, 1.0)  # a warm container beats more free GPUs
        out = submit(p, "t1", "k1", 1, 2.0)
        assert out == [Started("t1", "k1", "e", (6,), StartPath.MIGRATE_WARM),
                       Migrated("k1", "b", "e", warm=True),
                       Prewarm("e", 1)]
        assert p.warm["e"] == 0 and p.warming["e"] == 1
        target = e
    else:
        out = submit(p, "t1", "k1", 1, 2.0)
        assert out == [Started("t1", "k1", "d", (0,), StartPath.MIGRATE_COLD),
                       Migrated("k1", "b", "d", warm=False)]
        target = d
    assert p.kernels["k1"].hosts == ["a", target.id, "c"]
    assert "k1" not in h["b"].subscriptions and "k1" in target.subscriptions
    assert p.running["t1"].host_id == target.id


def test_notebookos_queues_and_scales_out_when_no_host_has_free_gpus() -> None:
    p = make_policy("notebookos", no_prewarm(3))
    a, b, c = host("a", 4), host("b", 4), host("c", 4)
    fleet(p, a, b, c)
    for k in ("k1", "k2", "k3", "k4"):
        assert open_k(p, k, 4) == [Placed(k, ("a", "b", "c"))]
    assert submit(p, "t1", "k1", 4)[0] == Started("t1", "k1", "a", (0, 1, 2, 3),
                                                   StartPath.LOCAL)
    assert submit(p, "t2", "k2", 4)[0] == Started("t2", "k2", "b", (0, 1, 2, 3),
                                                   StartPath.LOCAL)
    assert submit(p, "t3", "k3", 4)[0] == Started("t3", "k3", "c", (0, 1, 2, 3),
                                                   StartPath.LOCAL)
    out = submit(p, "t4", "k4", 4, 1.0)
    assert out[0] == Queued("t4", "no free GPUs")
    # Committed 12 + queued 4 = 16 GPUs on 8-GPU shapes: ceil(1.05 x 2) = 3 hosts,
    # which are there; nothing is pending, so one host is asked for anyway.
    assert [type(d) for d in out[1:]] == [ScaleOut]
    assert not only(out, Migrated) and p.kernels["k4"].hosts == ["a", "b", "c"]
    assert p.finish("t2", 2.0) == [Started("t4", "k4", "b", (0, 1, 2, 3), StartPath.LOCAL)]
    assert b.bound("t4") == (0, 1, 2, 3) and not p.queue


# ------------------------------------------------------------------- autoscaler
@pytest.mark.parametrize(("config", "demand", "per_host", "floor", "expected"), [
    (AutoscalerConfig(), 0, 8, 0, 0),
    (AutoscalerConfig(), 7, 8, 0, 1),  # 7.35 GPUs -> 1 host
    (AutoscalerConfig(), 8, 8, 0, 2),  # 8.4 GPUs -> 2 hosts
    (AutoscalerConfig(), 16, 8, 0, 3),
    (AutoscalerConfig(), 40, 8, 0, 6),  # 42 GPUs
    (AutoscalerConfig(scaling_factor=1.1), 400, 8, 0, 55),  # 55.000000000000007 in floats
    (AutoscalerConfig(scaling_buffer=2), 7, 8, 0, 3),
    (AutoscalerConfig(scaling_buffer=2), 0, 8, 0, 2),
    (AutoscalerConfig(min_hosts=4), 7, 8, 0, 4),
    (AutoscalerConfig(min_hosts=4), 64, 8, 0, 9),
    (AutoscalerConfig(max_hosts=5), 100, 8, 0, 5),
    (AutoscalerConfig(max_hosts=5), 8, 8, 7, 5),
    (AutoscalerConfig(), 8, 8, 6, 6),
    (AutoscalerConfig(), 8, 4, 0, 3),
])
def test_expected_hosts(config: AutoscalerConfig, demand: int, per_host: int, floor: int,
                        expected: int) -> None:
    assert autoscaler.expected_hosts(config, demand, per_host, floor) == expected


def test_expected_hosts_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        autoscaler.expected_hosts(AutoscalerConfig(), -1, 8)
    with pytest.raises(ValueError):
        autoscaler.expected_hosts(AutoscalerConfig(), 1, 0)
    with pytest.raises(ValueError):
        AutoscalerConfig(scaling_factor=0.9)
    with pytest.raises(ValueError):
        AutoscalerConfig(min_hosts=3, max_hosts=2)


@pytest.mark.parametrize(("config", "ready", "provisioning", "demand", "plan"), [
    (AutoscalerConfig(), 1, 1, 16, autoscaler.ScalePlan(3, add=1)),
    (AutoscalerConfig(), 0, 0, 1, autoscaler.ScalePlan(1, add=1)),
    (AutoscalerConfig(), 3, 0, 16, autoscaler.ScalePlan(3)),
    (AutoscalerConfig(), 5, 0, 7, autoscaler.ScalePlan(1, remove=2)),  # at most 2 at once
    (AutoscalerConfig(), 2, 0, 7, autoscaler.ScalePlan(1, remove=1)),
    (AutoscalerConfig(scale_in_limit=1), 5, 0, 7, autoscaler.ScalePlan(1, remove=1)),
    (AutoscalerConfig(scale_in_limit=0), 5, 0, 7, autoscaler.ScalePlan(1)),
    (AutoscalerConfig(), 5, 1, 7, autoscaler.ScalePlan(1)),  # not while hosts are pending
    (AutoscalerConfig(min_hosts=4), 5, 0, 0, autoscaler.ScalePlan(4, remove=1)),
])
def test_autoscaler_plan(config: AutoscalerConfig, ready: int, provisioning: int, demand: int,
                         plan: autoscaler.ScalePlan) -> None:
    assert autoscaler.plan(config, ready_hosts=ready, provisioning=provisioning,
                           demanded_gpus=demand, gpus_per_host=8) == plan


def test_tick_scales_out_to_the_expected_capacity() -> None:
    p = make_policy("batch", no_prewarm(autoscaler=AutoscalerConfig(min_hosts=2)))
    out = p.tick(0.0)
    assert len(out) == 1 and isinstance(out[0], ScaleOut) and out[0].count == 2
    assert p.provisioning == 2
    assert p.tick(60.0) == []  # pending hosts count as present


def test_scale_in_waits_for_the_cooldown_after_a_scale_out() -> None:
    p = make_policy("batch")
    a, b = host("a"), host("b")
    fleet(p, a, b)
    for k in ("k1", "k2", "k3"):
        open_k(p, k, 8)
    submit(p, "t1", "k1", 8)
    submit(p, "t2", "k2", 8)
    out = submit(p, "t3", "k3", 8, now=100.0)
    # 16 committed + 8 queued = 24 GPUs -> ceil(1.05 x 3) = 4 hosts: two more.
    assert scale_outs(out) == [2]
    assert p.add_host(host("c"), 200.0) == [Started("t3", "k3", "c", tuple(range(8)),
                                                    StartPath.COLD)]
    p.add_host(host("d"), 200.0)
    for t in ("t1", "t2", "t3"):
        p.finish(t, 300.0)
    assert p.tick(699.0) == []  # idle, but within 600 s of the scale-out
    assert p.tick(700.0) == [ScaleIn(("a", "b"))]  # at most scale_in_limit = 2 per tick
    assert sorted(p.hosts) == ["c", "d"]
    assert p.tick(760.0) == [ScaleIn(("c", "d"))]
    assert p.hosts == {} and p.tick(820.0) == []


def test_scale_in_never_releases_a_host_with_committed_gpus() -> None:
    p = make_policy("batch", no_prewarm(autoscaler=AutoscalerConfig(scale_in_limit=5)))
    a, b, c = host("a"), host("b"), host("c")
    fleet(p, a, b, c)
    open_k(p, "k1", 1)
    assert submit(p, "t1", "k1", 1)[0] == Started("t1", "k1", "a", (0,), StartPath.COLD)
    # Demand 1 GPU -> 1 host; two may go, and they are b and c, never a.
    assert p.tick(0.0) == [ScaleIn(("b", "c"))]
    assert list(p.hosts) == ["a"]
    assert p.tick(60.0) == []
    p.finish("t1", 61.0)
    assert p.tick(120.0) == [ScaleIn(("a",))]


def test_scale_in_respects_min_hosts() -> None:
    p = make_policy("batch", no_prewarm(autoscaler=AutoscalerConfig(min_hosts=2)))
    fleet(p, host("a"), host("b"), host("c"))
    assert p.tick(0.0) == [ScaleIn(("a",))]
    assert p.tick(60.0) == []


def test_notebookos_scale_in_moves_standby_replicas_off_the_critical_path() -> None:
    p = make_policy("notebookos", no_prewarm(3))
    a, b, c, d = host("a"), host("b"), host("c"), host("d")
    fleet(p, a, b, c)
    assert open_k(p, "k1", 1) == [Placed("k1", ("a", "b", "c"))]
    fleet(p, d)
    busy(d, 1)  # d is not idle, so one of a, b, c must be emptied
    # Demand 1 GPU, but the floor is 3 hosts with a kernel open: one of 4 may go.
    out = p.tick(0.0)
    assert out == [Migrated("k1", "a", "d", warm=False, for_task=False), ScaleIn(("a",))]
    assert p.kernels["k1"].hosts == ["d", "b", "c"]
    assert "k1" in d.subscriptions and sorted(p.hosts) == ["b", "c", "d"]
    assert p.tick(60.0) == []  # 3 hosts: the floor


def test_notebookos_scale_in_keeps_a_host_whose_replicas_cannot_move() -> None:
    p = make_policy("notebookos", no_prewarm(3))
    a, b, c = host("a"), host("b"), host("c")
    fleet(p, a, b, c)
    open_k(p, "k1", 1, gpu_types=("V100-16GB",))
    d = host("d", gpu_type="A100-80GB", vram_gb=80)  # no replica of k1 fits here
    fleet(p, d)
    busy(d, 1)
    assert p.evacuate(a, 0.0) is None  # d is the only host without a replica of k1
    assert p.tick(0.0) == []
    assert sorted(p.hosts) == ["a", "b", "c", "d"]
    assert all(h.subscriptions == {"k1": ResourceSpec(gpus=1, gpu_types=("V100-16GB",))}
               for h in (a, b, c))


def test_notebookos_keeps_replicas_hosts_while_kernels_are_open() -> None:
    p = make_policy("notebookos", no_prewarm(3))
    fleet(p, host("a"), host("b"), host("c"))
    open_k(p, "k1", 1)
    assert p.tick(0.0) == []  # demand 0 but three replicas need three hosts
    assert p.close_session("k1", 1.0) == []
    assert p.tick(60.0) == [ScaleIn(("a", "b"))]


# ---------------------------------------------------------------------- nbfleet
def nbfleet(idle_replicas: int = 1) -> tuple[FleetPolicy, dict[str, Host]]:
    p = make_policy("nbfleet", PolicyConfig(
        replicas=3, prewarm_per_host=0, shrink_idle_s=100.0, idle_replicas=idle_replicas,
        autoscaler=AutoscalerConfig(min_hosts=4)))
    hosts = {i: host(i) for i in "abcd"}
    fleet(p, *hosts.values())
    return p, hosts


@pytest.mark.parametrize(("keep", "kept", "dropped"), [
    (1, ["b"], ("c", "a")),
    (2, ["b", "c"], ("a",)),
])
def test_nbfleet_shrinks_an_idle_kernel_and_grows_it_back_on_the_next_task(
        keep: int, kept: list[str], dropped: tuple[str, ...]) -> None:
    p, h = nbfleet(idle_replicas=keep)
    assert open_k(p, "k1", 1, now=0.0) == [Placed("k1", ("a", "b", "c"))]
    busy(h["a"], 1)  # the kept replicas are those on the hosts with the most free GPUs
    assert p.tick(99.0) == []
    assert p.tick(100.0) == [Reclaimed("k1", dropped)]
    assert p.kernels["k1"].hosts == kept
    for i in "abcd":
        assert ("k1" in h[i].subscriptions) == (i in kept)
    assert p.tick(300.0) == []  # nothing more to reclaim
    out = submit(p, "t1", "k1", 1, 400.0)
    assert out[0] == Started("t1", "k1", "b", (0,), StartPath.LOCAL)
    # The missing replicas come back on the idlest hosts without one.
    regrown = tuple(i for i in "cda" if i not in kept)[: 3 - keep]
    assert out[1:] == [Placed("k1", regrown)]
    assert p.kernels["k1"].hosts == [*kept, *regrown]
    assert all("k1" in h[i].subscriptions for i in p.kernels["k1"].hosts)


def test_nbfleet_does_not_shrink_a_kernel_that_is_running_or_recently_active() -> None:
    p, _ = nbfleet()
    open_k(p, "k1", 1, now=0.0)
    submit(p, "t1", "k1", 1, 50.0)
    assert p.tick(500.0) == []  # running
    p.finish("t1", 500.0)
    assert p.tick(599.0) == []  # finished 99 s ago
    assert p.tick(600.0) == [Reclaimed("k1", ("b", "c"))]
    assert p.kernels["k1"].hosts == ["a"] and p.kernels["k1"].last_executor == "a"


@pytest.mark.parametrize(("policy", "chosen", "gpus"), [
    ("nbfleet", "b", (5, 6)),  # the fewest free GPUs that fit
    ("notebookos", "c", (3, 4)),  # the most free GPUs
])
def test_task_packing_when_the_last_executor_is_full(policy: str, chosen: str,
                                                     gpus: tuple[int, ...]) -> None:
    p = make_policy(policy, no_prewarm(3, autoscaler=AutoscalerConfig(min_hosts=4)))
    h = {i: host(i) for i in "abcd"}
    fleet(p, *h.values())
    assert open_k(p, "k1", 2) == [Placed("k1", ("a", "b", "c"))]
    assert submit(p, "t0", "k1", 2)[0] == Started("t0", "k1", "a", (0, 1), StartPath.LOCAL)
    p.finish("t0", 1.0)
    busy(h["a"], 7)  # the last executor has 1 free GPU: not enough
    busy(h["b"], 5)  # 3 free: the tightest fit
    busy(h["c"], 3)  # 5 free: the most free
    assert submit(p, "t1", "k1", 2, 2.0)[0] == Started("t1", "k1", chosen, gpus,
                                                        StartPath.LOCAL)
    assert h[chosen].bound("t1") == gpus and h["a"].bound("t1") == ()


def test_nbfleet_prefers_the_last_executor_when_it_fits() -> None:
    p = make_policy("nbfleet", no_prewarm(3))
    h = {i: host(i) for i in "abc"}
    fleet(p, *h.values())
    open_k(p, "k1", 2)
    submit(p, "t0", "k1", 2)
    p.finish("t0", 1.0)
    busy(h["a"], 2)  # a (6 free) is the last executor; b and c have 8
    busy(h["b"], 5)  # b is a tighter fit, but a goes first
    assert submit(p, "t1", "k1", 2, 2.0)[0] == Started("t1", "k1", "a", (2, 3),
                                                        StartPath.LOCAL)


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("spec", [
    ResourceSpec(gpus=16),
    ResourceSpec(gpus=1, gpu_types=("H100-80GB",)),
    ResourceSpec(gpus=1, vram_gb=32),
])
def test_a_kernel_no_host_shape_fits_is_unschedulable(name: str, spec: ResourceSpec) -> None:
    p = make_policy(name)
    fleet(p, host("a"), host("b"), host("c"))
    out = p.open_session(KernelRequest("k1", spec), 0.0)
    assert len(out) == 1 and isinstance(out[0], Unschedulable) and out[0].task_id == "k1"
    assert "k1" not in p.kernels and not p.waiting_kernels and p.provisioning == 0
    out = submit(p, "t1", "k1", 1)
    assert len(out) == 1 and isinstance(out[0], Unschedulable) and out[0].task_id == "t1"
    assert not p.queue and not p.running


@pytest.mark.parametrize("name", list(POLICIES))
def test_submitting_to_an_unknown_or_closed_kernel_is_unschedulable(name: str) -> None:
    p = make_policy(name)
    fleet(p, host("a"), host("b"), host("c"))
    out = submit(p, "t1", "nope", 1)
    assert len(out) == 1 and isinstance(out[0], Unschedulable) and out[0].task_id == "t1"
    open_k(p, "k1", 1)
    p.close_session("k1", 1.0)
    assert isinstance(submit(p, "t2", "k1", 1, 2.0)[0], Unschedulable)
    assert p.close_session("k1", 3.0) == []  # closing twice is harmless
    assert not p.queue and not p.running


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("hosts", [0, 3])
def test_submitting_the_same_task_twice_raises(name: str, hosts: int) -> None:
    p = make_policy(name)
    fleet(p, *(host(f"h{i}") for i in range(hosts)))
    open_k(p, "k1", 1)
    first = submit(p, "t1", "k1", 1)
    # With hosts it runs; without, it waits (kernel or GPUs): both count as submitted.
    assert isinstance(first[0], Started if hosts else Queued)
    with pytest.raises(ValueError, match="already submitted"):
        submit(p, "t1", "k1", 1, 1.0)
    assert len(p.running) + len(p.queue) == 1


@pytest.mark.parametrize("name", list(POLICIES))
def test_opening_a_kernel_twice_raises(name: str) -> None:
    p = make_policy(name)
    open_k(p, "k1", 1)
    with pytest.raises(ValueError, match="already open"):
        open_k(p, "k1", 1)


def test_default_configs() -> None:
    assert default_config("reservation").replicas == 1
    assert default_config("notebookos").replicas == 3
    assert default_config("nbfleet").shrink_idle_s == 3600.0
    assert math.isinf(default_config("notebookos").shrink_idle_s)
    with pytest.raises(ValueError, match="unknown policy"):
        default_config("slurm")
    assert make_policy("batch", max_hosts=7).config.autoscaler.max_hosts == 7


# ---------------------------------------------------------- hosts running 0 GPUs
def test_reservation_keeps_the_host_of_a_zero_gpu_session() -> None:
    p = make_policy("reservation")
    a = host("a")
    fleet(p, a)
    assert open_k(p, "k1", 0) == [Placed("k1", ("a",))]
    assert p.tick(0.0) == []  # k1's container lives on a
    assert submit(p, "t1", "k1", 0, 1.0)[0] == Started("t1", "k1", "a", (), StartPath.RESERVED)


def test_scale_in_keeps_a_host_running_a_zero_gpu_task() -> None:
    p = make_policy("batch")
    a = host("a")
    fleet(p, a)
    open_k(p, "k1", 1)
    assert submit(p, "t1", "k1", 0)[0] == Started("t1", "k1", "a", (), StartPath.COLD)
    assert p.tick(0.0) == []
    assert p.running["t1"].host_id in p.hosts


@pytest.mark.parametrize(("name", "target"), [("notebookos", "empty"), ("nbfleet", "partly")])
def test_nbfleet_migrates_to_the_best_fit_not_to_a_whole_free_host(name: str,
                                                                   target: str) -> None:
    """On the wide-task month (a third of the tasks 8 GPUs wide) a 1-GPU task that
    migrated to the emptiest host broke the whole host an 8-GPU task needed next:
    notebookos started 48 % of 8-GPU tasks at once. ``nbfleet`` migrates best fit."""
    config = dataclasses.replace(no_prewarm(2), shrink_idle_s=math.inf)
    p = make_policy(name, config)
    a, b = host("a"), host("b")
    fleet(p, a, b)
    open_k(p, "k1", 1)
    busy(a, 8)
    busy(b, 8)  # both replica hosts full: the task migrates
    fleet(p, host("empty"), host("partly"))
    busy(p.hosts["partly"], 6)
    (moved,) = only(submit(p, "t1", "k1", 1), Migrated)
    assert isinstance(moved, Migrated) and moved.to_host == target
