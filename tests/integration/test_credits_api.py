"""The credits API against a real control plane: grants, balances, the journal, the
audit trail, budgets and a hold's whole life; bad input, replays and tenancy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from nbfleet.db.credit_tables import CreditAudit, CreditBucket
from tests.support.cluster import Cluster
from tests.support.credit_api import (
    CREDIT,
    control_only,
    grant,
    internal,
    key,
    new_tenant,
    query,
    verified,
)

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with control_only(tmp_path_factory.mktemp("credits-api")) as running:
        yield running


def test_grants_are_admin_only(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    body = {"org": tenant.org, "project": tenant.project, "kind": "grant", "amount": CREDIT}
    refused = tenant.client.post("/v1/credits/grants", json=body, headers=key())
    assert refused.status_code == 404
    assert refused.headers["content-type"] == PROBLEM
    assert tenant.client.get("/v1/credits/balance").json()["granted"] == 0

    made = grant(cluster, tenant, 5 * CREDIT, memo="welcome", priority=2)
    assert (made["org"], made["project"], made["amount"], made["available"]) == (
        tenant.org, tenant.project, 5 * CREDIT, 5 * CREDIT)
    assert made["id"].startswith("grt_") and made["memo"] == "welcome"
    assert made["priority"] == 2 and made["kind"] == "purchase"


def test_balance_splits_promo_and_paid_and_lists_expirations(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    soon = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    grant(cluster, tenant, 30 * CREDIT, kind="promo", expires_at=soon)
    grant(cluster, tenant, 70 * CREDIT)
    grant(cluster, tenant, 5 * CREDIT, project=False, kind="grant")
    grant(cluster, tenant, 2 * CREDIT, kind="grant",
          expires_at=(datetime.now(UTC) + timedelta(seconds=1)).isoformat())
    time.sleep(1.5)

    mine = tenant.client.get("/v1/credits/balance").json()
    assert (mine["org"], mine["project"]) == (tenant.org, tenant.project)
    assert mine["available"] == 100 * CREDIT and mine["expired"] == 2 * CREDIT
    assert mine["granted"] == 102 * CREDIT
    assert mine["promo"] == {"available": 30 * CREDIT, "held": 0}
    assert mine["paid"] == {"available": 70 * CREDIT, "held": 0}
    assert [(e["kind"], e["amount"]) for e in mine["upcoming_expirations"]] == [
        ("promo", 30 * CREDIT)]

    shared = tenant.client.get("/v1/credits/balance", params={"scope": "org"}).json()
    assert shared["project"] is None and shared["available"] == 5 * CREDIT
    admin = cluster.admin()
    assert admin.get("/v1/credits/balance").status_code == 422  # admins must name the org
    by_admin = admin.get("/v1/credits/balance",
                         params={"org": tenant.org, "project": tenant.project}).json()
    assert by_admin["available"] == mine["available"]
    assert admin.get("/v1/credits/balance", params={"org": tenant.org}).json()[
        "available"] == 5 * CREDIT


def test_ledger_pages_with_a_cursor(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    for amount in (1, 2, 3):
        grant(cluster, tenant, amount * CREDIT)
    first = tenant.client.get("/v1/credits/ledger", params={"limit": 4}).json()
    assert len(first["items"]) == 4 and first["next"] == first["items"][-1]["id"]
    rest = tenant.client.get("/v1/credits/ledger",
                             params={"limit": 4, "after": first["next"]}).json()
    assert len(rest["items"]) == 2 and rest["next"] is None
    entries = first["items"] + rest["items"]
    assert [e["id"] for e in entries] == sorted(e["id"] for e in entries)
    assert sum(e["amount"] for e in entries) == 0  # every transaction balances
    assert {e["account"] for e in entries} == {"granted", "available"}
    assert {e["kind"] for e in entries} == {"grant"}
    for bad in (0, 501):
        response = tenant.client.get("/v1/credits/ledger", params={"limit": bad})
        assert response.status_code == 422 and response.headers["content-type"] == PROBLEM


def test_audit_rows_say_who_which_request_and_key(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    headers = {"Idempotency-Key": "audit-key-1", "X-Request-Id": "req-audit-1"}
    body = {"org": tenant.org, "project": tenant.project, "kind": "grant", "amount": 7}
    response = cluster.admin().post("/v1/credits/grants", json=body, headers=headers)
    assert response.status_code == 201
    assert response.headers["X-Request-Id"] == "req-audit-1"
    generated = tenant.client.get("/v1/credits/balance").headers["X-Request-Id"]
    assert generated.startswith("req_")

    rows = cluster.admin().get("/v1/credits/audit", params={"org": tenant.org}).json()["items"]
    assert len(rows) == 1
    row = rows[0]
    assert row["action"] == "grant" and row["subject_id"] == response.json()["id"]
    assert row["actor"].startswith("usr_")
    assert (row["request_id"], row["idempotency_key"]) == ("req-audit-1", "audit-key-1")
    assert row["before"] is None and row["after"]["amount"] == 7
    assert row["project_id"] == tenant.project_id and row["org_id"] == tenant.org_id
    assert tenant.client.get("/v1/credits/audit").json()["items"] == rows
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert cluster.admin().get("/v1/credits/audit", params={
        "org": tenant.org, "since": later}).json()["items"] == []
    assert cluster.admin().get("/v1/credits/audit", params={
        "org": tenant.org, "since": "2026-01-01T00:00:00"}).status_code == 422


def test_budgets_crud_and_a_refusal_through_the_holds_api(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    grant(cluster, tenant, 100 * CREDIT)
    admin, scheduler = cluster.admin(), internal(cluster)
    body = {"org": tenant.org, "project": tenant.project, "period": "day",
            "limit": 50 * CREDIT, "enforcement": "hard"}
    created = admin.post("/v1/credits/budgets", json=body, headers=key())
    assert created.status_code == 201, created.text
    budget = created.json()
    assert (budget["level"], budget["limit"], budget["committed"]) == ("project", 50 * CREDIT, 0)
    assert admin.post("/v1/credits/budgets", json=body, headers=key()).status_code == 409
    assert tenant.client.post("/v1/credits/budgets", json=body, headers=key()).status_code == 404

    assert [b["id"] for b in tenant.client.get("/v1/credits/budgets").json()["items"]] == [
        budget["id"]]
    assert tenant.client.get(f"/v1/credits/budgets/{budget['id']}").status_code == 200
    listed = admin.get("/v1/credits/budgets", params={"org": tenant.org}).json()["items"]
    assert [b["id"] for b in listed] == [budget["id"]]

    patched = admin.patch(f"/v1/credits/budgets/{budget['id']}",
                          json={"limit": 15 * CREDIT}, headers=key())
    assert patched.status_code == 200 and patched.json()["limit"] == 15 * CREDIT
    refused = scheduler.post("/v1/credits/holds", headers=key(),
                             json=tenant.hold_body("job-budget-1", 20 * CREDIT))
    assert refused.status_code == 402 and refused.headers["content-type"] == PROBLEM
    assert refused.json()["reason"] == "budget_exceeded"
    assert refused.json()["budget_id"] == budget["id"]
    admitted = scheduler.post("/v1/credits/holds", headers=key(),
                              json=tenant.hold_body("job-budget-2", 10 * CREDIT))
    assert admitted.status_code == 201
    assert admin.get(f"/v1/credits/budgets/{budget['id']}").json()["committed"] == 10 * CREDIT

    cap = admin.post("/v1/credits/budgets", headers=key(), json={
        "org": tenant.org, "user": tenant.user, "period": "month", "limit": 10 * CREDIT,
        "enforcement": "cap"})
    assert cap.status_code == 201 and cap.json()["level"] == "user"
    capped = scheduler.post("/v1/credits/holds", headers=key(),
                            json=tenant.hold_body("job-budget-3", 1))
    assert capped.status_code == 402 and capped.json()["reason"] == "spend_cap_reached"

    for budget_id in (budget["id"], cap.json()["id"]):
        deleted = admin.delete(f"/v1/credits/budgets/{budget_id}", headers=key())
        assert deleted.status_code == 200
        assert admin.get(f"/v1/credits/budgets/{budget_id}").status_code == 404
    assert scheduler.post("/v1/credits/holds", headers=key(),
                          json=tenant.hold_body("job-budget-3", 1)).status_code == 201
    verified(cluster)


def test_a_hold_from_reserve_to_settle(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    grant(cluster, tenant, 100 * CREDIT)
    scheduler = internal(cluster)
    reserved = scheduler.post("/v1/credits/holds", headers=key(),
                              json=tenant.hold_body("job-life", 10 * CREDIT))
    assert reserved.status_code == 201, reserved.text
    hold = reserved.json()
    hold_id = hold["id"]
    assert hold["id"].startswith("hold_") and hold["held"] == 10 * CREDIT
    again = scheduler.post("/v1/credits/holds", headers=key(),
                           json=tenant.hold_body("job-life", 10 * CREDIT))
    assert again.status_code == 200 and again.json()["id"] == hold_id

    usage = scheduler.post(f"/v1/credits/holds/{hold_id}/usage", headers=key(),
                           json={"seq": 1, "gpu_ms": 1000})
    assert usage.status_code == 200, usage.text
    assert usage.json()["status"] == "applied" and usage.json()["hold"]["captured"] == 1000
    batch = scheduler.post("/v1/credits/usage", headers=key(), json={"reports": [
        {"hold_id": hold_id, "seq": 2, "gpu_ms": 3000},
        {"hold_id": hold_id, "seq": 2, "gpu_ms": 3000},
        {"hold_id": "hold_missing", "seq": 1, "gpu_ms": 5}]})
    assert [r["status"] for r in batch.json()["results"]] == ["applied", "duplicate",
                                                              "not_found"]
    grown = scheduler.post("/v1/credits/usage", headers=key(), json={"reports": [
        {"hold_id": hold_id, "seq": 3, "gpu_ms": 12 * CREDIT}]}).json()["results"][0]
    assert grown["status"] == "applied" and grown["hold"]["amount"] > 10 * CREDIT
    assert grown["hold"]["captured"] == 12 * CREDIT

    one = scheduler.post(f"/v1/credits/holds/{hold_id}/usage", headers=key(),
                         json={"seq": 4, "gpu_ms": 12_200_000}).json()  # grows the hold too
    assert one["status"] == "applied" and one["hold"]["captured"] == 12_200_000

    settled = scheduler.post(f"/v1/credits/holds/{hold_id}/settle", headers=key(), json={
        "reason": "finished", "final": {"seq": 5, "gpu_ms": 12_500_000}})
    assert settled.status_code == 200, settled.text
    view = settled.json()
    assert view["replayed"] is False and view["state"] == "settled"
    assert view["captured"] == 12_500_000 and view["held"] == 0
    assert view["settle_reason"] == "finished" and view["settled_by"] == "internal"
    repeat = scheduler.post(f"/v1/credits/holds/{hold_id}/settle", headers=key(),
                            json={"reason": "finished"})
    assert repeat.json()["replayed"] is True
    assert {k: v for k, v in repeat.json().items() if k != "replayed"} == {
        k: v for k, v in view.items() if k != "replayed"}
    assert scheduler.get(f"/v1/credits/holds/{hold_id}").json()["state"] == "settled"
    assert cluster.admin().get(f"/v1/credits/holds/{hold_id}").status_code == 200

    balance = tenant.client.get("/v1/credits/balance").json()
    assert (balance["consumed"], balance["held"]) == (12_500_000, 0)
    assert balance["available"] == 100 * CREDIT - 12_500_000
    verified(cluster)


def test_bad_input_is_refused_and_writes_nothing(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    admin = cluster.admin()
    good = {"org": tenant.org, "project": tenant.project, "kind": "grant", "amount": 10}
    cases = [
        ({**good, "amount": -5}, 422),
        ({**good, "amount": 0}, 422),
        ({**good, "amount": 1.5}, 422),
        ({**good, "kind": "gift"}, 422),
        ({**good, "expires_at": "2099-01-01T00:00:00"}, 422),
        ({**good, "expires_at": "2001-01-01T00:00:00Z"}, 422),
        ({**good, "org": "no-such-org"}, 404),
        ({**good, "project": "no-such-project"}, 404),
        ({**good, "colour": "blue"}, 422),
    ]
    for body, status in cases:
        response = admin.post("/v1/credits/grants", json=body, headers=key())
        assert response.status_code == status, (body, response.text)
        assert response.headers["content-type"] == PROBLEM
        assert response.json()["status"] == status
    budget = {"org": tenant.org, "period": "week", "limit": 1, "enforcement": "hard"}
    assert admin.post("/v1/credits/budgets", json=budget, headers=key()).status_code == 422
    assert admin.post("/v1/credits/budgets", headers=key(), json={
        **budget, "period": "day", "limit": -1}).status_code == 422
    assert internal(cluster).post("/v1/credits/holds", headers=key(), json=tenant.hold_body(
        "job-bad", 10, org_id="org_nope")).status_code == 404
    assert internal(cluster).post("/v1/credits/usage", headers=key(),
                                  json={"reports": []}).status_code == 422
    assert internal(cluster).post("/v1/credits/holds/hold_x/settle", headers=key(),
                                  json={"reason": "lease_expired"}).status_code == 422

    assert query(cluster, select(func.count()).select_from(CreditAudit).where(
        CreditAudit.org_id == tenant.org_id))[0][0] == 0
    assert admin.get("/v1/credits/balance", params={"org": tenant.org, "project":
                                                    tenant.project}).json()["granted"] == 0


def test_idempotency_key_replays_and_refuses_a_different_body(cluster: Cluster) -> None:
    tenant = new_tenant(cluster)
    admin = cluster.admin()
    headers = {"Idempotency-Key": "grant-once"}
    body = {"org": tenant.org, "project": tenant.project, "kind": "grant", "amount": 42}
    first = admin.post("/v1/credits/grants", json=body, headers=headers)
    second = admin.post("/v1/credits/grants", json=body, headers=headers)
    assert first.status_code == second.status_code == 201
    assert first.json() == second.json()
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"
    different = admin.post("/v1/credits/grants", json={**body, "amount": 43}, headers=headers)
    assert different.status_code == 422 and "different request" in different.json()["detail"]
    assert tenant.client.get("/v1/credits/balance").json()["granted"] == 42
    rows = query(cluster, select(CreditBucket.id).join_from(
        CreditBucket, CreditAudit, CreditAudit.subject_id == CreditBucket.id).where(
        CreditAudit.org_id == tenant.org_id))
    assert len(rows) == 1


def test_other_tenants_get_404_everywhere(cluster: Cluster) -> None:
    owner = new_tenant(cluster)
    grant(cluster, owner, 10 * CREDIT)
    scheduler = internal(cluster)
    hold_id = scheduler.post("/v1/credits/holds", headers=key(),
                             json=owner.hold_body(f"job-{owner.org}", CREDIT)).json()["id"]
    budget_id = cluster.admin().post("/v1/credits/budgets", headers=key(), json={
        "org": owner.org, "project": owner.project, "period": "month", "limit": CREDIT,
        "enforcement": "soft"}).json()["id"]
    stranger = new_tenant(cluster)
    neighbour = new_tenant(cluster, org=owner.org, project="other")

    names = {"org": owner.org, "project": owner.project}
    for intruder in (stranger, neighbour):
        client = intruder.client
        for path in ("/v1/credits/balance", "/v1/credits/ledger", "/v1/credits/audit"):
            response = client.get(path, params=names)
            assert response.status_code == 404, (path, response.text)
            missing = client.get(path, params={**names, "project": "no-such-project"})
            assert missing.status_code == 404
            assert response.json()["title"] == missing.json()["title"]
        assert client.get(f"/v1/credits/budgets/{budget_id}").status_code == 404
        assert budget_id not in {b["id"] for b in client.get("/v1/credits/budgets").json()[
            "items"]}
        writes = [
            ("POST", "/v1/credits/grants", {**names, "kind": "grant", "amount": 1}),
            ("POST", "/v1/credits/budgets", {**names, "period": "day", "limit": 1,
                                             "enforcement": "hard"}),
            ("PATCH", f"/v1/credits/budgets/{budget_id}", {"limit": 5}),
            ("DELETE", f"/v1/credits/budgets/{budget_id}", None),
            ("POST", "/v1/credits/holds", owner.hold_body("job-intruder", 1)),
            ("POST", f"/v1/credits/holds/{hold_id}/usage", {"seq": 1, "gpu_ms": 1}),
            ("POST", "/v1/credits/usage", {"reports": [
                {"hold_id": hold_id, "seq": 1, "gpu_ms": 1}]}),
            ("POST", f"/v1/credits/holds/{hold_id}/settle", {"reason": "cancelled"}),
            ("GET", f"/v1/credits/holds/{hold_id}", None),
        ]
        for method, path, body in writes:
            response = client.request(method, path, json=body, headers=key())
            assert response.status_code == 404, (method, path, response.text)
    # The neighbour may read its own org's shared wallet, not the owner's project.
    assert neighbour.client.get("/v1/credits/balance", params={"scope": "org"}).status_code == 200
    assert scheduler.get(f"/v1/credits/holds/{hold_id}").json()["state"] == "active"
    assert cluster.admin().get(f"/v1/credits/budgets/{budget_id}").json()["limit"] == CREDIT
    verified(cluster)
