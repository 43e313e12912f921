"""Engines and sessions for SQLite (embedded) and PostgreSQL (production).

On SQLite, writers open their transaction with ``BEGIN IMMEDIATE`` so two writers
never deadlock upgrading a read lock; readers use plain ``BEGIN`` under WAL.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

WRITE = {"nbfleet_write": True}


def make_engine(url: str) -> Engine:
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        _configure_sqlite(engine)
        return engine
    return create_engine(url, pool_size=10, max_overflow=40, pool_pre_ping=True)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("nbfleet_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def rows_affected(result: Any) -> int:
    """Rows an UPDATE or DELETE touched (0 where the driver cannot tell)."""
    return int(getattr(result, "rowcount", 0) or 0)


class Database:
    """Owns the engine and hands out short transactions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def transaction(self, write: bool = True) -> Iterator[Session]:
        """A session inside one transaction, committed on success."""
        with self._sessions() as session, session.begin():
            session.connection(execution_options=WRITE if write else {})
            yield session

    def now(self, session: Session) -> datetime:
        """The DB clock: the only clock used for leases and expiry."""
        if self.is_sqlite:
            raw = session.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
            return datetime.fromisoformat(raw).replace(tzinfo=UTC)
        value: datetime = session.execute(text("SELECT clock_timestamp()")).scalar_one()
        return value.astimezone(UTC)

    def dispose(self) -> None:
        self.engine.dispose()
