"""run_idempotent on a real SQLite database: replay, mismatch, races, failures."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from nbfleet.control import idempotency
from nbfleet.control.idempotency import request_fingerprint, run_idempotent
from nbfleet.db.engine import Database
from nbfleet.db.migrate import upgrade
from nbfleet.db.tables import IdempotencyKey
from nbfleet.model.errors import Conflict, InvalidInput, Unavailable


@pytest.fixture
def db(tmp_path: Path) -> Database:
    database = Database(f"sqlite:///{tmp_path / 'idem.db'}")
    upgrade(database.engine)
    return database


def counting_action(calls: list[int], outcome: tuple[int, dict[str, object]] = (201, {"id": 1})):  # type: ignore[no-untyped-def]
    def action(_session: Session) -> tuple[int, dict[str, object]]:
        calls.append(1)
        return outcome

    return action


def test_replays_without_running_again(db: Database) -> None:
    calls: list[int] = []
    fingerprint = request_fingerprint("POST", "/v1/x", {"a": 1})
    first = run_idempotent(db, "u1", "k", fingerprint, counting_action(calls))
    again = run_idempotent(db, "u1", "k", fingerprint, counting_action(calls))
    assert first == ((201, {"id": 1}), False)
    assert again == ((201, {"id": 1}), True)
    assert len(calls) == 1


def test_same_key_other_request_is_422(db: Database) -> None:
    run_idempotent(db, "u1", "k", request_fingerprint("POST", "/v1/x", {"a": 1}),
                   counting_action([]))
    with pytest.raises(InvalidInput, match="different request"):
        run_idempotent(db, "u1", "k", request_fingerprint("POST", "/v1/x", {"a": 2}),
                       counting_action([]))


def test_a_racing_request_is_409_until_the_claim_lapses(db: Database) -> None:
    fingerprint = request_fingerprint("POST", "/v1/x", {})
    assert idempotency._claim(db, "u1", "k", fingerprint) is None  # first request claims
    with pytest.raises(Conflict, match="still in progress"):
        idempotency._claim(db, "u1", "k", fingerprint)  # a racer while it runs
    # The first holder crashed: once its claim lapses, a retry takes over and runs.
    with db.transaction() as session:
        row = session.get(IdempotencyKey, ("u1", "k"))
        assert row is not None
        row.locked_until = db.now(session) - timedelta(seconds=1)
    calls: list[int] = []
    assert run_idempotent(db, "u1", "k", fingerprint, counting_action(calls))[1] is False
    assert len(calls) == 1


def test_transient_failures_can_be_retried_but_refusals_are_replayed(db: Database) -> None:
    fingerprint = request_fingerprint("POST", "/v1/x", {})
    calls: list[int] = []

    def flaky(_session: Session) -> tuple[int, dict[str, object]]:
        calls.append(1)
        if len(calls) == 1:
            raise Unavailable("agent unreachable")
        return 201, {"ok": True}

    with pytest.raises(Unavailable):
        run_idempotent(db, "u1", "retry", fingerprint, flaky)
    assert run_idempotent(db, "u1", "retry", fingerprint, flaky) == ((201, {"ok": True}), False)

    def refuse(_session: Session) -> tuple[int, dict[str, object]]:
        raise Conflict("workspace is deleted", current_state="deleted")

    with pytest.raises(Conflict):
        run_idempotent(db, "u1", "refused", fingerprint, refuse)
    (status, body), replayed = run_idempotent(db, "u1", "refused", fingerprint,
                                              counting_action([]))
    assert (status, body["current_state"], replayed) == (409, "deleted", True)
