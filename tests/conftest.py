"""Shared fixtures: a database per test or module (SQLite, or PostgreSQL when
``NBFLEET_TEST_PG`` is set) and running nbfleet clusters."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from nbfleet.db.engine import Database
from nbfleet.db.migrate import upgrade
from tests.support.cluster import Cluster, log_tails

PG_ADMIN_URL = os.environ.get("NBFLEET_TEST_PG")


#: Modules whose tests use the database only on the way to what they test (kernels,
#: the sandbox, file sync, the Jupyter protocols, clients, the CLI): their SQL is
#: the same few reads and writes every other test covers, so the PostgreSQL pass
#: skips them (``db_agnostic``). What stays there tests what the database decides:
#: the ledger, jobs, leases and crashes, idempotency, tenancy queries, the GPU
#: scheduler's persisted placements, the dashboard's keyset pages, sessions, and the
#: API fuzz (PostgreSQL refuses what SQLite takes: NUL bytes in text, big integers).
DB_AGNOSTIC_MODULES = frozenset({
    "test_kernel_process", "test_kernel_state", "test_suspend_resume",
    "test_unstorable_values", "test_egress", "test_files", "test_uploads", "test_secrets",
    "test_metrics", "test_smoke", "test_embedded", "test_cli", "test_cli_output",
    "test_api_docs", "test_file_sync", "test_jupyter_protocol", "test_lab_server",
    "test_kernel_identity", "test_gateway", "test_cell_bindings_agent", "test_job_runner",
    "test_quotas", "test_kernel_escape", "test_blobs_s3", "test_two_fleets_one_machine",
    "test_hosts_apart", "test_resume_speed_paths", "test_snapshot_collection",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests cover the pure layers (their few DB tests use SQLite on purpose),
    so they are the same on either database: the PostgreSQL pass (``-m "not
    no_db"``) skips them. End-to-end tests drive clients and the modules in
    ``DB_AGNOSTIC_MODULES`` do not test the database: that pass skips them too."""
    here = Path(__file__).parent
    unit, e2e = here / "unit", here / "e2e"
    for item in items:
        path = Path(str(item.fspath))
        if unit in path.parents:
            item.add_marker(pytest.mark.no_db)
        elif e2e in path.parents or path.stem in DB_AGNOSTIC_MODULES:
            item.add_marker(pytest.mark.db_agnostic)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A failing test that ran clusters shows the end of their logs: a CI run
    keeps nothing else of them, and a flaky failure may not come back."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        since = getattr(item, "_nbfleet_started", call.start)
        for name, tail in log_tails(since):
            report.sections.append((f"cluster log {name}", tail))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item._nbfleet_started = time.time()  # type: ignore[attr-defined]


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
