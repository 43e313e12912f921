"""Database engine on SQLite: BEGIN IMMEDIATE for writers, DB clock, migrations."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, inspect, text

from nbfleet.db.engine import Database
from nbfleet.db.migrate import upgrade


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "x.db"


@pytest.fixture
def db(db_path: Path) -> Iterator[Database]:
    database = Database("sqlite:///" + str(db_path))
    yield database
    database.dispose()


@pytest.fixture
def statements(db: Database) -> list[str]:
    recorded: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def _record(_conn, _cursor, statement, _params, _context, _many) -> None:  # type: ignore[no-untyped-def]
        recorded.append(statement)

    return recorded


def _other_writer(db_path: Path) -> sqlite3.Connection:
    """A second connection that fails at once instead of waiting for a lock."""
    conn = sqlite3.connect(db_path, timeout=0, isolation_level=None)
    return conn


def test_is_sqlite(db: Database) -> None:
    assert db.is_sqlite


def test_write_transaction_begins_immediate(db: Database, statements: list[str]) -> None:
    with db.transaction() as session:
        session.execute(text("SELECT 1"))
    assert statements[0] == "BEGIN IMMEDIATE"
    assert "BEGIN" not in statements[1:]


def test_read_transaction_begins_plain(db: Database, statements: list[str]) -> None:
    with db.transaction(write=False) as session:
        session.execute(text("SELECT 1"))
    assert statements[0] == "BEGIN"
    assert "BEGIN IMMEDIATE" not in statements


def test_each_transaction_begins_once(db: Database, statements: list[str]) -> None:
    with db.transaction(write=False) as session:
        session.execute(text("SELECT 1"))
    with db.transaction() as session:
        session.execute(text("SELECT 1"))
    begins = [s for s in statements if s.startswith("BEGIN")]
    assert begins == ["BEGIN", "BEGIN IMMEDIATE"]


def test_write_transaction_holds_the_write_lock(db: Database, db_path: Path) -> None:
    with db.transaction() as session:
        session.execute(text("SELECT 1"))
        other = _other_writer(db_path)
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        finally:
            other.close()
    other = _other_writer(db_path)
    try:
        other.execute("BEGIN IMMEDIATE")  # released on commit
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_read_transaction_does_not_block_writers(db: Database, db_path: Path) -> None:
    with db.transaction(write=False) as session:
        session.execute(text("SELECT 1"))
        other = _other_writer(db_path)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
        finally:
            other.close()


def test_connection_pragmas(db: Database) -> None:
    with db.transaction(write=False) as session:
        assert session.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
        assert session.execute(text("PRAGMA foreign_keys")).scalar_one() == 1


def test_commit_on_success_rollback_on_error(db: Database) -> None:
    with db.transaction() as session:
        session.execute(text("CREATE TABLE t (v INTEGER)"))
    with db.transaction() as session:
        session.execute(text("INSERT INTO t VALUES (1)"))
    with pytest.raises(RuntimeError), db.transaction() as session:
        session.execute(text("INSERT INTO t VALUES (2)"))
        raise RuntimeError("abort")
    with db.transaction(write=False) as session:
        assert session.execute(text("SELECT v FROM t")).scalars().all() == [1]


def test_now_is_aware_utc_and_close_to_wall_clock(db: Database) -> None:
    before = datetime.now(UTC)
    with db.transaction(write=False) as session:
        first = db.now(session)
    with db.transaction(write=False) as session:
        second = db.now(session)
    assert isinstance(first, datetime)
    assert first.tzinfo is not None
    assert first.utcoffset() == timedelta(0)
    assert abs(first - before) < timedelta(seconds=5)
    assert second >= first


def test_migrate_upgrade_is_idempotent(db: Database) -> None:
    upgrade(db.engine)
    upgrade(db.engine)
    inspector = inspect(db.engine)
    tables = set(inspector.get_table_names())
    assert {"workspaces", "alembic_version"} <= tables
    columns = {column["name"] for column in inspector.get_columns("workspaces")}
    assert {"id", "state", "desired_state", "attempts"} <= columns
    with db.transaction(write=False) as session:
        versions = session.execute(text("SELECT version_num FROM alembic_version")).all()
    assert len(versions) == 1


def test_migrations_produce_exactly_the_declared_tables(db: Database) -> None:
    """A column added to ``tables.py`` without a migration (or the reverse) fails here."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from nbfleet.db.tables import Base

    upgrade(db.engine)
    with db.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": False})
        differences = compare_metadata(context, Base.metadata)
    assert differences == []
