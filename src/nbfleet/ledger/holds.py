"""Holds: reserve at admission, extend when usage runs past them, settle exactly once.

Lock order, the same in every transaction, so two of them never deadlock: the
hold row(s), by id in one statement; then the buckets, by id in one statement;
then the spend counters, by key in one statement. A transaction that touches more
than one hold's tenants (the reaper) settles each hold in its own transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, insert, or_, select
from sqlalchemy.orm import Session

from nbfleet.db.bulk import append_rows, insert_rows
from nbfleet.db.credit_tables import CreditBucket, CreditHold, CreditHoldPart, Wallet
from nbfleet.db.ids import new_id
from nbfleet.db.queries import among
from nbfleet.ledger import audit, budgets
from nbfleet.ledger.budgets import Scopes
from nbfleet.ledger.journal import Account, Move, post, post_many
from nbfleet.model.credits import (
    MAX_AMOUNT,
    BucketKey,
    GrantKind,
    draw,
    is_expired,
    spend_order_key,
)
from nbfleet.model.errors import (
    Conflict,
    DomainError,
    InvalidInput,
    NotFound,
    PaymentRequired,
)
from nbfleet.web.render import iso

ACTIVE = "active"
SETTLED = "settled"
SETTLE_REASONS = ("finished", "preempted", "failed", "cancelled", "lease_expired")
MAX_LEASE_S = 7 * 86400


@dataclass(frozen=True, slots=True)
class HoldRequest:
    work_id: str
    org_id: str
    project_id: str
    user_id: str | None
    gpu_type: str
    rate_per_gpu_hour: int
    amount: int
    lease_s: int = 300


def scopes_of(hold: CreditHold) -> Scopes:
    return Scopes(hold.org_id, hold.project_id, hold.user_id)


def view(hold: Any) -> dict[str, Any]:
    """A hold as the API shows it (``hold``: a CreditHold, or a record of its columns)."""
    return {
        "id": hold.id, "work_id": hold.work_id, "state": hold.state,
        "org_id": hold.org_id, "project_id": hold.project_id, "user_id": hold.user_id,
        "price": {"gpu_type": hold.gpu_type, "rate_per_gpu_hour": hold.rate_per_gpu_hour},
        "amount": hold.amount, "held": hold.held, "captured": hold.captured,
        "released": hold.released, "expired": hold.expired, "uncovered": hold.uncovered,
        "exhausted": hold.exhausted, "gpu_ms": hold.gpu_ms, "last_seq": hold.last_seq,
        "lease_s": hold.lease_s, "lease_expires_at": iso(hold.lease_expires_at),
        "settle_reason": hold.settle_reason, "settled_by": hold.settled_by,
        "created_at": iso(hold.created_at), "settled_at": iso(hold.settled_at),
    }


def snapshot(hold: Any) -> dict[str, Any]:
    """The audit trail's before/after of a hold: its money and its counter."""
    return {"state": hold.state, "amount": hold.amount, "held": hold.held,
            "captured": hold.captured, "released": hold.released, "expired": hold.expired,
            "uncovered": hold.uncovered, "gpu_ms": hold.gpu_ms, "last_seq": hold.last_seq}


def _validate(request: HoldRequest) -> None:
    if not request.work_id or len(request.work_id) > 100:
        raise InvalidInput("work_id must be 1 to 100 characters", field="work_id")
    if not 0 < request.amount <= MAX_AMOUNT:
        raise InvalidInput(f"amount must be between 1 and {MAX_AMOUNT} micro-credits",
                           field="amount")
    if not 0 <= request.rate_per_gpu_hour <= MAX_AMOUNT:
        raise InvalidInput("rate_per_gpu_hour must be 0 or more micro-credits",
                           field="rate_per_gpu_hour")
    if not 1 <= request.lease_s <= MAX_LEASE_S:
        raise InvalidInput(f"lease_s must be between 1 and {MAX_LEASE_S}", field="lease_s")


def reserve(session: Session, request: HoldRequest, actor: audit.Actor,
            now: datetime) -> tuple[CreditHold, bool]:
    """Hold credits for a piece of work: (hold, created).

    The same work id again returns the existing hold, so a retried admission never
    holds twice; with a different price or tenant it is a conflict.
    """
    outcome = reserve_many(session, [(request, actor)], now)[0]
    if isinstance(outcome, DomainError):
        raise outcome
    return outcome


Reserved = tuple[CreditHold, bool]


def reserve_many(session: Session, requests: Sequence[tuple[HoldRequest, audit.Actor]],
                 now: datetime) -> list[Reserved | DomainError]:
    """``reserve`` for a batch, in a few statements whatever its size: each
    request gets (hold, created) or the error that refuses it, exactly as if they
    were reserved one after the other in this order; a refused one leaves nothing.
    """
    outcomes: list[Reserved | DomainError | None] = [None] * len(requests)
    fresh: dict[int, CreditHold] = {}
    work_ids: set[str] = set()
    for index, (request, _actor) in enumerate(requests):
        try:
            _validate(request)
            if request.work_id in work_ids:
                raise Conflict(f"work {request.work_id!r} appears twice in one batch")
        except DomainError as exc:
            outcomes[index] = exc
            continue
        work_ids.add(request.work_id)
        fresh[index] = _new_hold(request, now)
    # First, before any other lock: a racing duplicate waits on the unique work_id
    # here, holding no bucket or counter, and then finds this hold.
    for index, outcome in _insert_or_find(session, fresh).items():
        outcomes[index] = outcome
        del fresh[index]
    refused = _draw_in_order(session, fresh, [actor for _request, actor in requests], now,
                             outcomes)
    if refused:
        session.execute(delete(CreditHold).where(CreditHold.id.in_(refused)))
    for index, hold in fresh.items():
        outcomes[index] = (hold, True)
    return [outcome for outcome in outcomes if outcome is not None]


def _new_hold(request: HoldRequest, now: datetime) -> CreditHold:
    day_key, month_key = budgets.periods_at(now)
    return CreditHold(
        id=new_id("hold"), work_id=request.work_id, org_id=request.org_id,
        project_id=request.project_id, user_id=request.user_id, gpu_type=request.gpu_type,
        rate_per_gpu_hour=request.rate_per_gpu_hour, amount=request.amount,
        held=request.amount, captured=0, released=0, expired=0, uncovered=0, gpu_ms=0,
        last_seq=0, state=ACTIVE, exhausted=False, lease_s=request.lease_s,
        lease_expires_at=now + timedelta(seconds=request.lease_s),
        day_key=day_key, month_key=month_key, created_at=now, updated_at=now)


_HOLD_COLUMNS = [column.key for column in CreditHold.__table__.columns]


def _insert_or_find(session: Session, fresh: dict[int, CreditHold]
                    ) -> dict[int, Reserved | DomainError]:
    """Insert the new holds in one statement; for each whose work id already had a
    hold, that hold (if it matches) or a conflict."""
    if not fresh:
        return {}
    inserted = {work_id for (work_id,) in insert_rows(
        session, CreditHold.__table__,  # type: ignore[arg-type]
        [{key: getattr(hold, key) for key in _HOLD_COLUMNS} for hold in fresh.values()],
        skip_conflicts_on=["work_id"], returning=["work_id"])}
    clashes = {hold.work_id: index for index, hold in fresh.items()
               if hold.work_id not in inserted}
    if not clashes:
        return {}
    existing = {hold.work_id: hold for hold in session.execute(
        select(CreditHold).where(CreditHold.work_id.in_(list(clashes)))).scalars()}
    return {index: _same_or_conflict(fresh[index], existing.get(work_id))
            for work_id, index in clashes.items()}


def _same_or_conflict(wanted: CreditHold, existing: CreditHold | None
                      ) -> Reserved | DomainError:
    if existing is None:
        return Conflict(f"work {wanted.work_id!r} is being admitted; retry")
    if (existing.org_id, existing.project_id, existing.user_id, existing.gpu_type,
            existing.rate_per_gpu_hour) != (wanted.org_id, wanted.project_id, wanted.user_id,
                                            wanted.gpu_type, wanted.rate_per_gpu_hour):
        return Conflict(f"work {wanted.work_id!r} already has a different hold",
                        hold_id=existing.id)
    return existing, False


def _draw_in_order(session: Session, fresh: dict[int, CreditHold], actors: list[audit.Actor],
                   now: datetime, outcomes: list[Reserved | DomainError | None]) -> list[str]:
    """Fund the new holds one after the other from their tenants' buckets and
    budgets: post what they take, and return the ids of those refused (their error
    goes into ``outcomes`` and they leave ``fresh``). Locks the buckets of every
    tenant involved in one statement, then the spend counters."""
    if not fresh:
        return []
    charges = {index: budgets.Charge(scopes_of(hold), (hold.day_key, hold.month_key),
                                     hold.amount, actors[index], hold.work_id)
               for index, hold in fresh.items()}
    locked = _lock_buckets(session, [charge.scopes for charge in charges.values()], now)
    book = budgets.BudgetBook.open(session, list(charges.values()))
    available = {bucket.id: bucket.available for bucket, _owner in locked}
    refused: list[int] = []
    funded: list[tuple[int, CreditHold, list[tuple[CreditBucket, int]]]] = []
    for index, hold in fresh.items():
        spendable = _spendable(locked, scopes_of(hold), now)
        taken = draw([(bucket.id, available[bucket.id]) for bucket in spendable], hold.amount)
        got = sum(part for _bucket_id, part in taken)
        refusal: DomainError | None = None
        if got < hold.amount:
            refusal = PaymentRequired(
                f"insufficient credits: {hold.amount} micro-credits requested, {got} "
                "available", reason="insufficient_credits", requested=hold.amount,
                available=got)
        else:
            refusal = book.charge(charges[index])
        if refusal is not None:
            outcomes[index] = refusal
            refused.append(index)
            continue
        buckets = {bucket.id: bucket for bucket in spendable}
        for bucket_id, part in taken:
            available[bucket_id] -= part
        funded.append((index, hold, [(buckets[bucket_id], part) for bucket_id, part in taken]))
    book.close(session, now)
    refused_ids = [fresh.pop(index).id for index in refused]
    append_rows(session, CreditHoldPart.__table__,  # type: ignore[arg-type]
                [row for _index, hold, taken in funded for row in _part_rows(hold.id, taken, [])])
    post_many(session, "reserve", [
        (hold.id, [Move(bucket.id, bucket.wallet_id, Account.AVAILABLE, Account.HELD, part)
                   for bucket, part in taken]) for _index, hold, taken in funded], now)
    audit.record_each(session, now, [
        (actors[index], audit.AuditRow("reserve", hold.id, hold.org_id, hold.project_id,
                                       _wallet_of(taken), None, snapshot(hold)))
        for index, hold, taken in funded])
    return refused_ids


def _wallet_of(taken: Sequence[tuple[CreditBucket, int]]) -> str | None:
    return taken[0][0].wallet_id if taken else None


def _owners(scopes: Scopes) -> dict[str, int]:
    """A tenant's wallets in spend order: the project's own credits before the
    org's shared pool."""
    return {f"project:{scopes.project_id}": 0, f"org:{scopes.org_id}": 1}


def _lock_buckets(session: Session, tenants: Sequence[Scopes], now: datetime,
                  also: Sequence[str] = ()) -> list[tuple[CreditBucket, str]]:
    """Lock, in one statement and by id, the spendable buckets of the tenants and
    the buckets in ``also`` (a hold's own): [(bucket, its wallet's owner)]."""
    owners = sorted({owner for scopes in tenants for owner in _owners(scopes)})
    spendable = and_(among(session, Wallet.owner, owners), CreditBucket.available > 0,
                     or_(CreditBucket.expires_at.is_(None), CreditBucket.expires_at > now))
    rows = session.execute(
        select(CreditBucket, Wallet.owner)
        .join(Wallet, Wallet.id == CreditBucket.wallet_id)
        .where(or_(spendable, CreditBucket.id.in_(list(also))) if also else spendable)
        .order_by(CreditBucket.id)
        .with_for_update(of=CreditBucket)
        .execution_options(populate_existing=True)
    ).all()
    return [(row.CreditBucket, row.owner) for row in rows]


def _spendable(locked: list[tuple[CreditBucket, str]], scopes: Scopes,
               now: datetime) -> list[CreditBucket]:
    """The tenant's spendable buckets among those locked, in spend order."""
    owners = _owners(scopes)

    def order(entry: tuple[CreditBucket, str]) -> tuple[int, tuple[Any, ...]]:
        bucket, owner = entry
        return owners[owner], spend_order_key(BucketKey(
            bucket.id, bucket.priority, bucket.expires_at, GrantKind(bucket.kind),
            bucket.created_at))

    return [bucket for bucket, owner in sorted(
        ((bucket, owner) for bucket, owner in locked if owner in owners), key=order)
        if bucket.available > 0 and not is_expired(bucket.expires_at, now)]


def _take(spendable: list[CreditBucket], amount: int) -> list[tuple[CreditBucket, int]]:
    """Draw ``amount`` from the buckets, in their order."""
    buckets = {bucket.id: bucket for bucket in spendable}
    taken = draw([(bucket.id, bucket.available) for bucket in spendable], amount)
    return [(buckets[bucket_id], part) for bucket_id, part in taken]


def _part_rows(hold_id: str, taken: list[tuple[CreditBucket, int]],
               parts: list[CreditHoldPart]) -> list[dict[str, Any]]:
    """The new part rows recording where held credits came from; parts the hold
    already has for a bucket grow in place instead."""
    existing = {part.bucket_id: part for part in parts}
    fresh = []
    ordinal = max((part.ordinal for part in parts), default=-1)
    for bucket, amount in taken:
        if bucket.id in existing:
            existing[bucket.id].amount += amount
            existing[bucket.id].held += amount
            continue
        ordinal += 1
        fresh.append({"hold_id": hold_id, "bucket_id": bucket.id, "ordinal": ordinal,
                      "amount": amount, "held": amount, "captured": 0})
    return fresh


def lock(session: Session, hold_ids: Sequence[str]) -> dict[str, CreditHold]:
    rows = session.execute(
        select(CreditHold).where(CreditHold.id.in_(sorted(set(hold_ids))))
        .order_by(CreditHold.id).with_for_update()
        .execution_options(populate_existing=True)
    ).scalars()
    return {hold.id: hold for hold in rows}


def parts_of(session: Session, hold_ids: Sequence[str]) -> dict[str, list[CreditHoldPart]]:
    rows = session.execute(
        select(CreditHoldPart).where(CreditHoldPart.hold_id.in_(list(hold_ids)))
        .order_by(CreditHoldPart.hold_id, CreditHoldPart.ordinal)
        .execution_options(populate_existing=True)
    ).scalars()
    grouped: dict[str, list[CreditHoldPart]] = {hold_id: [] for hold_id in hold_ids}
    for part in rows:
        grouped[part.hold_id].append(part)
    return grouped


def extend(session: Session, hold: CreditHold, parts: list[CreditHoldPart], need: int,
           actor: audit.Actor, now: datetime) -> int:
    """Hold ``need`` more for a running hold if budgets and balance allow; return what
    was added (less than ``need``, down to 0, when they do not).

    Locks the hold's own buckets together with the spendable ones, so the capture
    that follows takes no bucket lock out of order.
    """
    scopes = scopes_of(hold)
    taken = _take(_spendable(_lock_buckets(session, [scopes], now,
                                           [part.bucket_id for part in parts]), scopes, now),
                  need)
    got = sum(part for _bucket, part in taken)
    if not got:
        return 0
    try:
        with session.begin_nested():
            budgets.commit(session, scopes_of(hold), (hold.day_key, hold.month_key), got,
                           actor, now, hold.work_id)
    except PaymentRequired:
        return 0
    fresh = _part_rows(hold.id, taken, parts)
    if fresh:
        session.execute(insert(CreditHoldPart), fresh)
    post(session, "extend", [Move(bucket.id, bucket.wallet_id, Account.AVAILABLE,
                                  Account.HELD, part) for bucket, part in taken], now, hold.id)
    hold.amount += got
    hold.held += got
    return got


def settle(session: Session, hold_id: str, reason: str, actor: audit.Actor,
           now: datetime) -> tuple[CreditHold, bool]:
    """Release what a hold still holds to the buckets it came from: (hold, changed).

    A settled hold is returned unchanged, so a retried finish, or one racing the
    reaper, releases nothing twice. A bucket that expired meanwhile sends its
    share to ``expired``.
    """
    if reason not in SETTLE_REASONS:
        raise InvalidInput(f"reason must be one of {', '.join(SETTLE_REASONS)}", field="reason")
    hold = lock(session, [hold_id]).get(hold_id)
    if hold is None:
        raise NotFound(f"hold {hold_id} not found")
    if hold.state == SETTLED:
        return hold, False
    before = snapshot(hold)
    parts = [part for part in parts_of(session, [hold.id])[hold.id] if part.held]
    buckets = lock_buckets(session, [part.bucket_id for part in parts])
    budgets.uncommit(session, scopes_of(hold), (hold.day_key, hold.month_key), hold.held)
    moves = []
    for part in sorted(parts, key=lambda p: p.bucket_id):
        bucket = buckets[part.bucket_id]
        target = Account.EXPIRED if is_expired(bucket.expires_at, now) else Account.AVAILABLE
        moves.append(Move(part.bucket_id, bucket.wallet_id, Account.HELD, target, part.held))
        if target is Account.EXPIRED:
            hold.expired += part.held
        else:
            hold.released += part.held
        part.held = 0
    # Zero held before posting: the post's INSERT autoflushes the hold, and its
    # balance check (amount = held + captured + released + expired) must hold then.
    hold.held = 0
    post(session, "release", moves, now, hold.id)
    hold.state = SETTLED
    hold.settle_reason = reason
    hold.settled_by = actor.actor
    hold.settled_at = hold.updated_at = now
    audit.record(session, actor, now, [audit.AuditRow(
        "settle", hold.id, hold.org_id, hold.project_id,
        moves[0].wallet_id if moves else None, before, {**snapshot(hold), "reason": reason})])
    return hold, True


def reprice(session: Session, prices: Mapping[str, tuple[str, int]], actor: audit.Actor,
            now: datetime) -> None:
    """Fix the price of holds whose work is starting: hold id -> (GPU type, rate).

    Work that may run on several GPU types holds at the dearest rate; when it
    starts, the price becomes the bound type's. Only an active hold with nothing
    metered yet may change, and only downwards, so what was held still covers it.
    """
    if not prices:
        return
    locked = lock(session, list(prices))
    audits = []
    for hold_id, (gpu_type, rate) in sorted(prices.items()):
        hold = locked.get(hold_id)
        if hold is None:
            raise NotFound(f"hold {hold_id} not found")
        if hold.state != ACTIVE or hold.gpu_ms or rate > hold.rate_per_gpu_hour:
            raise Conflict(f"hold {hold_id} cannot be repriced (state {hold.state}, "
                           f"{hold.gpu_ms} GPU-ms metered, rate {rate} > "
                           f"{hold.rate_per_gpu_hour}?)")
        before = {"gpu_type": hold.gpu_type, "rate_per_gpu_hour": hold.rate_per_gpu_hour}
        hold.gpu_type, hold.rate_per_gpu_hour, hold.updated_at = gpu_type, rate, now
        audits.append(audit.AuditRow("reprice", hold.id, hold.org_id, hold.project_id, None,
                                     before, {"gpu_type": gpu_type, "rate_per_gpu_hour": rate}))
    audit.record(session, actor, now, audits)


def lock_buckets(session: Session, bucket_ids: Sequence[str]) -> dict[str, CreditBucket]:
    """Lock these buckets by id in one statement (before any spend counter)."""
    if not bucket_ids:
        return {}
    rows = session.execute(
        select(CreditBucket).where(CreditBucket.id.in_(sorted(set(bucket_ids))))
        .order_by(CreditBucket.id).with_for_update()
        .execution_options(populate_existing=True)
    ).scalars()
    return {bucket.id: bucket for bucket in rows}


def lapsed(session: Session, now: datetime, limit: int = 100) -> list[str]:
    """Active holds whose lease ran out: their owner stopped reporting and never
    settled, so the credits would otherwise be stranded."""
    return list(session.execute(
        select(CreditHold.id)
        .where(CreditHold.state == ACTIVE, CreditHold.lease_expires_at <= now)
        .order_by(CreditHold.id).limit(limit)
    ).scalars())


def reap_one(session: Session, hold_id: str, now: datetime) -> bool:
    """Settle one lapsed hold, unless another transaction has it locked (a finish
    or another reaper: it will settle or renew it) or it is no longer lapsed."""
    hold = session.execute(
        select(CreditHold).where(CreditHold.id == hold_id)
        .with_for_update(skip_locked=True).execution_options(populate_existing=True)
    ).scalar_one_or_none()
    if hold is None or hold.state != ACTIVE or hold.lease_expires_at > now:
        return False
    return settle(session, hold_id, "lease_expired", audit.SYSTEM_REAPER, now)[1]


def reap(session: Session, now: datetime, limit: int = 100) -> list[str]:
    """Settle the lapsed holds in this one transaction (``service.reap`` gives each
    its own, so concurrent reapers never hold two tenants' locks at once)."""
    return [hold_id for hold_id in lapsed(session, now, limit)
            if reap_one(session, hold_id, now)]
