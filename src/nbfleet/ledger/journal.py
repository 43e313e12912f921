"""Posting balanced transactions to the journal and to the buckets' running totals.

Every movement takes credits of one bucket from one account to another, so each
posts two entries that cancel out: the journal balances by construction, per
transaction and per bucket. The running totals on ``credit_buckets`` are updated
by increments in the same statement order (bucket id), never by a value read
earlier: no read-modify-write, and row locks always taken in one order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import bindparam, update
from sqlalchemy.orm import Session

from nbfleet.db.bulk import append_rows
from nbfleet.db.credit_tables import CreditBucket, LedgerEntry
from nbfleet.db.ids import new_id


class Account(StrEnum):
    GRANTED = "granted"
    AVAILABLE = "available"
    HELD = "held"
    CONSUMED = "consumed"
    EXPIRED = "expired"


BALANCE_ACCOUNTS = (Account.AVAILABLE, Account.HELD, Account.CONSUMED, Account.EXPIRED)


@dataclass(frozen=True, slots=True)
class Move:
    bucket_id: str
    wallet_id: str
    source: Account
    target: Account
    amount: int


def post(session: Session, kind: str, moves: list[Move], now: datetime,
         hold_id: str | None = None, totals: bool = True) -> str | None:
    """Write the moves as one journal transaction; return its id (None if empty).

    ``totals=False`` only for a grant, whose new bucket row is inserted with its
    totals already set.
    """
    return post_many(session, kind, [(hold_id, moves)], now, totals)[0]


def post_many(session: Session, kind: str, groups: list[tuple[str | None, list[Move]]],
              now: datetime, totals: bool = True) -> list[str | None]:
    """Write each group as its own journal transaction, in one INSERT, and add them
    all to the buckets' totals in one UPDATE per bucket (the metering path)."""
    entries: list[dict[str, object]] = []
    deltas: dict[str, dict[Account, int]] = defaultdict(lambda: dict.fromkeys(Account, 0))
    txn_ids: list[str | None] = []
    for hold_id, group in groups:
        group = [move for move in group if move.amount]
        if not group:
            txn_ids.append(None)
            continue
        txn_id = new_id("txn")
        txn_ids.append(txn_id)
        for move in group:
            if move.amount < 0 or move.source == move.target:
                raise ValueError(f"bad move {move}")
            for account, amount in ((move.source, -move.amount), (move.target, move.amount)):
                entries.append({"txn_id": txn_id, "kind": kind, "wallet_id": move.wallet_id,
                                "bucket_id": move.bucket_id, "hold_id": hold_id,
                                "account": str(account), "amount": amount, "created_at": now})
                deltas[move.bucket_id][account] += amount
    if entries:
        append_rows(session, LedgerEntry.__table__, entries)  # type: ignore[arg-type]
        if totals:
            apply_to_buckets(session, deltas)
    return txn_ids


_BUCKET_TOTALS = (
    update(CreditBucket)
    .where(CreditBucket.id == bindparam("b_id"))
    .values(
        available=CreditBucket.available + bindparam("d_available"),
        held=CreditBucket.held + bindparam("d_held"),
        consumed=CreditBucket.consumed + bindparam("d_consumed"),
        expired=CreditBucket.expired + bindparam("d_expired"),
    )
)


def apply_to_buckets(session: Session, deltas: dict[str, dict[Account, int]]) -> None:
    """Add the deltas to the buckets' totals, in bucket-id order (the lock order).

    One UPDATE per bucket (executemany, which psycopg pipelines), never one
    statement for all of them: the metering path reaches here without having
    locked the buckets, and only statements run in id order take their locks in id
    order (a single UPDATE ... FROM takes them in whatever order its plan visits
    them, which deadlocked concurrent settles on one wallet)."""
    rows = [
        {"b_id": bucket_id, **{f"d_{account}": delta[account] for account in BALANCE_ACCOUNTS}}
        for bucket_id, delta in sorted(deltas.items())
        if any(delta[account] for account in BALANCE_ACCOUNTS)
    ]
    if rows:
        session.connection().execute(_BUCKET_TOTALS, rows)
