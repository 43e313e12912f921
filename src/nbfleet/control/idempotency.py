"""Stripe-style ``Idempotency-Key`` handling for mutating POSTs.

Phase 1 claims the key in its own short transaction. Phase 2 runs the action and
stores its response in the *same* transaction as the action's writes, so a crash
either leaves no effect (the claim lapses and a retry runs it) or leaves an effect
whose response is replayed. A repeat replays the response; the same key with a
different request is 422; a request racing an unfinished one is 409.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nbfleet.db.engine import Database
from nbfleet.db.tables import IdempotencyKey
from nbfleet.model.errors import Conflict, DomainError, InvalidInput

CLAIM_TTL = timedelta(seconds=30)
MAX_KEY_LENGTH = 255

Outcome = tuple[int, dict[str, Any]]


def request_fingerprint(method: str, path: str, body: Any) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{method} {path}\n{canonical}".encode()).hexdigest()


def run_idempotent(
    db: Database,
    owner_id: str,
    key: str | None,
    fingerprint: str,
    action: Callable[[Session], Outcome],
) -> tuple[Outcome, bool]:
    """Run ``action`` at most once per key. Returns (outcome, replayed)."""
    if key is None:
        with db.transaction() as session:
            return action(session), False
    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidInput("Idempotency-Key must be 1 to 255 characters")
    stored = _claim(db, owner_id, key, fingerprint)
    if stored is not None:
        return stored, True
    try:
        with db.transaction() as session:
            outcome = action(session)
            _record(session, owner_id, key, outcome)
        return outcome, False
    except DomainError as exc:
        if exc.status >= 500:  # transient: a retry must be able to run it again
            _release(db, owner_id, key)
            raise
        # A refusal is an answer too: store it so a retry gets the same one.
        outcome = (exc.status, {"title": exc.title, "detail": exc.detail, **exc.extra})
        with db.transaction() as session:
            _record(session, owner_id, key, outcome)
        raise
    except BaseException:
        _release(db, owner_id, key)
        raise


def _release(db: Database, owner_id: str, key: str) -> None:
    """Drop an unfinished claim, so a retry runs the action again."""
    with db.transaction() as session:
        row = session.get(IdempotencyKey, (owner_id, key), with_for_update=True)
        if row is not None and row.status_code is None:
            session.delete(row)


def _claim(db: Database, owner_id: str, key: str, fingerprint: str) -> Outcome | None:
    try:
        with db.transaction() as session:
            now = db.now(session)
            row = session.get(IdempotencyKey, (owner_id, key), with_for_update=True)
            if row is None:
                session.add(IdempotencyKey(owner_id=owner_id, key=key, request_hash=fingerprint,
                                           locked_until=now + CLAIM_TTL, created_at=now))
                return None
            if row.request_hash != fingerprint:
                raise InvalidInput(
                    "Idempotency-Key was already used with a different request",
                    idempotency_key=key,
                )
            if row.status_code is not None:
                return row.status_code, row.response or {}
            if row.locked_until > now:
                raise Conflict("a request with this Idempotency-Key is still in progress",
                               idempotency_key=key)
            row.locked_until = now + CLAIM_TTL  # its first holder died: take over
            return None
    except IntegrityError:
        # Lost an insert race on PostgreSQL: the winner's claim is now visible.
        return _claim(db, owner_id, key, fingerprint)


def _record(session: Session, owner_id: str, key: str, outcome: Outcome) -> None:
    row = session.get(IdempotencyKey, (owner_id, key), with_for_update=True)
    if row is not None:
        row.status_code, row.response = outcome
