"""Values the database cannot store are the caller's error: a NUL character in a
path, query or JSON body gets a 4xx problem, never a 500 (PostgreSQL refuses NUL
in text; SQLite stores it). Found by tests/security/test_api_fuzz.py on PostgreSQL."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import PG_ADMIN_URL
from tests.support.cluster import Cluster

# (who, method, URL, JSON body)
PROBES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("user", "POST", "/v1/workspaces", {"name": "a\u0000b"}),
    ("user", "GET", "/v1/workspaces/ws_%00", None),
    ("user", "GET", "/v1/workspaces?after=%00", None),
    ("user", "GET", "/v1/jobs/job_%00", None),
    ("user", "GET", "/v1/jobs?binary=%00", None),
    ("user", "GET", "/v1/binaries?name=%00", None),
    ("user", "GET", "/v1/credits/budgets/b%00", None),
    ("admin", "PUT", "/v1/admin/orgs/o%00/projects/p/settings", {"idle_suspend_s": 60}),
    ("admin", "POST", "/v1/credits/grants", {"org": "o\u0000", "amount": 1, "kind": "grant"}),
    ("admin", "POST", "/v1/credits/budgets", {"org": "o\u0000", "limit": 1, "period": "month",
                                              "enforcement": "soft"}),
    ("admin", "GET", "/v1/credits/ledger?org=o%00", None),
    ("admin", "PATCH", "/v1/admin/binaries/b%00/1", {"canary_percent": 1}),
]


@pytest.fixture(scope="module")
def clients(shared_cluster: Cluster) -> dict[str, httpx.Client]:
    return {"user": shared_cluster.new_user(org="nul", project="p"),
            "admin": shared_cluster.admin()}


@pytest.mark.parametrize(("who", "method", "url", "body"), PROBES)
def test_a_nul_character_is_never_a_server_error(
        clients: dict[str, httpx.Client], who: str, method: str, url: str,
        body: dict[str, Any] | None) -> None:
    response = clients[who].request(method, url, json=body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.headers["content-type"] == "application/problem+json"
    if PG_ADMIN_URL:
        assert response.status_code in (404, 422), response.text
