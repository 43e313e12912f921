"""Issuing credits, expiring what is left of them, and reading balances."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.db.credit_tables import CreditBucket, Wallet
from nbfleet.db.ids import new_id
from nbfleet.ledger import audit, wallets
from nbfleet.ledger.journal import Account, Move, post
from nbfleet.ledger.wallets import WalletOwner
from nbfleet.model.credits import MAX_AMOUNT, GrantKind
from nbfleet.model.errors import InvalidInput
from nbfleet.web.render import iso


def bucket_view(bucket: CreditBucket) -> dict[str, Any]:
    return {
        "id": bucket.id, "wallet_id": bucket.wallet_id, "kind": bucket.kind,
        "priority": bucket.priority, "amount": bucket.amount, "available": bucket.available,
        "held": bucket.held, "consumed": bucket.consumed, "expired": bucket.expired,
        "expires_at": iso(bucket.expires_at), "memo": bucket.memo,
        "created_by": bucket.created_by, "created_at": iso(bucket.created_at),
    }


@dataclass(frozen=True, slots=True)
class GrantRequest:
    kind: GrantKind
    amount: int
    expires_at: datetime | None = None
    priority: int = 0
    memo: str | None = None


def issue(session: Session, owner: WalletOwner, request: GrantRequest, actor: audit.Actor,
          now: datetime) -> CreditBucket:
    """Add a bucket of credits to the owner's wallet."""
    if not 0 < request.amount <= MAX_AMOUNT:
        raise InvalidInput(f"amount must be between 1 and {MAX_AMOUNT} micro-credits",
                           field="amount")
    if request.expires_at is not None and request.expires_at <= now:
        raise InvalidInput("expires_at is in the past", field="expires_at")
    wallet = wallets.ensure(session, owner, now)
    bucket = CreditBucket(
        id=new_id("grt"), wallet_id=wallet.id, kind=str(request.kind),
        priority=request.priority, amount=request.amount, available=request.amount, held=0,
        consumed=0, expired=0, expires_at=request.expires_at, memo=request.memo,
        created_by=actor.actor, created_at=now)
    session.add(bucket)
    session.flush()
    post(session, "grant", [Move(bucket.id, wallet.id, Account.GRANTED, Account.AVAILABLE,
                                 request.amount)], now, totals=False)
    audit.record(session, actor, now, [audit.AuditRow(
        "grant", bucket.id, owner.org_id, owner.project_id, wallet.id, None,
        bucket_view(bucket))])
    return bucket


def expire_due(session: Session, now: datetime, wallet_ids: list[str] | None = None,
               limit: int = 500) -> int:
    """Move the available remainder of every bucket past its expiry to ``expired``.

    Held credits stay held: work admitted before the expiry keeps its hold, and
    what it does not use goes to ``expired`` when it is released.
    """
    query = (select(CreditBucket, Wallet.org_id, Wallet.project_id)
             .join(Wallet, Wallet.id == CreditBucket.wallet_id)
             .where(CreditBucket.expires_at <= now, CreditBucket.available > 0)
             .order_by(CreditBucket.id).limit(limit)
             .with_for_update(of=CreditBucket, skip_locked=wallet_ids is None)
             .execution_options(populate_existing=True))
    if wallet_ids is not None:
        query = query.where(CreditBucket.wallet_id.in_(wallet_ids))
    rows = session.execute(query).all()
    if not rows:
        return 0
    moves, notes = [], []
    for bucket, org_id, project_id in rows:
        before = bucket_view(bucket)
        moves.append(Move(bucket.id, bucket.wallet_id, Account.AVAILABLE, Account.EXPIRED,
                          bucket.available))
        after = {**before, "available": 0, "expired": bucket.expired + bucket.available}
        notes.append(audit.AuditRow("expire", bucket.id, org_id, project_id, bucket.wallet_id,
                                    before, after))
    post(session, "expire", moves, now)
    for bucket, _org, _project in rows:
        session.expire(bucket)
    audit.record(session, audit.SYSTEM_EXPIRY, now, notes)
    return len(rows)


def balance(session: Session, owner: WalletOwner, now: datetime,
            upcoming: int = 10) -> dict[str, Any]:
    """The wallet's totals, split promo against paid, and the next expirations."""
    wallet = wallets.find(session, owner)
    totals = dict.fromkeys(("granted", "available", "held", "consumed", "expired"), 0)
    by_kind = {str(kind): {"available": 0, "held": 0} for kind in GrantKind}
    expiring: list[dict[str, Any]] = []
    if wallet is not None:
        buckets = session.execute(
            select(CreditBucket).where(CreditBucket.wallet_id == wallet.id)
            .order_by(CreditBucket.expires_at, CreditBucket.id)
        ).scalars().all()
        for bucket in buckets:
            totals["granted"] += bucket.amount
            for name in ("available", "held", "consumed", "expired"):
                totals[name] += getattr(bucket, name)
            by_kind[bucket.kind]["available"] += bucket.available
            by_kind[bucket.kind]["held"] += bucket.held
            if bucket.expires_at is not None and bucket.available and len(expiring) < upcoming:
                expiring.append({"grant_id": bucket.id, "kind": bucket.kind,
                                 "amount": bucket.available, "expires_at": iso(bucket.expires_at)})
    return {
        "wallet_id": wallet.id if wallet else None,
        "org": owner.org, "project": owner.project,
        **totals,
        "promo": by_kind[GrantKind.PROMO],
        "paid": {"available": by_kind[GrantKind.PURCHASE]["available"]
                 + by_kind[GrantKind.GRANT]["available"],
                 "held": by_kind[GrantKind.PURCHASE]["held"] + by_kind[GrantKind.GRANT]["held"]},
        "by_kind": by_kind,
        "upcoming_expirations": expiring,
        "as_of": iso(now),
    }
