"""The ledger against an in-memory reference model, step by step (hypothesis stateful).

The model keeps plain dicts of buckets and holds and applies the rules of
``nbfleet.model.credits`` (the spec); after every step the DB must agree with it
to the micro-credit, every wallet must balance, and ``verify`` must pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import select

from nbfleet.db import migrate
from nbfleet.db.credit_tables import CreditBucket, CreditHold
from nbfleet.db.engine import Database
from nbfleet.ledger import verify
from nbfleet.model.credits import (
    BucketKey,
    GrantKind,
    draw,
    is_expired,
    spend_order_key,
    usage_cost,
)
from nbfleet.model.errors import PaymentRequired
from tests.support.ledger import T0, Tenant, give, new_tenant
from tests.support.ledger_ops import expire, reap, reserve, settle, usage

RATES = (3_600_000, 1_000_000, 7_777_777)


@dataclass
class Bucket:
    id: str
    wallet: int  # 0: the project's own, 1: the org's shared pool
    key: BucketKey
    amount: int
    available: int
    held: int = 0
    consumed: int = 0
    expired: int = 0


@dataclass
class Part:
    bucket: str
    held: int
    captured: int = 0


@dataclass
class Hold:
    id: str
    rate: int
    lease_s: int
    lease_expires_at: datetime
    amount: int
    held: int
    parts: list[Part]
    captured: int = 0
    released: int = 0
    expired: int = 0
    uncovered: int = 0
    #: The last extension fell short: the work runs past its credits.
    exhausted: bool = False
    gpu_ms: int = 0
    last_seq: int = 0
    state: str = "active"
    sent: list[tuple[int, int]] = field(default_factory=list)  # (seq, gpu_ms) reported


class _Clock:
    """One clock for the whole module, only moving forward, so the examples sharing
    the database never see another's rows from the future."""

    now = T0


class LedgerMachine(RuleBasedStateMachine):
    db: Database

    def __init__(self) -> None:
        super().__init__()
        self.buckets: dict[str, Bucket] = {}
        self.holds: dict[str, Hold] = {}
        self.works = 0

    @initialize(promo=st.integers(1, 500), expires_in=st.integers(1, 300),
                paid=st.integers(0, 1000), pooled=st.integers(0, 500))
    def tenant(self, promo: int, expires_in: int, paid: int, pooled: int) -> None:
        """A fresh tenant, with some credits to start from: a promo that expires soon,
        purchased credits, and some in the org's pool."""
        self.t: Tenant = new_tenant(self.db)
        self.owners = (self.t.owner(self.db), self.t.owner(self.db, project_wallet=False))
        _Clock.now += timedelta(days=1)
        self.grant(GrantKind.PROMO, promo, expires_in, 0, False)
        if paid:
            self.grant(GrantKind.PURCHASE, paid, None, 0, False)
        if pooled:
            self.grant(GrantKind.GRANT, pooled, None, 0, True)
        self.reserve(min(promo + paid + pooled, 300), 120, RATES[0])

    @property
    def now(self) -> datetime:
        return _Clock.now

    # ---- the model's rules -------------------------------------------------------

    def _draw(self, amount: int) -> list[tuple[str, int]]:
        spendable = [b for b in self.buckets.values()
                     if b.available > 0 and not is_expired(b.key.expires_at, self.now)]
        spendable.sort(key=lambda b: (b.wallet, spend_order_key(b.key)))
        return draw([(b.id, b.available) for b in spendable], amount)

    def _hold_from(self, hold: Hold, taken: list[tuple[str, int]]) -> None:
        for bucket_id, part in taken:
            bucket = self.buckets[bucket_id]
            bucket.available -= part
            bucket.held += part
            same = [p for p in hold.parts if p.bucket == bucket_id]
            if same:
                same[0].held += part
            else:
                hold.parts.append(Part(bucket_id, part))

    def _settle(self, hold: Hold) -> None:
        for part in hold.parts:
            bucket = self.buckets[part.bucket]
            bucket.held -= part.held
            if is_expired(bucket.key.expires_at, self.now):
                bucket.expired += part.held
                hold.expired += part.held
            else:
                bucket.available += part.held
                hold.released += part.held
            part.held = 0
        hold.held = 0
        hold.state = "settled"

    # ---- steps -------------------------------------------------------------------

    @rule(kind=st.sampled_from(list(GrantKind)), amount=st.integers(1, 400),
          expires_in=st.one_of(st.none(), st.integers(1, 600)), priority=st.integers(0, 2),
          org=st.booleans())
    def grant(self, kind: GrantKind, amount: int, expires_in: int | None, priority: int,
              org: bool) -> None:
        expires_at = None if expires_in is None else self.now + timedelta(seconds=expires_in)
        bucket_id = give(self.db, self.owners[int(org)], amount, self.now, kind, expires_at,
                         priority)
        self.buckets[bucket_id] = Bucket(bucket_id, int(org), BucketKey(
            bucket_id, priority, expires_at, kind, self.now), amount, amount)

    @rule(amount=st.integers(1, 400), lease_s=st.integers(1, 300),
          rate=st.sampled_from(RATES))
    def reserve(self, amount: int, lease_s: int, rate: int) -> None:
        self.works += 1
        work_id = f"w-{self.t.user_id}-{self.works}"
        taken = self._draw(amount)
        if sum(part for _b, part in taken) < amount:
            with pytest.raises(PaymentRequired) as refused:
                reserve(self.db, self.t, work_id, amount, self.now, lease_s, rate=rate)
            assert refused.value.extra["reason"] == "insufficient_credits"
            return
        row = reserve(self.db, self.t, work_id, amount, self.now, lease_s, rate=rate)
        hold = Hold(row.id, rate, lease_s, self.now + timedelta(seconds=lease_s), amount,
                    amount, [])
        self._hold_from(hold, taken)
        self.holds[hold.id] = hold

    @precondition(lambda self: self.holds)
    @rule(pick=st.integers(0, 10**6), step=st.integers(0, 300),
          mode=st.sampled_from(["next", "next", "next", "repeat", "older", "skip"]))
    def usage(self, pick: int, step: int, mode: str) -> None:
        hold = list(self.holds.values())[pick % len(self.holds)]
        top = max((seq for seq, _ms in hold.sent), default=0)
        if mode == "next" or not hold.sent:
            seq, gpu_ms = top + 1, max((ms for _s, ms in hold.sent), default=0) + step
        elif mode == "skip":  # a gap: some reports were lost
            seq, gpu_ms = top + 3, max(ms for _s, ms in hold.sent) + step
        elif mode == "repeat":  # a retry of the latest report
            seq, gpu_ms = max(hold.sent)
        else:  # a report overtaken by a later one
            seq, gpu_ms = hold.sent[pick % len(hold.sent)]
        hold.sent.append((seq, gpu_ms))
        outcome = usage(self.db, hold.id, seq, gpu_ms, self.now)
        if hold.state != "active":
            assert outcome.status == "settled"
            return
        if seq <= hold.last_seq:
            assert outcome.status == "duplicate"
            return
        hold.gpu_ms = max(hold.gpu_ms, gpu_ms)
        due = usage_cost(hold.gpu_ms, hold.rate) - hold.captured - hold.uncovered
        extending = due > hold.held
        if extending:
            taken = self._draw(due - hold.held)
            got = sum(part for _b, part in taken)
            self._hold_from(hold, taken)
            hold.amount += got
            hold.held += got
        covered = min(due, hold.held)
        left = covered
        for part in hold.parts:
            take = min(part.held, left)
            part.held -= take
            part.captured += take
            left -= take
            bucket = self.buckets[part.bucket]
            bucket.held -= take
            bucket.consumed += take
        hold.held -= covered
        hold.captured += covered
        hold.uncovered += due - covered
        if extending:  # a later grant that covers the work clears it again
            hold.exhausted = covered < due
        hold.last_seq = seq
        hold.lease_expires_at = self.now + timedelta(seconds=hold.lease_s)
        assert outcome.status == ("exhausted" if hold.exhausted else "applied")

    @precondition(lambda self: self.holds)
    @rule(pick=st.integers(0, 10**6), step=st.integers(0, 300))
    def more_usage(self, pick: int, step: int) -> None:
        """Usage is the most frequent event in a real ledger: a second rule for it."""
        self.usage(pick, step, "next")

    @precondition(lambda self: self.holds)
    @rule(pick=st.integers(0, 10**6),
          reason=st.sampled_from(["finished", "preempted", "failed", "cancelled"]))
    def settle(self, pick: int, reason: str) -> None:
        hold = list(self.holds.values())[pick % len(self.holds)]
        _row, changed = settle(self.db, hold.id, reason, self.now)
        assert changed == (hold.state == "active")
        if changed:
            self._settle(hold)

    @rule(seconds=st.sampled_from([1, 30, 60, 120, 300, 900]))
    def advance(self, seconds: int) -> None:
        _Clock.now += timedelta(seconds=seconds)

    @rule()
    def expire_due(self) -> None:
        expire(self.db, self.now)
        for bucket in self.buckets.values():
            if is_expired(bucket.key.expires_at, self.now) and bucket.available:
                bucket.expired += bucket.available
                bucket.available = 0

    @rule()
    def reap(self) -> None:
        reaped = set(reap(self.db, self.now))
        due = {h.id for h in self.holds.values()
               if h.state == "active" and h.lease_expires_at <= self.now}
        assert due <= reaped  # (holds of earlier examples may lapse too)
        for hold_id in due:
            self._settle(self.holds[hold_id])

    # ---- after every step --------------------------------------------------------

    @invariant()
    def agrees_with_the_db(self) -> None:
        with self.db.transaction(write=False) as session:
            rows = {row.id: row for row in session.execute(select(CreditBucket).where(
                CreditBucket.id.in_(list(self.buckets)))).scalars()}
            holds = {row.id: row for row in session.execute(select(CreditHold).where(
                CreditHold.id.in_(list(self.holds)))).scalars()}
            report = verify.verify(session)
        assert report.ok, report.mismatches
        for bucket in self.buckets.values():
            row = rows[bucket.id]
            assert (row.available, row.held, row.consumed, row.expired) == (
                bucket.available, bucket.held, bucket.consumed, bucket.expired), bucket.id
        for hold in self.holds.values():
            row = holds[hold.id]
            assert (row.amount, row.held, row.captured, row.released, row.expired,
                    row.uncovered, row.exhausted, row.gpu_ms, row.last_seq, row.state) == (
                hold.amount, hold.held, hold.captured, hold.released, hold.expired,
                hold.uncovered, hold.exhausted, hold.gpu_ms, hold.last_seq, hold.state), hold.id
            assert row.lease_expires_at == hold.lease_expires_at
        for wallet in (0, 1):
            mine = [b for b in self.buckets.values() if b.wallet == wallet]
            granted = sum(b.amount for b in mine)
            assert granted == sum(b.available + b.held + b.consumed + b.expired for b in mine)
        for hold in self.holds.values():
            assert hold.amount == hold.held + hold.captured + hold.released + hold.expired
            assert hold.held == sum(p.held for p in hold.parts)


@pytest.fixture(scope="module")
def module_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    from tests.conftest import fresh_database

    with fresh_database(tmp_path_factory.mktemp("ledger-model")) as url:
        database = Database(url)
        migrate.upgrade(database.engine)
        yield database
        database.dispose()


def test_the_ledger_follows_its_model(module_db: Database) -> None:
    LedgerMachine.db = module_db
    run_state_machine_as_test(LedgerMachine, settings=settings(
        max_examples=25, stateful_step_count=25, deadline=None))
