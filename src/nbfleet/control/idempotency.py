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
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nbfleet.db.bulk import insert_rows, update_rows
from nbfleet.db.engine import Database
from nbfleet.db.tables import IdempotencyKey
from nbfleet.model.errors import Conflict, DomainError, InvalidInput

CLAIM_TTL = timedelta(seconds=30)
MAX_KEY_LENGTH = 255
IN_PROGRESS = "a request with this Idempotency-Key is still in progress"

Outcome = tuple[int, dict[str, Any]]


def request_fingerprint(method: str, path: str, body: Any) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{method} {path}\n{canonical}".encode()).hexdigest()


def refusal(error: DomainError) -> Outcome:
    """A refusal as an outcome: an answer too, stored so a retry gets it again."""
    return error.status, {"title": error.title, "detail": error.detail, **error.extra}


def check_key(key: str | None) -> None:
    if key is not None and (not key or len(key) > MAX_KEY_LENGTH):
        raise InvalidInput("Idempotency-Key must be 1 to 255 characters")


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
    check_key(key)
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
        outcome = refusal(exc)
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
            return _against(row, fingerprint, now)
    except IntegrityError:
        # Lost an insert race on PostgreSQL: the winner's claim is now visible.
        return _claim(db, owner_id, key, fingerprint)


def _against(row: IdempotencyKey, fingerprint: str, now: datetime) -> Outcome | None:
    """What a request finds under a key claimed before: the stored outcome to replay,
    None once it took over a claim whose holder died, or the error it gets."""
    if row.request_hash != fingerprint:
        raise InvalidInput("Idempotency-Key was already used with a different request",
                           idempotency_key=row.key)
    if row.status_code is not None:
        return row.status_code, row.response or {}
    if row.locked_until > now:
        raise Conflict(IN_PROGRESS, idempotency_key=row.key)
    row.locked_until = now + CLAIM_TTL  # its first holder died: take over
    return None


Claimed = Outcome | DomainError | None


def claim_many(session: Session, claims: Sequence[tuple[str, str, str]], now: datetime
               ) -> list[Claimed]:
    """Claim (owner, key, fingerprint) for each request of a batch whose action and
    stored outcome share the caller's transaction: None where the request is to
    run, the stored outcome to replay, or its error (422 for another request
    under the key, 409 while another holds it, the batch's own duplicates too).
    ``record_many`` stores the outcomes before the commit."""
    if not claims:
        return []
    # A racing claim of the same key in another transaction makes this wait for
    # that one's end; then the row is there to read.
    won = set(insert_rows(
        session, IdempotencyKey.__table__,  # type: ignore[arg-type]
        [{"owner_id": owner, "key": key, "request_hash": fingerprint,
          "locked_until": now + CLAIM_TTL, "created_at": now}
         for owner, key, fingerprint in sorted(claims)],  # one lock order for every batch
        skip_conflicts_on=["owner_id", "key"], returning=["owner_id", "key"]))
    lost = {(owner, key) for owner, key, _ in claims} - won
    rows = {(row.owner_id, row.key): row for row in session.execute(
        select(IdempotencyKey).where(tuple_(IdempotencyKey.owner_id, IdempotencyKey.key)
                                     .in_(sorted(lost)))
        .with_for_update().execution_options(populate_existing=True)).scalars()} if lost else {}
    outcomes: list[Claimed] = []
    running: set[tuple[str, str]] = set()
    for owner, key, fingerprint in claims:
        if (owner, key) in running:  # a second request under a key this batch claimed
            outcomes.append(Conflict(IN_PROGRESS, idempotency_key=key))
        elif (owner, key) in won:
            running.add((owner, key))
            outcomes.append(None)
        else:
            try:
                outcomes.append(_against(rows[owner, key], fingerprint, now))
            except DomainError as exc:
                outcomes.append(exc)
    return outcomes


def record_many(session: Session, outcomes: Sequence[tuple[str, str, Outcome]]) -> None:
    """Store the outcomes of claimed keys (owner, key, outcome), in one statement."""
    update_rows(session, IdempotencyKey.__table__,  # type: ignore[arg-type]
                ["owner_id", "key"],
                [{"owner_id": owner, "key": key, "status_code": status, "response": response}
                 for owner, key, (status, response) in outcomes])


def _record(session: Session, owner_id: str, key: str, outcome: Outcome) -> None:
    row = session.get(IdempotencyKey, (owner_id, key), with_for_update=True)
    if row is not None:
        row.status_code, row.response = outcome
