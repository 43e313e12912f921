"""Job submissions admitted in batches (``jobs.admission.admit`` and the control
plane's ``JobIntake``), on SQLite and on PostgreSQL: a batch is judged as if its
submissions came one after the other, a refusal leaves nothing behind, tokens and
Idempotency-Keys are handled per submission, and a failing batch falls back to
admitting each submission alone."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from nbfleet.control import tenancy
from nbfleet.control.idempotency import request_fingerprint
from nbfleet.control.job_intake import JobIntake, Reply, Submission
from nbfleet.control.platform import ControlConfig, Platform
from nbfleet.db.credit_tables import CreditHold, LedgerEntry, SpendCounter
from nbfleet.db.engine import Database
from nbfleet.db.job_tables import Job, JobEvent
from nbfleet.db.tables import IdempotencyKey, User
from nbfleet.jobs import admission
from nbfleet.ledger import budgets
from nbfleet.model.credits import MICRO, Enforcement, Level, Period
from nbfleet.model.errors import DomainError, NotFound, PaymentRequired
from nbfleet.model.pricing import hold_amount
from tests.support import jobs as J
from tests.support.ledger import ADMIN, Tenant, assert_verified, give, new_tenant

A100 = [(4, "A100-80GB", 80)]
#: The hold of one job: 1 GPU for 3,600 s at the A100's 2 credits per GPU-hour
#: (the dearest type the fleet has that the job accepts).
ONE_JOB = hold_amount(3600, 1, 2 * MICRO)


def count(db: Database, model: type) -> int:
    with db.transaction(write=False) as session:
        return session.execute(select(func.count()).select_from(model)).scalar_one()


def admit(db: Database, items: list[tuple[Tenant, admission.JobRequest]]
          ) -> list[Job | DomainError]:
    with db.transaction() as session:
        return admission.admit(session, [
            admission.Submission(admission.Tenant(t.org_id, t.project_id, t.user_id), request,
                                 J.USER) for t, request in items],
            J.SETTINGS, admission.fleet_shapes(session), db.now(session))


def job(**fields: object) -> admission.JobRequest:
    return admission.JobRequest(**{"binary": "videogen", **fields})  # type: ignore[arg-type]


@pytest.fixture
def fleet(db: Database) -> None:
    J.register(db)
    J.add_host(db, "host-a", A100)


def test_a_batch_is_judged_in_order_and_a_refusal_leaves_nothing(db: Database,
                                                                 fleet: None) -> None:
    poor, rich = new_tenant(db), new_tenant(db)
    give(db, poor.owner(db), 2 * ONE_JOB)  # enough for the first two of its jobs only
    give(db, rich.owner(db), 100 * ONE_JOB)
    outcomes = admit(db, [(poor, job()), (poor, job(binary="no-such-binary")), (rich, job()),
                          (poor, job()), (poor, job()), (rich, job(gpus=8))])
    first, unknown, other, second, broke, too_wide = outcomes
    assert isinstance(first, Job) and isinstance(other, Job) and isinstance(second, Job)
    assert isinstance(unknown, NotFound)
    assert isinstance(broke, PaymentRequired) and broke.extra["reason"] == "insufficient_credits"
    assert isinstance(too_wide, DomainError) and too_wide.status == 422  # no host has 8 GPUs
    # Exactly three jobs, three holds, three first events; nothing of the refused ones.
    assert count(db, Job) == count(db, CreditHold) == count(db, JobEvent) == 3
    with db.transaction(write=False) as session:
        held = {row.work_id for row in session.execute(select(CreditHold)).scalars()}
        kinds = set(session.execute(select(LedgerEntry.kind)).scalars())
    assert held == {admission.attempt_work_id(j.id, 1) for j in (first, other, second)}
    assert kinds == {"grant", "reserve"}
    assert_verified(db)


def test_a_spend_cap_refuses_the_batch_s_later_submissions(db: Database, fleet: None) -> None:
    tenant = new_tenant(db)
    give(db, tenant.owner(db), 100 * ONE_JOB)
    with db.transaction() as session:
        target = budgets.BudgetTarget(Level.PROJECT, tenant.org_id, tenant.project_id, None)
        budgets.create(session, target, Period.DAY, ONE_JOB, Enforcement.CAP, ADMIN,
                       db.now(session))
    first, second, third = admit(db, [(tenant, job()), (tenant, job()), (tenant, job())])
    assert isinstance(first, Job)
    for refused in (second, third):
        assert isinstance(refused, PaymentRequired)
        assert refused.extra["reason"] == "spend_cap_reached"
    assert count(db, Job) == 1
    with db.transaction(write=False) as session:  # counted once: the admitted job
        counted = session.execute(select(SpendCounter.amount).where(
            SpendCounter.scope == f"project:{tenant.project_id}",
            SpendCounter.period.like("day:%"))).scalar_one()
    assert counted == ONE_JOB
    assert_verified(db)


# ------------------------------------------------------------------ intake
@dataclass
class Caller:
    tenant: Tenant
    token: str


@pytest.fixture
def intake(db: Database, db_url: str, fleet: None, tmp_path: Path) -> Iterator[JobIntake]:
    platform = Platform(ControlConfig(db_url=db_url, blobs_url=str(tmp_path / "blobs"),
                                      secret="test-secret",
                                      gpu_prices="default=1,A100-80GB=2,H100-80GB=4"))
    intake = JobIntake(platform)
    yield intake
    intake.close()
    platform.db.dispose()


def caller(db: Database, credit: int = 100 * ONE_JOB) -> Caller:
    token = f"nbf_test_{uuid.uuid4().hex}"
    name = f"u-{uuid.uuid4().hex[:8]}"
    created = tenancy.create_user(db, name, f"org-{name}", "p", token=token)
    with db.transaction(write=False) as session:
        user = session.get(User, created.user_id)
        assert user is not None
        tenant = Tenant(user.org_id, user.project_id, user.id, f"org-{name}", "p", name)
    give(db, tenant.owner(db), credit)
    return Caller(tenant, token)


def submission(who: Caller | None, key: str | None = None, seed: int = 1,
               project: str | None = None) -> Submission:
    body = {"binary": "videogen", "args": {"seed": seed}}
    return Submission(token=who.token if who else None, idempotency_key=key,
                      fingerprint=request_fingerprint("POST", "/v1/jobs", body),
                      project=project, request=job(args={"seed": seed}))


def replies(batch: list[Submission]) -> list[Reply]:
    return [item.answer.result(timeout=30) for item in batch]


def test_each_submission_of_a_batch_gets_its_own_answer(db: Database,
                                                        intake: JobIntake) -> None:
    alice, bob = caller(db), caller(db)
    key = str(uuid.uuid4())
    batch = [submission(alice, key), submission(alice, key),  # the same key twice: races
             submission(None), submission(Caller(alice.tenant, "nbf_wrong")),
             submission(bob, project="p"), submission(bob, project="not-bobs"),
             submission(bob, str(uuid.uuid4()), seed=2)]
    for item in batch:
        assert item.answer.set_running_or_notify_cancel()
    intake.admit(batch)
    keyed, racing, anonymous, forged, named, misnamed, bobs = replies(batch)
    assert keyed.outcome is not None and keyed.outcome[0] == 202 and not keyed.replayed
    assert racing.error is not None and racing.error.status == 409
    assert anonymous.error is not None and anonymous.error.status == 401
    assert forged.error is not None and forged.error.status == 401
    assert named.outcome is not None and named.outcome[0] == 202
    assert misnamed.outcome is not None and misnamed.outcome[0] == 404  # stored, not raised
    assert bobs.outcome is not None and bobs.outcome[0] == 202
    assert count(db, Job) == 3
    # A retry replays the stored answer; the same key with another body is 422.
    retry, other_body = submission(alice, key), submission(alice, key, seed=99)
    for item in (retry, other_body):
        assert item.answer.set_running_or_notify_cancel()
    intake.admit([retry, other_body])
    replayed, conflicting = replies([retry, other_body])
    assert replayed.replayed and replayed.outcome == keyed.outcome
    assert conflicting.error is not None and conflicting.error.status == 422
    assert count(db, Job) == 3
    with db.transaction(write=False) as session:
        stored = session.execute(select(IdempotencyKey).where(
            IdempotencyKey.key == key)).scalar_one()
    assert stored.status_code == 202 and stored.response == keyed.outcome[1]
    assert_verified(db)


def test_a_batch_that_fails_as_a_whole_is_admitted_one_by_one(
        db: Database, intake: JobIntake, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deadlock, say, aborts the batch's transaction: nothing of it stays, and
    each submission is tried again in a transaction of its own."""
    real_admit = admission.admit
    sizes: list[int] = []

    def deadlocking(session, submissions, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(len(submissions))
        if len(submissions) > 1:
            real_admit(session, submissions, *args, **kwargs)  # writes, then fails
            raise OperationalError("INSERT ...", {}, Exception("deadlock detected"))
        return real_admit(session, submissions, *args, **kwargs)

    monkeypatch.setattr(admission, "admit", deadlocking)
    alice = caller(db)
    batch = [submission(alice, str(uuid.uuid4()), seed=seed) for seed in range(5)]
    for item in batch:
        assert item.answer.set_running_or_notify_cancel()
    intake.admit(batch)
    answers = replies(batch)
    assert sizes == [5, 1, 1, 1, 1, 1]
    assert all(a.outcome is not None and a.outcome[0] == 202 for a in answers)
    assert len({a.outcome[1]["id"] for a in answers if a.outcome}) == 5
    assert count(db, Job) == count(db, CreditHold) == 5
    assert_verified(db)


async def test_a_submission_whose_caller_left_is_not_admitted(db: Database,
                                                              intake: JobIntake) -> None:
    alice = caller(db)
    gone, kept = submission(alice, str(uuid.uuid4())), submission(alice, str(uuid.uuid4()))
    gone.answer.cancel()  # the client disconnected before its turn
    intake._queue.put(gone)
    reply = await intake.submit(kept)  # behind it in the queue
    assert reply.outcome is not None and reply.outcome[0] == 202
    assert count(db, Job) == 1
    with db.transaction(write=False) as session:
        assert session.get(IdempotencyKey, (alice.tenant.user_id, gone.idempotency_key)) is None
