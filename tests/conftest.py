"""Shared fixtures: a database per test or module (SQLite, or PostgreSQL when
``NBFLEET_TEST_PG`` is set) and running nbfleet clusters."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbfleet.db.engine import Database
from nbfleet.db.migrate import upgrade
from tests.support.cluster import Cluster

PG_ADMIN_URL = os.environ.get("NBFLEET_TEST_PG")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests cover the pure layers (their few DB tests use SQLite on purpose),
    so they are the same on either database: the PostgreSQL pass (``-m "not
    no_db"``) skips them."""
    unit = Path(__file__).parent / "unit"
    for item in items:
        if unit in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.no_db)


@contextlib.contextmanager
def fresh_database(directory: Path) -> Iterator[str]:
    """A new, empty database, dropped afterwards."""
    if not PG_ADMIN_URL:
        yield f"sqlite:///{directory / 'nbfleet.db'}"
        return
    import psycopg

    name = f"nbf_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def running_cluster(root: Path, control_args: tuple[str, ...] = (), warm_pool: int = 0,
                    agent_env: dict[str, str] | None = None,
                    agent_args: tuple[str, ...] = ()) -> Iterator[Cluster]:
    with fresh_database(root) as url:
        cluster = Cluster(root, url)
        try:
            cluster.start_control(args=control_args)
            cluster.start_agent(env=agent_env, warm_pool=warm_pool, args=agent_args)
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def db_url(tmp_path: Path) -> Iterator[str]:
    with fresh_database(tmp_path) as url:
        yield url


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """A migrated database (SQLite, or PostgreSQL with NBFLEET_TEST_PG)."""
    database = Database(db_url)
    upgrade(database.engine)
    yield database
    database.dispose()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A private control plane + agent, for tests that kill or restart processes."""
    with running_cluster(tmp_path) as running:
        yield running


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One control plane + agent shared by a module's non-destructive tests."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running
