"""Prometheus metrics on the control plane and the agent, for operators only."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster import Cluster, create_running, start_kernel, wait_state


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_control_and_agent_expose_metrics(shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user(org="metrics", project="p")
    ws = create_running(client)
    start_kernel(client, ws)
    client.get(f"/v1/workspaces/{ws}")

    agent_url = shared_cluster.admin().get("/v1/admin/agents").json()["items"][0]["url"]
    secret = {"Authorization": f"Bearer {shared_cluster.secret}"}
    agent = samples(httpx.get(f"{agent_url}/agent/v1/metrics", headers=secret).text)
    assert agent[("nbfleet_agent_kernels", frozenset())] >= 1
    assert agent[("nbfleet_agent_runtimes", frozenset())] >= 1
    assert httpx.get(f"{agent_url}/agent/v1/metrics").status_code == 401

    client.post(f"/v1/workspaces/{ws}/suspend")
    wait_state(client, ws, "suspended")
    control = samples(httpx.get(f"{shared_cluster.url}/metrics", headers=secret).text)
    suspended = frozenset({("from_state", "suspending"), ("to_state", "suspended")})
    assert control[("nbfleet_workspace_transitions_total", suspended)] >= 1
    # Latency is recorded per route template, never per workspace id.
    get_route = frozenset({("app", "control"), ("method", "GET"), ("status", "200"),
                           ("route", "/v1/workspaces/{workspace_id}")})
    assert control[("nbfleet_http_request_duration_seconds_count", get_route)] >= 1
    assert not any(ws in dict(labels).get("route", "") for (_, labels) in control)


def test_metrics_need_the_cluster_secret_or_an_admin(shared_cluster: Cluster) -> None:
    control = f"{shared_cluster.url}/metrics"
    agent = shared_cluster.admin().get("/v1/admin/agents").json()["items"][0]["url"]
    for url in (control, f"{agent}/agent/v1/metrics"):
        for headers in (httpx.Headers(), httpx.Headers({"Authorization": "Bearer nbf_wrong"}),
                        httpx.Headers({b"Authorization": "Bearer s\u00e9cret".encode("latin-1")})):
            refused = httpx.get(url, headers=headers)
            assert refused.status_code == 401, (url, headers, refused.text)
            assert refused.headers["content-type"] == "application/problem+json"
            assert "nbfleet_" not in refused.text
        scraped = httpx.get(url, headers={"Authorization": f"Bearer {shared_cluster.secret}"})
        assert scraped.status_code == 200 and "nbfleet_http_request_duration_seconds" in \
            scraped.text
    assert httpx.get(control, params={"token": shared_cluster.secret}).status_code == 401
    admin = shared_cluster.admin().get("/metrics")
    assert admin.status_code == 200 and "nbfleet_" in admin.text
    user = shared_cluster.new_user(org="metrics", project="p").get("/metrics")
    assert user.status_code == 404  # as the admin routes: not there for ordinary callers


def test_internal_routes_refuse_a_non_ascii_token_cleanly(shared_cluster: Cluster) -> None:
    """A header byte above 127 once made the secret comparison raise (a 500)."""
    odd = httpx.Headers({b"Authorization": "Bearer s\u00e9cret".encode("latin-1")})
    for method, path in (("POST", "/internal/agents"), ("POST", "/v1/credits/usage")):
        answer = httpx.request(method, f"{shared_cluster.url}{path}", headers=odd, json={})
        assert answer.status_code in (401, 404), (path, answer.status_code, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
