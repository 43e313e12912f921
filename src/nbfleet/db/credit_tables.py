"""The credit ledger's tables (see ``docs/ledger.md``).

Amounts are integer micro-credits. ``ledger_entries`` is the append-only journal;
the balance columns of ``credit_buckets`` and ``credit_holds`` are its running
totals, written in the same transaction as the entries, and ``nbfleet credit
verify`` recomputes them from the journal.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from nbfleet.db.tables import Base

#: An autoincrementing 64-bit key (SQLite only autoincrements INTEGER PRIMARY KEY).
_SERIAL = BigInteger().with_variant(Integer, "sqlite")


class Wallet(Base):
    """An org's shared wallet (``project_id`` null) or a project's own."""

    __tablename__ = "credit_wallets"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    #: ``org:<id>`` or ``project:<id>``: unique even where project_id is null.
    owner: Mapped[str] = mapped_column(String(60), unique=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"), index=True)
    project_id: Mapped[str | None] = mapped_column(ForeignKey("projects.id"))
    created_at: Mapped[datetime]


class CreditBucket(Base):
    """What is left of one grant, split by where its credits are now."""

    __tablename__ = "credit_buckets"
    __table_args__ = (
        Index("ix_credit_buckets_wallet", "wallet_id", "id"),
        Index("ix_credit_buckets_expiry", "expires_at"),
        CheckConstraint("available >= 0 AND held >= 0 AND consumed >= 0 AND expired >= 0",
                        name="ck_credit_buckets_nonnegative"),
        CheckConstraint("amount = available + held + consumed + expired",
                        name="ck_credit_buckets_balanced"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    wallet_id: Mapped[str] = mapped_column(ForeignKey("credit_wallets.id"))
    kind: Mapped[str] = mapped_column(String(10))
    priority: Mapped[int] = mapped_column(Integer)
    amount: Mapped[int] = mapped_column(BigInteger)
    available: Mapped[int] = mapped_column(BigInteger)
    held: Mapped[int] = mapped_column(BigInteger, default=0)
    consumed: Mapped[int] = mapped_column(BigInteger, default=0)
    expired: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[datetime | None]
    memo: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(60))
    created_at: Mapped[datetime]


class CreditHold(Base):
    """Credits reserved for one piece of work, captured as it is metered."""

    __tablename__ = "credit_holds"
    __table_args__ = (
        # The reaper's list: active holds only, and not by lease, so renewing a lease
        # on every usage report changes no indexed column (an in-place update).
        Index("ix_credit_holds_active", "id", postgresql_where=text("state = 'active'"),
              sqlite_where=text("state = 'active'")),
        Index("ix_credit_holds_tenant", "org_id", "project_id", "id"),
        CheckConstraint("held >= 0", name="ck_credit_holds_nonnegative"),
        CheckConstraint("amount = held + captured + released + expired",
                        name="ck_credit_holds_balanced"),
    )
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    #: The job or kernel this hold pays for: one hold per piece of work.
    work_id: Mapped[str] = mapped_column(String(100), unique=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    user_id: Mapped[str | None] = mapped_column(String(40))
    #: The price snapshot, fixed when the work starts.
    gpu_type: Mapped[str] = mapped_column(String(40))
    rate_per_gpu_hour: Mapped[int] = mapped_column(BigInteger)
    amount: Mapped[int] = mapped_column(BigInteger)
    held: Mapped[int] = mapped_column(BigInteger)
    captured: Mapped[int] = mapped_column(BigInteger, default=0)
    released: Mapped[int] = mapped_column(BigInteger, default=0)
    expired: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Metered cost that no credits were left to cover (the work ran past them).
    uncovered: Mapped[int] = mapped_column(BigInteger, default=0)
    #: The cumulative usage counter and the highest report sequence applied.
    gpu_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    state: Mapped[str] = mapped_column(String(10))
    exhausted: Mapped[bool] = mapped_column(default=False)
    settle_reason: Mapped[str | None] = mapped_column(String(20))
    settled_by: Mapped[str | None] = mapped_column(String(60))
    lease_s: Mapped[int] = mapped_column(Integer)
    lease_expires_at: Mapped[datetime]
    #: The budget periods this hold's spend counts against (those of its admission).
    day_key: Mapped[str] = mapped_column(String(20))
    month_key: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    settled_at: Mapped[datetime | None]


class CreditHoldPart(Base):
    """The share of a hold drawn from one bucket, so a refund goes back where it came from."""

    __tablename__ = "credit_hold_parts"
    hold_id: Mapped[str] = mapped_column(ForeignKey("credit_holds.id"), primary_key=True)
    bucket_id: Mapped[str] = mapped_column(ForeignKey("credit_buckets.id"), primary_key=True)
    #: Position in the spend order: captures draw parts in this order.
    ordinal: Mapped[int] = mapped_column(Integer)
    amount: Mapped[int] = mapped_column(BigInteger)
    held: Mapped[int] = mapped_column(BigInteger)
    captured: Mapped[int] = mapped_column(BigInteger, default=0)


class LedgerEntry(Base):
    """One leg of a balanced journal transaction. Never updated, never deleted.

    ``account`` is where the credits of ``bucket_id`` moved: the issuing side
    (``granted``, negative) or one of available, held, consumed, expired. The
    entries of one ``txn_id`` sum to zero.
    """

    __tablename__ = "ledger_entries"
    __table_args__ = (
        Index("ix_ledger_entries_wallet", "wallet_id", "id"),
        Index("ix_ledger_entries_bucket", "bucket_id"),
        Index("ix_ledger_entries_hold", "hold_id"),
    )
    id: Mapped[int] = mapped_column(_SERIAL, primary_key=True)
    #: Not indexed: only the reconciliation check reads by it, in one full pass.
    txn_id: Mapped[str] = mapped_column(String(40))
    kind: Mapped[str] = mapped_column(String(20))
    wallet_id: Mapped[str] = mapped_column(String(40))
    bucket_id: Mapped[str] = mapped_column(String(40))
    hold_id: Mapped[str | None] = mapped_column(String(40))
    account: Mapped[str] = mapped_column(String(10))
    amount: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]


class Budget(Base):
    """A spending limit per day or month for an org, a project or a user."""

    __tablename__ = "credit_budgets"
    __table_args__ = (UniqueConstraint("scope", "period", "enforcement"),)
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("orgs.id"), index=True)
    project_id: Mapped[str | None] = mapped_column(ForeignKey("projects.id"))
    user_id: Mapped[str | None] = mapped_column(ForeignKey("users.id"))
    level: Mapped[str] = mapped_column(String(10))
    #: ``org:<id>``, ``project:<id>`` or ``user:<id>``: the spend counters' key.
    scope: Mapped[str] = mapped_column(String(60))
    period: Mapped[str] = mapped_column(String(10))
    limit: Mapped[int] = mapped_column(BigInteger)
    enforcement: Mapped[str] = mapped_column(String(10))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class SpendCounter(Base):
    """Spent plus held per scope and calendar period, kept as holds come and go."""

    __tablename__ = "credit_spend"
    scope: Mapped[str] = mapped_column(String(60), primary_key=True)
    period: Mapped[str] = mapped_column(String(20), primary_key=True)
    amount: Mapped[int] = mapped_column(BigInteger)


class CreditAudit(Base):
    """An immutable record of every credit decision: who, which request, before, after."""

    __tablename__ = "credit_audit"
    __table_args__ = (
        Index("ix_credit_audit_tenant", "org_id", "project_id", "created_at"),
        Index("ix_credit_audit_wallet", "wallet_id", "created_at"),
    )
    id: Mapped[int] = mapped_column(_SERIAL, primary_key=True)
    org_id: Mapped[str] = mapped_column(String(40))
    project_id: Mapped[str | None] = mapped_column(String(40))
    wallet_id: Mapped[str | None] = mapped_column(String(40))
    actor: Mapped[str] = mapped_column(String(60))
    request_id: Mapped[str | None] = mapped_column(String(100))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(40))
    subject_id: Mapped[str] = mapped_column(String(100))
    before: Mapped[dict[str, Any] | None]
    after: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]
