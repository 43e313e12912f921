"""A control plane for the credits API tests, and shortcuts into its database."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from nbfleet.db.credit_tables import CreditHold, LedgerEntry
from nbfleet.db.engine import Database
from nbfleet.db.tables import Org, Project, User
from nbfleet.ledger import verify
from tests.support.cluster import Cluster

CREDIT = 1_000_000


@contextlib.contextmanager
def control_only(root: Path, reap_interval: float = 0.2) -> Iterator[Cluster]:
    """A control plane alone (no agent: the credits API needs none), unlimited rate."""
    from tests.conftest import fresh_database

    with fresh_database(root) as url:
        cluster = Cluster(root, url)
        try:
            cluster.start_control(args=("--rate-limit", "0", "--credit-reap-interval",
                                        str(reap_interval)))
            yield cluster
        finally:
            cluster.stop()


def key() -> dict[str, str]:
    return {"Idempotency-Key": str(uuid.uuid4())}


def internal(cluster: Cluster) -> httpx.Client:
    """A client authenticated by the cluster secret, as the scheduler would be."""
    return cluster.client((cluster.home / "cluster-secret").read_text().strip())


@dataclass
class Tenant:
    org: str
    project: str
    user: str
    client: httpx.Client
    org_id: str
    project_id: str
    user_id: str

    def hold_body(self, work_id: str, amount: int, **extra: Any) -> dict[str, Any]:
        return {"work_id": work_id, "org_id": self.org_id, "project_id": self.project_id,
                "user_id": self.user_id, "gpu_type": "A100-80GB",
                "rate_per_gpu_hour": 3_600_000, "amount": amount, **extra}


def new_tenant(cluster: Cluster, org: str | None = None, project: str = "p") -> Tenant:
    """A user in a fresh org (or the given one), with the ids the holds API needs."""
    org = org or f"org-{uuid.uuid4().hex[:8]}"
    user = f"u-{uuid.uuid4().hex[:8]}"
    client = cluster.new_user(org=org, project=project, name=user)
    db = Database(cluster.db_url)
    try:
        with db.transaction(write=False) as session:
            row = session.execute(
                select(User.id, Org.id, Project.id)
                .join(Org, Org.id == User.org_id).join(Project, Project.id == User.project_id)
                .where(Org.name == org, User.name == user)).one()
    finally:
        db.dispose()
    return Tenant(org, project, user, client, row[1], row[2], row[0])


def grant(cluster: Cluster, tenant: Tenant, amount: int, project: bool = True,
          **extra: Any) -> dict[str, Any]:
    body = {"org": tenant.org, "project": tenant.project if project else None,
            "kind": "purchase", "amount": amount, **extra}
    response = cluster.admin().post("/v1/credits/grants", json=body, headers=key())
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


def query(cluster: Cluster, statement: Any) -> list[Any]:
    db = Database(cluster.db_url)
    try:
        with db.transaction(write=False) as session:
            return list(session.execute(statement).all())
    finally:
        db.dispose()


def verified(cluster: Cluster) -> verify.Report:
    db = Database(cluster.db_url)
    try:
        # One snapshot (REPEATABLE READ on PostgreSQL), as `nbfleet credit verify`
        # reads it: statement by statement, a cell's hold settling between two of
        # them showed as a mismatch that never existed.
        report = verify.verify_db(db)
    finally:
        db.dispose()
    assert report.ok, report.mismatches
    return report


def holds_of(cluster: Cluster, tenant: Tenant) -> list[str]:
    return [row[0] for row in query(cluster, select(CreditHold.id).where(
        CreditHold.project_id == tenant.project_id))]


def release_txns(cluster: Cluster, hold_id: str) -> int:
    return int(query(cluster, select(func.count(func.distinct(LedgerEntry.txn_id))).where(
        LedgerEntry.hold_id == hold_id, LedgerEntry.kind == "release"))[0][0])
