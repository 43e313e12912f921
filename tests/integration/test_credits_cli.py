"""``nbfleet credit`` through the real CLI against a live control plane."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from nbfleet.db.engine import Database
from tests.support.cluster import NBFLEET, Cluster
from tests.support.credit_api import control_only, new_tenant, verified


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_only(tmp_path_factory.mktemp("credits-cli")) as running:
        yield running


def nbfleet(cluster: Cluster, token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_URL"] = cluster.url
    env["NBFLEET_HOME"] = "/nonexistent-home"
    env["COLUMNS"] = "250"
    if token:
        env["NBFLEET_TOKEN"] = token
    return subprocess.run([*NBFLEET, *args], env=env, capture_output=True, text=True, timeout=120)


def test_grant_balance_budget_and_verify(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    admin = cluster.admin_token
    granted = nbfleet(cluster, admin, "credit", "grant", tenant.org, "--project", tenant.project,
                      "--amount", "2.5", "--kind", "promo", "--memo", "from the CLI")
    assert granted.returncode == 0, granted.stderr
    body = json.loads(granted.stdout)
    assert (body["amount"], body["kind"], body["memo"]) == (2_500_000, "promo", "from the CLI")
    paid = nbfleet(cluster, admin, "credit", "grant", tenant.org, "--project", tenant.project,
                   "--amount", "10", "--kind", "purchase", "--idempotency-key", "cli-grant")
    assert paid.returncode == 0, paid.stderr
    replay = nbfleet(cluster, admin, "credit", "grant", tenant.org, "--project", tenant.project,
                     "--amount", "10", "--kind", "purchase", "--idempotency-key", "cli-grant")
    assert json.loads(replay.stdout)["id"] == json.loads(paid.stdout)["id"]

    token = tenant.client.headers["Authorization"].split()[1]
    table = nbfleet(cluster, token, "credit", "balance")
    assert table.returncode == 0, table.stderr
    assert "12.5" in table.stdout and "promo" in table.stdout and "paid" in table.stdout
    raw = json.loads(nbfleet(cluster, token, "credit", "balance", "--json").stdout)
    assert (raw["available"], raw["promo"]["available"]) == (12_500_000, 2_500_000)

    budget = nbfleet(cluster, admin, "credit", "budget", "set", tenant.org, "--project",
                     tenant.project, "--period", "day", "--limit", "1.5")
    assert budget.returncode == 0, budget.stderr
    made = json.loads(budget.stdout)
    assert (made["limit"], made["enforcement"], made["level"]) == (1_500_000, "hard", "project")
    listed = json.loads(nbfleet(cluster, token, "credit", "budget", "list").stdout)
    assert [b["id"] for b in listed["items"]] == [made["id"]]
    updated = nbfleet(cluster, admin, "credit", "budget", "update", made["id"], "--limit", "3")
    assert json.loads(updated.stdout)["limit"] == 3_000_000
    ledger = json.loads(nbfleet(cluster, token, "credit", "ledger", "--limit", "2").stdout)
    assert len(ledger["items"]) == 2 and ledger["next"] is not None

    checked = nbfleet(cluster, None, "credit", "verify", "--db", cluster.db_url)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok" in checked.stdout and f"project:{tenant.project_id}" in checked.stdout
    assert nbfleet(cluster, admin, "credit", "budget", "delete", made["id"]).returncode == 0


def test_bad_amounts_exit_2_with_a_message(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    for amount, message in (("1.2345678", "more than 6 decimals"), ("ten", "not a number"),
                            ("-1", "must be positive"), ("0", "must be positive"),
                            ("NaN", "not a number")):
        result = nbfleet(cluster, cluster.admin_token, "credit", "grant", tenant.org,
                         "--amount", amount)
        assert result.returncode == 2, (amount, result.stdout, result.stderr)
        assert message in result.stderr, (amount, result.stderr)
        assert "Traceback" not in result.stderr
    denied = nbfleet(cluster, tenant.client.headers["Authorization"].split()[1], "credit",
                     "grant", tenant.org, "--amount", "1")
    assert denied.returncode == 1 and "error 404" in denied.stderr


def test_verify_names_a_tampered_bucket(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    granted = nbfleet(cluster, cluster.admin_token, "credit", "grant", tenant.org,
                      "--project", tenant.project, "--amount", "1")
    bucket_id = json.loads(granted.stdout)["id"]
    db = Database(cluster.db_url)
    tamper = ("UPDATE credit_buckets SET available = available {} 1, consumed = consumed {} 1 "
              "WHERE id = :id")
    try:
        with db.transaction() as session:
            session.execute(text(tamper.format("-", "+")), {"id": bucket_id})
        result = nbfleet(cluster, None, "credit", "verify", "--db", cluster.db_url)
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"bucket {bucket_id} available" in result.stderr
        assert f"bucket {bucket_id} consumed" in result.stderr
        as_json = json.loads(nbfleet(cluster, None, "credit", "verify", "--db", cluster.db_url,
                                     "--json").stdout)
        assert as_json["ok"] is False and len(as_json["mismatches"]) == 2
    finally:
        with db.transaction() as session:
            session.execute(text(tamper.format("+", "-")), {"id": bucket_id})
        db.dispose()
    verified(cluster)
    assert nbfleet(cluster, None, "credit", "verify", "--db", cluster.db_url).returncode == 0


def test_credit_help_lists_the_commands() -> None:
    result = subprocess.run([*NBFLEET, "credit", "--help"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0
    for command in ("grant", "balance", "ledger", "audit", "budget", "hold", "verify"):
        assert command in result.stdout
