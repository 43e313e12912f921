"""One dispatch pass: tiers, fair share, caps, backfill and preemption together."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from nbfleet.model.cluster import Gpu, Host, ResourceSpec
from nbfleet.policy.fairness import QueuedWork, Tenant, UsageLedger
from nbfleet.policy.job_dispatch import (
    DispatchPlan,
    PendingJob,
    PlacedJob,
    can_act,
    plan_dispatch,
)
from nbfleet.policy.job_placement import FreeGpus, Placement
from nbfleet.policy.preemption import RunningWork

FREE, PAID = 0, 10
A100, H100 = "A100", "H100"
VRAM = {A100: 80, H100: 80}
LEDGER = UsageLedger(half_life_s=3600.0)


def host(host_id: str, gpus: int = 1, gpu_type: str = A100) -> Host:
    return Host(host_id, 8000, 64_000, [Gpu(i, gpu_type, VRAM[gpu_type]) for i in range(gpus)])


def job(id: str, tenant: str = "payer", *, priority: int = PAID, gpus: int = 1,
        at: float = 0.0, types: tuple[str, ...] = (),
        avoid: tuple[str, ...] = ()) -> PendingJob:
    return PendingJob(QueuedWork(id, tenant, priority, gpus, at, True),
                      ResourceSpec(gpus=gpus, gpu_types=types), avoid)


def running(id: str, host_id: str, tenant: str = "free", *, priority: int = FREE,
            gpus: int = 1, preemptible: bool = True, started: float = 0.0,
            gpu_type: str = A100, preempting: bool = False) -> PlacedJob:
    return PlacedJob(RunningWork(id, tenant, priority, gpus, preemptible, started),
                     host_id, gpu_type, VRAM[gpu_type], preempting)


def fleet(hosts: Sequence[Host], placed: Sequence[PlacedJob] = ()) -> FreeGpus:
    """The index over ``hosts`` with each placed job's GPUs bound on its host."""
    by_id = {h.id: h for h in hosts}
    for p in placed:
        h = by_id[p.host_id]
        gpus = [g.index for g in h.free_gpus() if g.gpu_type == p.gpu_type][: p.work.gpus]
        assert len(gpus) == p.work.gpus, f"{p.work.id} does not fit on {h.id}"
        h.commit(p.work.id, gpus)
    return FreeGpus(hosts)


def tenants(*items: Tenant) -> dict[str, Tenant]:
    return {t.id: t for t in items}


TS = tenants(Tenant("payer", 1.0), Tenant("free", 1.0), Tenant("other", 1.0))


def dispatch(pending: Sequence[PendingJob], free: FreeGpus,
             placed: Sequence[PlacedJob] = (), ts: dict[str, Tenant] = TS,
             max_preemptions: int = 8) -> DispatchPlan:
    return plan_dispatch(pending, free, ts, LEDGER, placed, 100.0,
                         max_preemptions=max_preemptions)


def started(plan: DispatchPlan) -> list[str]:
    return [j.work.id for j, _ in plan.starts]


def preempted(plan: DispatchPlan) -> list[tuple[str, list[str]]]:
    return [(j.work.id, [v.work.id for v in victims]) for j, victims in plan.preemptions]


# --- order and fair share ---------------------------------------------------------------


def test_paid_job_behind_a_flood_of_free_jobs_starts_first() -> None:
    placed = [running(f"busy{i}", "h1", started=float(i)) for i in range(3)]
    free = fleet([host("h1", 4)], placed)
    flood = [job(f"f{i:04d}", "free", priority=FREE, at=float(i)) for i in range(1000)]
    plan = dispatch([*flood, job("paid", at=5000.0)], free, placed)
    assert plan.starts == [(job("paid", at=5000.0), Placement("h1", (Gpu(3, A100, 80),)))]
    assert plan.preemptions == []  # a free GPU needs no victim, and free jobs preempt nobody
    assert free.free_count() == 0
    assert free.hosts["h1"].holder_of(3) == "paid"


def test_weighted_tenants_get_starts_in_proportion_to_their_weights() -> None:
    """Saturated queues, 1:3 weights, jobs of varying length: the running load each
    pass sees steers starts to ~1:3."""
    ts = tenants(Tenant("one", 1.0), Tenant("three", 3.0))
    free = fleet([host(f"h{i}", 4) for i in range(4)])
    queues = {t: [job(f"{t}-{i:05d}", t, priority=FREE, at=float(i)) for i in range(3000)]
              for t in ts}
    heads = {t: 0 for t in ts}
    live: list[tuple[PlacedJob, int]] = []  # job, round it ends
    starts: Counter[str] = Counter()
    for now in range(400):
        for p, ends in live:
            if ends == now:
                free.release(p.host_id, p.work.id)
        live = [(p, ends) for p, ends in live if ends > now]
        pending = [j for t, q in queues.items() for j in q[heads[t]:heads[t] + 16]]
        plan = plan_dispatch(pending, free, ts, LEDGER, [p for p, _ in live], float(now))
        assert plan.preemptions == []
        for pj, placement in plan.starts:
            t = pj.work.tenant_id
            assert queues[t][heads[t]] is pj  # FIFO within a tenant
            heads[t] += 1
            n = int(pj.work.id.rsplit("-", 1)[1])
            work = RunningWork(pj.work.id, t, FREE, 1, True, float(now))
            live.append((PlacedJob(work, placement.host_id, A100, 80), now + 1 + (n * 7) % 5))
            starts[t] += 1
        assert free.free_count() == 0  # never an idle GPU while work waits
    assert all(heads[t] < len(queues[t]) for t in ts)  # still saturated at the end
    ratio = starts["three"] / starts["one"]
    assert abs(ratio - 3.0) <= 0.3, starts
    share = Counter(p.work.tenant_id for p, _ in live)  # 16 GPUs split 1:3 is 4:12
    assert share["one"] + share["three"] == 16 and abs(share["one"] - 4) <= 1, share


def test_max_running_caps_a_tenants_starts() -> None:
    ts = tenants(Tenant("capped", 1.0, max_running=2), Tenant("other", 1.0))
    pending = [job(f"c{i}", "capped", priority=FREE, at=float(i)) for i in range(10)]
    pending += [job(f"o{i}", "other", priority=FREE, at=float(i)) for i in range(10)]
    plan = dispatch(pending, fleet([host("h1", 4), host("h2", 4)]), ts=ts)
    assert Counter(j.work.tenant_id for j, _ in plan.starts) == {"capped": 2, "other": 6}
    assert [i for i in started(plan) if i.startswith("c")] == ["c0", "c1"]

    placed = [running("c-old", "h1", "capped")]
    plan = dispatch(pending, fleet([host("h1", 4), host("h2", 4)], placed), placed, ts=ts)
    assert Counter(j.work.tenant_id for j, _ in plan.starts) == {"capped": 1, "other": 6}


def test_a_cap_of_zero_starts_nothing_for_the_tenant() -> None:
    ts = tenants(Tenant("capped", 1.0, max_running=0))
    plan = dispatch([job("c0", "capped")], fleet([host("h1", 4)]), ts=ts)
    assert plan.starts == [] and plan.preemptions == []


# --- backfill -----------------------------------------------------------------------------


def test_a_wide_job_that_does_not_fit_does_not_block_a_narrow_one() -> None:
    pending = [job("wide", "free", priority=FREE, gpus=4, at=0.0),
               job("narrow", "free", priority=FREE, gpus=1, at=1.0)]
    free = fleet([host("h1", 2)])
    plan = dispatch(pending, free)
    assert started(plan) == ["narrow"]
    assert plan.preemptions == []
    assert free.free_count() == 1


def test_backfill_behind_a_paid_wide_job_fills_every_gpu() -> None:
    pending = [job("wide", gpus=4)] + [job(f"n{i}", "free", priority=FREE, at=float(i))
                                       for i in range(5)]
    free = fleet([host("h1", 3)])
    plan = dispatch(pending, free)
    assert started(plan) == ["n0", "n1", "n2"]
    assert plan.preemptions == []  # nothing is running, so nothing to preempt
    assert free.free_count() == 0


def test_starts_are_committed_so_two_jobs_never_share_a_gpu() -> None:
    free = fleet([host("h1", 2), host("h2", 1)])
    plan = dispatch([job(f"p{i}", at=float(i)) for i in range(4)], free)
    assert started(plan) == ["p0", "p1", "p2"]
    bound = [(p.host_id, i) for _, p in plan.starts for i in p.indices]
    assert sorted(bound) == [("h1", 0), ("h1", 1), ("h2", 0)]
    assert plan.starts[0][1].host_id == "h2"  # best fit: the 1-GPU host first


# --- preemption ----------------------------------------------------------------------------


def test_a_paid_job_preempts_the_latest_preemptible_free_job() -> None:
    placed = [running("f1", "h1", started=1.0), running("f2", "h1", started=2.0)]
    free = fleet([host("h1", 2)], placed)
    plan = dispatch([job("paid")], free, placed)
    assert plan.starts == []
    assert plan.preemptions == [(job("paid"), (placed[1],))]
    # The paid job starts in a later pass, once f2 has stopped.
    assert free.free_count() == 0 and free.hosts["h1"].bound("paid") == ()


def test_non_preemptible_work_is_never_a_victim() -> None:
    placed = [running("f1", "h1", preemptible=False), running("f2", "h1", preemptible=False)]
    assert dispatch([job("paid")], fleet([host("h1", 2)], placed), placed).preemptions == []
    placed = [running("f1", "h1", preemptible=False, started=9.0), running("f2", "h1")]
    plan = dispatch([job("paid")], fleet([host("h1", 2)], placed), placed)
    assert preempted(plan) == [("paid", ["f2"])]


@pytest.mark.parametrize("priority", [PAID, PAID + 1, 100])
def test_same_or_higher_priority_is_never_a_victim(priority: int) -> None:
    placed = [running("r1", "h1", "other", priority=priority)]
    plan = dispatch([job("paid")], fleet([host("h1")], placed), placed)
    assert plan.preemptions == [] and plan.starts == []


def test_free_jobs_never_preempt() -> None:
    placed = [running("r1", "h1", "other", priority=FREE)]
    plan = dispatch([job("f", "free", priority=FREE)], fleet([host("h1")], placed), placed)
    assert plan.preemptions == []


def test_lower_paid_tier_is_preemptible_too() -> None:
    placed = [running("mid", "h1", "other", priority=5)]
    plan = dispatch([job("paid")], fleet([host("h1")], placed), placed)
    assert preempted(plan) == [("paid", ["mid"])]


def test_the_host_needing_the_fewest_victims_is_chosen() -> None:
    placed = [running("a1", "h1"), running("a2", "h1"), running("b1", "h2", gpus=2)]
    plan = dispatch([job("paid", gpus=2)], fleet([host("h1", 2), host("h2", 2)], placed),
                    placed)
    assert preempted(plan) == [("paid", ["b1"])]


def test_free_gpus_on_a_host_count_towards_the_job() -> None:
    """h1 has one GPU free: one 1-GPU victim there beats one 2-GPU victim on h2."""
    placed = [running("a1", "h1"), running("b1", "h2", gpus=2)]
    plan = dispatch([job("paid", gpus=2)], fleet([host("h1", 2), host("h2", 2)], placed),
                    placed)
    assert preempted(plan) == [("paid", ["a1"])]


def test_victims_must_hold_a_type_the_job_accepts() -> None:
    placed = [running("a1", "h1"), running("x1", "x", gpu_type=H100, started=-1.0)]
    free = fleet([host("h1"), host("x", 1, H100)], placed)
    assert preempted(dispatch([job("paid", types=(H100,))], free, placed)) == [
        ("paid", ["x1"])]
    placed = [running("a1", "h1")]
    free = fleet([host("h1"), host("x", 1, H100)], placed)
    free.hosts["x"].commit("paid-running", [0])
    free = FreeGpus(free.hosts.values())
    assert dispatch([job("paid", types=(H100,))], free, placed).preemptions == []


def test_guarantee_gpus_are_respected() -> None:
    placed = [running("f1", "h1", started=1.0), running("f2", "h1", started=2.0)]
    guarded = tenants(Tenant("payer", 1.0), Tenant("free", 1.0, guarantee_gpus=2))
    plan = dispatch([job("paid")], fleet([host("h1", 2)], placed), placed, ts=guarded)
    assert plan.preemptions == []
    half = tenants(Tenant("payer", 1.0), Tenant("free", 1.0, guarantee_gpus=1))
    plan = dispatch([job("paid"), job("paid2", at=1.0)], fleet([host("h1", 2)], placed),
                    placed, ts=half)
    assert preempted(plan) == [("paid", ["f2"])]  # paid2 would take free below 1


def test_two_pending_jobs_get_different_victims() -> None:
    placed = [running("f1", "h1", started=1.0), running("f2", "h1", started=2.0)]
    plan = dispatch([job("p1", at=1.0), job("p2", at=2.0)], fleet([host("h1", 2)], placed),
                    placed)
    assert preempted(plan) == [("p1", ["f2"]), ("p2", ["f1"])]


def test_max_preemptions_bounds_a_pass() -> None:
    placed = [running(f"f{i}", f"h{i}") for i in range(5)]
    pending = [job(f"p{i}", at=float(i)) for i in range(5)]

    def count(**kwargs: int) -> int:
        hosts = [host(f"h{i}") for i in range(5)]
        free = fleet(hosts, placed)
        return len(plan_dispatch(pending, free, TS, LEDGER, placed, 0.0, **kwargs).preemptions)

    assert count() == 5  # the default bound is 8
    assert count(max_preemptions=2) == 2
    assert count(max_preemptions=0) == 0


# --- GPUs already being freed -------------------------------------------------------------


def test_victims_already_stopping_are_not_preempted_again() -> None:
    placed = [running("f1", "h1", preempting=True), running("f2", "h1", started=5.0)]
    plan = dispatch([job("paid")], fleet([host("h1", 2)], placed), placed)
    assert plan.preemptions == []


def test_gpus_being_freed_count_once() -> None:
    placed = [running("f1", "h1", preempting=True), running("f2", "h1", started=5.0)]
    plan = dispatch([job("p1", at=1.0), job("p2", at=2.0)], fleet([host("h1", 2)], placed),
                    placed)
    assert preempted(plan) == [("p2", ["f2"])]


def test_several_stopping_victims_on_one_host_add_up() -> None:
    """Two 1-GPU victims stopping on h1 will free the 2 GPUs the job needs: h2's
    work must be left alone."""
    placed = [running("f1", "h1", preempting=True), running("f2", "h1", preempting=True),
              running("f3", "h2"), running("f4", "h2")]
    plan = dispatch([job("paid", gpus=2)], fleet([host("h1", 2), host("h2", 2)], placed),
                    placed)
    assert plan.preemptions == []


def test_a_free_gpu_and_a_stopping_victim_add_up() -> None:
    """The state the first pass leaves behind when it preempted one victim next to
    a free GPU: the second pass must not preempt again."""
    placed = [running("f1", "h1", started=1.0), running("f3", "h2"), running("f4", "h2")]
    free = fleet([host("h1", 2), host("h2", 2)], placed)
    first = dispatch([job("paid", gpus=2)], free, placed)
    assert preempted(first) == [("paid", ["f1"])]
    placed[0] = running("f1", "h1", started=1.0, preempting=True)
    second = dispatch([job("paid", gpus=2)], free, placed)
    assert second.preemptions == [] and second.starts == []


def test_stopping_victims_of_another_type_do_not_count() -> None:
    placed = [running("f1", "h1", preempting=True), running("x1", "x", gpu_type=H100)]
    plan = dispatch([job("paid", types=(H100,))],
                    fleet([host("h1"), host("x", 1, H100)], placed), placed)
    assert preempted(plan) == [("paid", ["x1"])]


def test_stopping_victims_on_a_lost_host_do_not_count() -> None:
    placed = [running("gone", "lost-host", preempting=True), running("f1", "h1")]
    free = fleet([host("h1")], [placed[1]])  # lost-host is not in the live fleet
    assert preempted(dispatch([job("paid")], free, placed)) == [("paid", ["f1"])]


# --- avoided hosts ---------------------------------------------------------------------


def test_preemption_skips_hosts_the_job_avoids() -> None:
    """The job would not start on h1 while h2 can run it, so preempting there is waste."""
    placed = [running("f1", "h1", started=9.0), running("f2", "h2", started=1.0)]
    pending = [job("paid", avoid=("h1",))]
    plan = dispatch(pending, fleet([host("h1"), host("h2")], placed), placed)
    assert preempted(plan) == [("paid", ["f2"])]


def test_stopping_victims_on_an_avoided_host_do_not_count() -> None:
    placed = [running("f1", "h1", preempting=True), running("f2", "h2")]
    plan = dispatch([job("paid", avoid=("h1",))], fleet([host("h1"), host("h2")], placed),
                    placed)
    assert preempted(plan) == [("paid", ["f2"])]


def test_avoid_is_ignored_when_only_avoided_hosts_could_run_the_job() -> None:
    placed = [running("f1", "h1", gpus=2), running("f2", "h2")]
    plan = dispatch([job("paid", gpus=2, avoid=("h1",))],
                    fleet([host("h1", 2), host("h2")], placed), placed)
    assert preempted(plan) == [("paid", ["f1"])]


def test_can_act_only_with_a_free_gpu_or_preemptible_work() -> None:
    # Nothing free and nothing to preempt: no pass could plan anything, whatever queues.
    full = [running("r1", "h1", preemptible=False)]
    assert not can_act(fleet([host("h1")], full), full)
    assert dispatch([job("p1")], fleet([host("h1")], full), full).starts == []
    # A free GPU, or a preemptible victim not already stopping, and it could.
    assert can_act(fleet([host("h1", gpus=2)], full), full)
    victim = [running("r1", "h1")]
    assert can_act(fleet([host("h1")], victim), victim)
    stopping = [running("r1", "h1", preempting=True)]
    assert not can_act(fleet([host("h1")], stopping), stopping)
