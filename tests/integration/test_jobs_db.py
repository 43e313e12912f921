"""The job system on the metadata DB (SQLite, or PostgreSQL in CI): admission in one
transaction with its hold, placement and repricing, fencing, retries, dead
letters, the poison quarantine, cancel, preemption refunds and canary rollback."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.engine import Database
from nbfleet.db.job_tables import BinaryVersion, GpuAllocation, Job
from nbfleet.jobs import attempts, binaries, results
from nbfleet.jobs.admission import QuotaExceeded
from nbfleet.ledger import budgets, grants
from nbfleet.model.credits import MICRO, Enforcement, Level, Period
from nbfleet.model.errors import InvalidInput, PaymentRequired
from nbfleet.model.jobs import CanaryRule, JobState
from nbfleet.storage.blobs import BlobStore
from tests.support import jobs as J
from tests.support.ledger import ADMIN, Tenant, assert_verified, give, new_tenant

A100 = [(4, "A100-80GB", 80)]


@pytest.fixture
def tenant(db: Database) -> Tenant:
    J.register(db)
    J.add_host(db, "host-a", A100)
    t = new_tenant(db)
    give(db, t.owner(db), 100 * MICRO)
    return t


def hold(db: Database, hold_id: str) -> CreditHold:
    with db.transaction(write=False) as session:
        row = session.get(CreditHold, hold_id)
        assert row is not None
        return row


def available(db: Database, t: Tenant) -> int:
    with db.transaction(write=False) as session:
        return grants.balance(session, t.owner(db), db.now(session))["available"]


def count(db: Database, model: type) -> int:
    with db.transaction(write=False) as session:
        return session.execute(select(func.count()).select_from(model)).scalar_one()


def test_admission_queues_the_job_and_holds_timeout_x_gpus_x_dearest_price(
        db: Database, tenant: Tenant) -> None:
    job = J.submit(db, tenant, gpus=2, gpu_types=("H100-80GB", "A100-80GB"), timeout_s=1800)
    assert job.state == JobState.QUEUED and job.attempt == 0
    row = hold(db, job.hold_id or "")
    # 2 GPUs x 0.5 h x 4 credits (H100, the dearest acceptable type)
    assert (row.amount, row.held, row.rate_per_gpu_hour) == (4 * MICRO, 4 * MICRO, 4 * MICRO)
    assert row.work_id == f"{job.id}#1"
    assert available(db, tenant) == 96 * MICRO
    assert_verified(db)


def test_a_refused_admission_leaves_nothing_behind(db: Database, tenant: Tenant) -> None:
    with pytest.raises(PaymentRequired):
        J.submit(db, tenant, gpus=4, timeout_s=86400)  # 4 x 24 h x 2 = 192 > 100 credits
    assert count(db, Job) == 0 and count(db, CreditHold) == 0
    assert available(db, tenant) == 100 * MICRO
    with pytest.raises(InvalidInput, match="no host can run"):
        J.submit(db, tenant, gpu_types=("H100-80GB",))
    with pytest.raises(InvalidInput, match="unknown tier"):
        J.submit(db, tenant, tier="gold")
    assert count(db, Job) == 0
    assert_verified(db)


def test_the_spend_cap_stops_new_admissions(db: Database, tenant: Tenant) -> None:
    with db.transaction() as session:
        budgets.create(session, budgets.BudgetTarget(Level.PROJECT, tenant.org_id,
                                                     tenant.project_id, None),
                       Period.DAY, 5 * MICRO, Enforcement.CAP, ADMIN, db.now(session))
    first = J.submit(db, tenant, timeout_s=3600 * 2)  # 4 credits: under the cap
    second = J.submit(db, tenant, timeout_s=3600 * 2)  # 8 committed: the cap lets it cross
    with pytest.raises(PaymentRequired) as refused:
        J.submit(db, tenant, timeout_s=60)
    assert refused.value.extra["reason"] == "spend_cap_reached"
    assert {first.state, second.state} == {JobState.QUEUED}
    assert count(db, Job) == 2


def test_the_queued_quota_and_the_tiers_a_project_may_use(db: Database, tenant: Tenant) -> None:
    from nbfleet.control import tenancy

    tenancy.set_job_settings(db, tenant.org, tenant.project, 1.0, 0, None, 1, ["free"])
    with pytest.raises(InvalidInput, match="tier 'paid' is not enabled"):
        J.submit(db, tenant, timeout_s=60, tier="paid")
    J.submit(db, tenant, timeout_s=60)
    with pytest.raises(QuotaExceeded):
        J.submit(db, tenant, timeout_s=60)
    assert count(db, Job) == 1


def test_start_binds_gpus_and_reprices_to_the_type_used(db: Database, tenant: Tenant) -> None:
    job = J.submit(db, tenant, gpus=2, gpu_types=("H100-80GB", "A100-80GB"), timeout_s=3600)
    (order,) = J.dispatch_pass(db).starts
    assert order.body["gpu_indices"] == [0, 1] and order.body["gpu_type"] == "A100-80GB"
    assert order.body["blob_prefix"] == f"jobs/{job.id}/1"
    row = hold(db, job.hold_id or "")
    assert (row.gpu_type, row.rate_per_gpu_hour) == ("A100-80GB", 2 * MICRO)
    assert count(db, GpuAllocation) == 2
    assert J.dispatch_pass(db).starts == []  # already placed: nothing twice
    # Half an hour on 2 A100s: 2 GPU-hours... at 2 credits = 2 credits captured.
    assert J.beat(db, job.id, 1, 1, 1_800_000).action == "continue"
    done = J.finish(db, job.id, 1, J.succeeded(3_600_000))
    assert done.state == JobState.SUCCEEDED and done.result
    settled = hold(db, row.id)
    assert (settled.state, settled.captured, settled.released) == ("settled", 2 * MICRO,
                                                                   6 * MICRO)
    assert count(db, GpuAllocation) == 0
    assert available(db, tenant) == 98 * MICRO
    assert_verified(db)


def test_a_stale_attempt_can_neither_heartbeat_nor_finish(db: Database, tenant: Tenant) -> None:
    job = J.submit(db, tenant, timeout_s=600)
    J.dispatch_pass(db)
    first_host = J.host_of(db, job.id)
    J.age_attempts(db, 60)
    with db.transaction(write=False) as session:
        silent = attempts.silent_attempts(session, db.now(session), 30)
    assert silent == [(job.id, 1)]
    with db.transaction() as session:
        assert attempts.end_if_live(session, job.id, 1, attempts.Outcome.LOST, "test",
                                    J.SETTINGS, db.now(session), 0.5)
    assert J.load(db, job.id).state == JobState.QUEUED
    (order,) = J.dispatch_pass(db).starts
    assert order.attempt == 2
    # The first worker comes back: told to stop, and its result is refused.
    with db.transaction() as session:
        (directive,) = attempts.heartbeat(session, *first_host,
                                          [attempts.Beat(job.id, 1, 9, 99_000)], J.SETTINGS,
                                          db.now(session))
    assert (directive.action, directive.reason) == ("stop", "stale")
    with pytest.raises(attempts.Stale):
        J.finish(db, job.id, 1, J.succeeded(99_000), host=first_host)
    final = J.finish(db, job.id, 2, J.succeeded(5_000))
    assert final.state == JobState.SUCCEEDED
    rows = J.attempts_of(db, job.id)
    assert [(r.attempt, r.outcome, r.gpu_ms) for r in rows] == [(1, "lost", 0),
                                                               (2, "succeeded", 5_000)]
    assert_verified(db)


def test_binary_failures_retry_then_dead_letter_with_every_reason(
        db: Database, tenant: Tenant) -> None:
    job = J.submit(db, tenant, timeout_s=600, max_attempts=3)
    for attempt in (1, 2, 3):
        J.dispatch_pass(db)
        J.finish(db, job.id, attempt, J.crashed())
    final = J.load(db, job.id)
    assert final.state == JobState.DEAD_LETTERED
    assert "3 of 3 attempts failed" in (final.reason or "")
    assert [r.outcome for r in J.attempts_of(db, job.id)] == ["crash"] * 3
    assert final.hold_id is None
    with db.transaction(write=False) as session:
        active = session.execute(select(func.count()).select_from(CreditHold).where(
            CreditHold.state == "active")).scalar_one()
    assert active == 0
    assert_verified(db)


def test_infrastructure_failures_do_not_use_up_attempts(db: Database, tenant: Tenant) -> None:
    job = J.submit(db, tenant, timeout_s=600, max_attempts=1)
    for attempt in (1, 2):
        J.dispatch_pass(db)
        with db.transaction() as session:
            attempts.end_if_live(session, job.id, attempt, attempts.Outcome.LAUNCH_FAILED,
                                 "agent unreachable", J.SETTINGS, db.now(session), 0.5)
    J.dispatch_pass(db)
    assert J.finish(db, job.id, 3, J.succeeded(100)).state == JobState.SUCCEEDED


def test_an_input_that_fails_on_two_hosts_is_quarantined(db: Database, tenant: Tenant) -> None:
    J.add_host(db, "host-b", A100)
    job = J.submit(db, tenant, timeout_s=600, max_attempts=5, args={"prompt": "boom"})
    J.dispatch_pass(db)
    J.finish(db, job.id, 1, attempts.Facts(seq=1, gpu_ms=10, killed_for="idle"))
    (retry,) = J.dispatch_pass(db).starts
    first_host = J.attempts_of(db, job.id)[0].host_id
    assert retry.host.id != first_host  # the retry avoids the host that failed
    J.finish(db, job.id, 2, J.crashed())
    final = J.load(db, job.id)
    assert final.state == JobState.DEAD_LETTERED and final.quarantined
    assert "quarantined" in (final.reason or "")
    with pytest.raises(InvalidInput, match="quarantined"):
        J.submit(db, tenant, timeout_s=600, args={"prompt": "boom"})
    J.submit(db, tenant, timeout_s=600, args={"prompt": "fine"})  # other inputs still run
    other = new_tenant(db)
    give(db, other.owner(db), 10 * MICRO)
    J.submit(db, other, timeout_s=600, args={"prompt": "boom"})  # per project


def test_cancel_in_every_state(db: Database, tenant: Tenant) -> None:
    queued = J.submit(db, tenant, timeout_s=600)
    with db.transaction() as session:
        job = session.get(Job, queued.id, with_for_update=True)
        assert job is not None
        assert attempts.cancel(session, job, J.SETTINGS, db.now(session)) is False
    assert J.load(db, queued.id).state == JobState.CANCELLED
    assert hold(db, queued.hold_id or "").released == hold(db, queued.hold_id or "").amount

    running = J.submit(db, tenant, timeout_s=600)
    J.dispatch_pass(db)
    J.beat(db, running.id, 1, 1, 500)
    with db.transaction() as session:
        job = session.get(Job, running.id, with_for_update=True)
        assert job is not None
        assert attempts.cancel(session, job, J.SETTINGS, db.now(session)) is True
    assert J.beat(db, running.id, 1, 2, 800).reason == "cancel"
    ended = J.finish(db, running.id, 1, attempts.Facts(seq=3, gpu_ms=900, signal=15,
                                                      killed_for="cancel"))
    assert ended.state == JobState.CANCELLED
    with db.transaction() as session:
        job = session.get(Job, running.id, with_for_update=True)
        assert job is not None
        assert attempts.cancel(session, job, J.SETTINGS, db.now(session)) is False  # no-op
    done = J.submit(db, tenant, timeout_s=600)
    J.dispatch_pass(db)
    J.finish(db, done.id, 1, J.succeeded(10))
    with db.transaction() as session, pytest.raises(attempts.Conflict):
        job = session.get(Job, done.id, with_for_update=True)
        assert job is not None
        attempts.cancel(session, job, J.SETTINGS, db.now(session))
    assert_verified(db)


def test_preemption_stops_free_work_and_refunds_the_remainder(db: Database) -> None:
    J.register(db)
    J.add_host(db, "small", [(1, "A100-80GB", 80)])
    free_user, paid_user = new_tenant(db), new_tenant(db)
    give(db, free_user.owner(db), 10 * MICRO)
    give(db, paid_user.owner(db), 10 * MICRO)
    victim = J.submit(db, free_user, timeout_s=3600, tier="free", preemptible=True)
    J.dispatch_pass(db)
    J.beat(db, victim.id, 1, 1, 600_000)  # 10 minutes on an A100 at 2/h
    urgent = J.submit(db, paid_user, timeout_s=600, tier="paid")
    stops = J.dispatch_pass(db).stops
    assert [(s.job_id, s.reason) for s in stops] == [(victim.id, "preempt")]
    assert J.beat(db, victim.id, 1, 2, 900_000).reason == "preempt"
    requeued = J.finish(db, victim.id, 1, attempts.Facts(seq=3, gpu_ms=900_000, signal=15,
                                                        killed_for="preempt"))
    assert requeued.state == JobState.QUEUED
    first = hold(db, J.load(db, victim.id).hold_id or "")
    old = hold(db, J.attempts_of(db, victim.id)[0].hold_id)
    # 15 minutes at 2 credits/h = 0.5 credit captured; the other 1.5 come back.
    assert (old.settle_reason, old.captured, old.released) == ("preempted", MICRO // 2,
                                                               3 * MICRO // 2)
    assert first.state == "active" and first.work_id == f"{victim.id}#2"
    (start,) = J.dispatch_pass(db).starts
    assert start.job_id == urgent.id
    assert available(db, free_user) == 10 * MICRO - MICRO // 2 - first.amount
    assert_verified(db)


def test_a_failing_canary_rolls_back_and_pinned_jobs_keep_their_version(
        db: Database, tenant: Tenant) -> None:
    from nbfleet.control import tenancy

    J.register(db, version="2.0", canary_percent=100, rule=CanaryRule(0.5, 3))
    # A project capped at 0 running jobs keeps its jobs queued through the rollout.
    waiting = new_tenant(db, project="waiting")
    give(db, waiting.owner(db), 10 * MICRO)
    tenancy.set_job_settings(db, waiting.org, waiting.project, 1.0, 0, 0, None)
    routed = J.submit(db, waiting, timeout_s=60)
    pinned = J.submit(db, waiting, timeout_s=60, version="2.0")
    assert (routed.version, routed.pinned, pinned.pinned) == ("2.0", False, True)
    failing = [J.submit(db, tenant, timeout_s=60, max_attempts=1).id for _ in range(3)]
    for order in J.dispatch_pass(db).starts:
        J.finish(db, order.job_id, order.attempt, J.crashed())
    # The canary's crashes are not theirs: each is queued again, on stable, with its
    # one attempt intact (tests/integration/test_jobs_rollout.py has the rest).
    assert {(J.load(db, job_id).state, J.load(db, job_id).version)
            for job_id in failing} == {(JobState.QUEUED, "1.0")}
    with db.transaction(write=False) as session:
        row = binaries.get(session, "videogen", "2.0")
        assert row.state == binaries.ROLLED_BACK
        assert "3 of 3 attempts failed" in (row.reason or "")
        versions = dict(session.execute(select(BinaryVersion.version, BinaryVersion.state)).all())
    assert versions == {"1.0": "stable", "2.0": "rolled_back"}
    assert J.load(db, routed.id).version == "1.0"  # moved before it ever ran
    assert J.load(db, pinned.id).version == "2.0"  # pinned keeps its version
    assert J.submit(db, tenant, timeout_s=60).version == "1.0"
    assert J.submit(db, tenant, timeout_s=60, version="2.0").version == "2.0"


def test_results_and_logs_are_deleted_after_retention(db: Database, tenant: Tenant,
                                                      tmp_path: Path) -> None:
    from sqlalchemy import update

    blobs = BlobStore(str(tmp_path / "blobs"))
    kept, expiring = J.submit(db, tenant, timeout_s=60), J.submit(db, tenant, timeout_s=60)
    J.dispatch_pass(db)
    for job in (kept, expiring):
        blobs.put(f"jobs/{job.id}/1/output/video.mp4", b"mp4")
        blobs.put(f"jobs/{job.id}/1/log/00000000", b"progress: 1/1\n")
        J.finish(db, job.id, 1, attempts.Facts(seq=2, gpu_ms=10, exit_code=0, result=[
            {"name": "video.mp4", "key": f"jobs/{job.id}/1/output/video.mp4", "size": 3,
             "sha256": "x"}]))
    assert results.purge(db, blobs) == 0  # nothing is due yet
    with db.transaction() as session:
        session.execute(update(Job).where(Job.id == expiring.id).values(
            result_expires_at=db.now(session) - timedelta(seconds=1)))
    assert results.purge(db, blobs) == 1
    assert blobs.list(f"jobs/{expiring.id}") == []
    assert len(blobs.list(f"jobs/{kept.id}")) == 2
    gone = J.load(db, expiring.id)
    assert gone.result is None and gone.result_expires_at is None
    with pytest.raises(results.Gone):
        results.downloads(gone, blobs, b"k", "http://x", 0.0, 60.0)
    assert results.purge(db, blobs) == 0  # done once
    assert J.load(db, kept.id).result


def test_unconfirmed_starts_are_sent_again_to_live_hosts_only(db: Database,
                                                             tenant: Tenant) -> None:
    from sqlalchemy import update

    from nbfleet.db.tables import Agent
    from nbfleet.jobs import dispatch

    job = J.submit(db, tenant, timeout_s=60)
    (order,) = J.dispatch_pass(db).starts

    def resend() -> list[dispatch.StartOrder]:
        with db.transaction(write=False) as session:
            return dispatch.resend_orders(session, J.SETTINGS, db.now(session), after_s=0,
                                          agent_timeout_s=30)

    (again,) = resend()
    assert (again.job_id, again.attempt, again.host, again.body) == (
        order.job_id, order.attempt, order.host, order.body)
    with db.transaction() as session:
        session.execute(update(Agent).values(
            last_heartbeat_at=db.now(session) - timedelta(seconds=60)))
    assert resend() == []  # its host is dead: the lost-worker sweep will end it
    J.add_host(db, "host-a", A100)  # alive again
    with db.transaction() as session:
        assert attempts.started(session, job.id, 1, db.now(session))
    assert resend() == []  # confirmed: nothing to send
