"""The web dashboard's page latency with 10,000 workspaces in one org.

What it measures: each dashboard page, fetched by a signed-in browser session
(cookies, as a browser sends them) from a real ``nbfleet control`` process on a
throwaway database (SQLite, and PostgreSQL with ``--pg`` or ``NBFLEET_TEST_PG``).
The database is filled directly: ``--workspaces`` workspaces (one event each) in
one org and project, ``--other`` in a second org (so the tenant filter matters and
an admin's list spans both), ``--jobs`` finished jobs, ``--grants`` credit grants
and a budget. Pages are fetched in turn, the order rotated each round, ``--requests``
times each after ``--warmup`` rounds: ``<db>_<page>_median_ms`` and ``_p95_ms``.
Baselines in the same run: ``GET /healthz`` (the HTTP floor) and the REST list the
home page mirrors (``GET /v1/workspaces?limit=50``, by token):
``<db>_<page>_vs_rest_list`` is the page's median over the REST list's. Finally
the plan the database picks for the list's query (captured from the dashboard's own
``list_page``): ``<db>_list_uses_tenant_index`` is 1 when it is a range scan of
``ix_workspaces_tenant``. Target: every page's median under 200 ms.

    .venv/bin/python bench/dashboard.py [--pg [--pg-url URL]] [--requests 50]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, insert

from harness import emit, free_port, healthy, percentile, stderr, throwaway_db, wait_for
from nbfleet.control import tenancy
from nbfleet.control.auth import Principal
from nbfleet.control.dashboard.workspace_pages import list_page
from nbfleet.db.engine import Database
from nbfleet.db.ids import new_id
from nbfleet.db.job_tables import Job
from nbfleet.db.tables import User, Workspace, WorkspaceEvent
from nbfleet.ledger import audit, budgets, grants, wallets
from nbfleet.model.credits import Enforcement, GrantKind, Period

BENCH = "dashboard"
TARGET_MS = 200.0
PG_DEFAULT = os.environ.get("NBFLEET_TEST_PG") or "postgresql://postgres@127.0.0.1:5432/postgres"
CHUNK = 1000


# ------------------------------------------------------------------- the data
def principal_of(db: Database, user_id: str) -> Principal:
    with db.transaction(write=False) as session:
        user = session.get(User, user_id)
        assert user is not None
        return Principal(user.id, user.org_id, user.project_id, user.is_admin)


def add_workspaces(db: Database, owner: Principal, count: int) -> list[str]:
    """``count`` suspended workspaces (nothing for the reconciler to do), one event each."""
    ids: list[str] = []
    for start in range(0, count, CHUNK):
        with db.transaction() as session:
            now = db.now(session)
            rows = [{"id": new_id("ws"), "org_id": owner.org_id, "project_id": owner.project_id,
                     "owner_id": owner.user_id, "name": f"notebook-{start + n:05d}",
                     "state": "suspended", "desired_state": "suspended", "generation": 2,
                     "pending": False, "attempts": 0,
                     "resources": {"millicpus": 0, "memory_mb": 0, "gpus": (start + n) % 2,
                                   "vram_gb": 0, "gpu_types": []},
                     "created_at": now, "updated_at": now}
                    for n in range(min(CHUNK, count - start))]
            session.execute(insert(Workspace), rows)
            session.execute(insert(WorkspaceEvent), [
                {"workspace_id": row["id"], "from_state": "running", "to_state": "suspended",
                 "reason": "idle", "created_at": now} for row in rows])
            ids += [str(row["id"]) for row in rows]
    return sorted(ids)


def add_jobs(db: Database, owner: Principal, count: int) -> list[str]:
    """``count`` cancelled jobs (the dispatcher leaves them alone)."""
    ids: list[str] = []
    for start in range(0, count, CHUNK):
        with db.transaction() as session:
            now = db.now(session)
            rows = [{"id": new_id("job"), "org_id": owner.org_id, "project_id": owner.project_id,
                     "owner_id": owner.user_id, "name": f"render-{start + n}",
                     "binary": "videogen", "version": "1.0", "pinned": False,
                     "args": {"seed": n}, "gpus": 1, "gpu_types": [], "vram_gb": 0,
                     "memory_mb": 0, "timeout_s": 3600, "idle_timeout_s": 300,
                     "max_attempts": 3, "tier": "free", "priority": 0, "preemptible": False,
                     "state": "cancelled", "attempt": 0, "max_rate": 0,
                     "max_rate_type": "default", "avoid_hosts": [], "cancel_requested": True,
                     "preempt_requested": False, "quarantined": False,
                     "fingerprint": uuid.uuid4().hex, "created_at": now, "updated_at": now}
                    for n in range(min(CHUNK, count - start))]
            session.execute(insert(Job), rows)
            ids += [str(row["id"]) for row in rows]
    return sorted(ids)


def add_credits(db: Database, org: str, project: str, count: int) -> None:
    actor = audit.Actor("bench")
    with db.transaction() as session:
        now = db.now(session)
        owner = wallets.owner_by_names(session, org, project)
        for n in range(count):
            grants.issue(session, owner, grants.GrantRequest(
                GrantKind.PROMO if n % 3 == 0 else GrantKind.PURCHASE, 1_000_000 + n), actor, now)
        target = budgets.target_by_names(session, org, project, None)
        budgets.create(session, target, Period.MONTH, 10**12, Enforcement.SOFT, actor, now)


# ------------------------------------------------------------------ the plans
def list_plan(db: Database, principal: Principal, after: str) -> tuple[bool, str]:
    """The database's plan for the list's query, as ``list_page`` sends it."""
    seen: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any,
                _many: bool) -> None:
        if "FROM workspaces" in statement:
            seen.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", capture)
    try:
        with db.transaction(write=False) as session:
            list_page(session, principal, after, None)
    finally:
        event.remove(db.engine, "before_cursor_execute", capture)
    statement, parameters = seen[-1]
    explain = "EXPLAIN QUERY PLAN " if db.is_sqlite else "EXPLAIN "
    with db.engine.connect() as conn:
        rows = conn.exec_driver_sql(explain + statement, parameters).all()
    plan = "\n".join(" ".join(str(part) for part in row) for row in rows)
    return "ix_workspaces_tenant" in plan, plan


# ------------------------------------------------------------ the control plane
@contextlib.contextmanager
def control_plane(db_url: str, home: Path) -> Iterator[str]:
    """``nbfleet control`` on a free port, without rate limits; yields its URL."""
    home.mkdir(parents=True, exist_ok=True)
    secret = home / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(uuid.uuid4().hex + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_HOME"] = str(home)
    log = home / "control.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbfleet.cli.main", "control", "--db", db_url, "--blobs",
             str(home / "blobs"), "--port", str(port), "--secret-file", str(secret),
             "--rate-limit", "0", "--prewarm", "0", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(lambda: healthy(url), proc, "the control plane")
        yield url
    except BaseException:
        stderr.print(f"control log ({log}):\n{log.read_text(errors='replace')[-3000:]}",
                     markup=False, highlight=False)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def browser(url: str, token: str) -> Iterator[httpx.Client]:
    """A client signed in through the sign-in form, holding the session cookies."""
    with httpx.Client(base_url=url, timeout=60.0, follow_redirects=False) as client:
        page = client.get("/ui/login")
        found = re.search(r'name="_xsrf" value="([^"]+)"', page.text)
        assert found is not None, page.text
        signed = client.post("/ui/login", data={"_xsrf": found.group(1), "token": token})
        assert signed.status_code == 303, signed.text
        yield client


# ---------------------------------------------------------------------- main
def run(kind: str, args: argparse.Namespace, tmp: Path) -> None:
    with throwaway_db(kind, args.pg_url, tmp / kind, "dashboard") as db:
        started = time.monotonic()
        user = tenancy.create_user(db, "bench", "big", "main")
        other = tenancy.create_user(db, "neighbour", "other", "main")
        admin = tenancy.create_user(db, "root", "system", "default", is_admin=True)
        me = principal_of(db, user.user_id)
        ids = add_workspaces(db, me, args.workspaces)
        add_workspaces(db, principal_of(db, other.user_id), args.other)
        jobs = add_jobs(db, me, args.jobs)
        add_credits(db, "big", "main", args.grants)
        stderr.print(f"{kind}: filled in {time.monotonic() - started:.1f} s "
                     f"({len(ids)} + {args.other} workspaces, {len(jobs)} jobs)")
        middle = ids[len(ids) // 2]
        uses_index, plan = list_plan(db, me, middle)
        stderr.print(f"{kind}: the list's plan:\n{plan}", markup=False, highlight=False)
        emit(BENCH, f"{kind}_workspaces_in_org", len(ids))
        emit(BENCH, f"{kind}_list_uses_tenant_index", 1 if uses_index else 0)
        with control_plane(db.url, tmp / f"{kind}-home") as url, \
                browser(url, user.token) as mine, browser(url, admin.token) as boss, \
                httpx.Client(base_url=url, timeout=60.0) as rest:
            rest.headers["Authorization"] = f"Bearer {user.token}"
            cases: list[tuple[str, httpx.Client, str]] = [
                ("healthz", rest, "/healthz"),
                ("rest_list", rest, "/v1/workspaces?limit=50"),
                ("home", mine, "/"),
                ("home_page_100", mine, f"/?after={middle}"),
                ("poll", mine, f"/ui/api/workspaces?after={middle}"),
                ("workspace", mine, f"/ui/workspaces/{middle}"),
                ("new_workspace", mine, "/ui/workspaces/new"),
                ("jobs", mine, "/ui/jobs"),
                ("jobs_deep", mine, f"/ui/jobs?before={jobs[len(jobs) // 2]}"
                 if jobs else "/ui/jobs"),
                ("credits", mine, "/ui/credits"),
                ("admin_home", boss, "/"),
                ("admin_fleet", boss, "/ui/admin/fleet"),
                ("admin_users", boss, "/ui/admin/users"),
                ("admin_orgs", boss, "/ui/admin/orgs"),
                ("admin_grants", boss, "/ui/admin/grants"),
            ]
            timings: dict[str, list[float]] = {name: [] for name, _, _ in cases}
            for round_ in range(args.warmup + args.requests):
                shift = round_ % len(cases)
                for name, client, path in cases[shift:] + cases[:shift]:
                    began = time.perf_counter()
                    response = client.get(path)
                    elapsed = (time.perf_counter() - began) * 1000
                    if response.status_code != 200:
                        raise RuntimeError(f"{path}: {response.status_code} "
                                           f"{response.text[:300]}")
                    if round_ >= args.warmup:
                        timings[name].append(elapsed)
        baseline = percentile(timings["rest_list"], 50)
        worst = ("", 0.0)
        for name, values in timings.items():
            median = percentile(values, 50)
            emit(BENCH, f"{kind}_{name}_median_ms", median)
            emit(BENCH, f"{kind}_{name}_p95_ms", percentile(values, 95))
            if name not in ("healthz", "rest_list"):
                emit(BENCH, f"{kind}_{name}_vs_rest_list", median / baseline)
                worst = max(worst, (name, median), key=lambda pair: pair[1])
        verdict = "meets" if worst[1] < TARGET_MS else "MISSES"
        stderr.print(f"{kind}: slowest page {worst[0]} at {worst[1]:.1f} ms median "
                     f"({verdict} the {TARGET_MS:.0f} ms target); REST list {baseline:.1f} ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Dashboard page latency with 10,000 workspaces in one org. Prints one "
                    "JSON line per figure.")
    parser.add_argument("--workspaces", type=int, default=10_000,
                        help="workspaces in the measured org (default: %(default)s)")
    parser.add_argument("--other", type=int, default=2000,
                        help="workspaces in another org (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2000, help="(default: %(default)s)")
    parser.add_argument("--grants", type=int, default=100, help="(default: %(default)s)")
    parser.add_argument("--requests", type=int, default=50,
                        help="timed requests per page (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--pg", action="store_true",
                        help="PostgreSQL as well (implied by NBFLEET_TEST_PG)")
    parser.add_argument("--pg-only", action="store_true", help="PostgreSQL only")
    parser.add_argument("--pg-url", default=PG_DEFAULT,
                        help="an admin URL of the PostgreSQL server; a throwaway database is "
                             "created and dropped (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = ["postgres"] if args.pg_only else (
        ["sqlite", "postgres"] if args.pg or os.environ.get("NBFLEET_TEST_PG") else ["sqlite"])
    with tempfile.TemporaryDirectory(prefix="nbf-bench-dashboard-") as tmp:
        for kind in kinds:
            run(kind, args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
