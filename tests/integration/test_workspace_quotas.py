"""Workspace quotas through a real control plane and agent: refusals are 403
problem+json naming the limit (never a 500), 50 concurrent creates by one user stay
within it, a resume and a kernel start count, admins set quotas, and the CLI and
the dashboard show them. The DB-level races are in
``test_workspace_quota_admission.py``."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.integration.test_cli import nbfleet
from tests.support.cluster import Cluster, create_running, start_kernel, suspend, token_of

PROBLEM = "https://nbfleet.dev/problems/quota-exceeded"


def tenant(cluster: Cluster, **quota: Any) -> tuple[str, str, httpx.Client]:
    """A user in an org of its own, with ``quota`` as its own limits."""
    org, name = f"quota-{uuid.uuid4().hex[:8]}", f"u{uuid.uuid4().hex[:6]}"
    client = cluster.new_user(org=org, project="p", name=name)
    if quota:
        response = cluster.admin().put(f"/v1/admin/orgs/{org}/users/{name}/quota", json=quota)
        assert response.status_code == 200, response.text
    return org, name, client


def create(client: httpx.Client, **headers: str) -> httpx.Response:
    return client.post("/v1/workspaces", json={"name": "w"}, headers=headers)


def assert_quota_problem(response: httpx.Response, quota: str, limit: int,
                         current: int) -> dict[str, Any]:
    assert response.status_code == 403, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem: dict[str, Any] = response.json()
    assert problem["type"] == PROBLEM and problem["title"] == "Quota exceeded"
    assert (problem["quota"], problem["limit"], problem["current"]) == (quota, limit, current)
    assert f"limit is {limit} " in problem["detail"] and "ask an admin" in problem["detail"]
    return problem


def test_over_quota_is_a_403_problem_that_says_how_to_raise_it(
        shared_cluster: Cluster) -> None:
    org, name, client = tenant(shared_cluster, running=2)
    assert create(client).status_code == 201
    assert create(client).status_code == 201
    problem = assert_quota_problem(create(client), "running", 2, 2)
    assert problem["scope"] == "user"
    assert f"PUT /v1/admin/orgs/{org}/users/{name}/quota" in problem["detail"]
    # A refusal under an Idempotency-Key is stored and replayed like any answer.
    first = create(client, **{"Idempotency-Key": "again"})
    replay = create(client, **{"Idempotency-Key": "again"})
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert replay.json()["detail"] == first.json()["detail"]
    shown = client.get("/v1/workspaces/quota").json()
    assert shown["user"]["limits"]["running"] == 2
    assert shown["user"]["usage"] == {"workspaces": 2, "running": 2, "gpus": 0}
    # Raising it lets the next create through.
    raised = shared_cluster.admin().put(f"/v1/admin/orgs/{org}/users/{name}/quota",
                                        json={"running": 3})
    assert raised.json()["user"]["limits"]["running"] == 3
    assert create(client).status_code == 201


def test_fifty_concurrent_creates_by_one_user_stay_within_the_quota(
        shared_cluster: Cluster) -> None:
    _, _, client = tenant(shared_cluster, running=3)
    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda _: create(client), range(50)))
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [201] * 3 + [403] * 47, statuses
    for answer in answers:
        if answer.status_code == 403:
            assert answer.json()["type"] == PROBLEM
    assert len(client.get("/v1/workspaces").json()["items"]) == 3


def test_a_resume_and_a_kernel_start_count(shared_cluster: Cluster) -> None:
    _, _, client = tenant(shared_cluster, running=1, kernels_per_workspace=1)
    first = create_running(client)
    start_kernel(client, first)
    assert_quota_problem(client.post(f"/v1/workspaces/{first}/api/kernels", json={}),
                         "kernels_per_workspace", 1, 1)
    suspend(client, first)
    assert create(client).status_code == 201  # the suspended one runs no more
    assert_quota_problem(client.post(f"/v1/workspaces/{first}/resume"), "running", 1, 1)
    assert client.get(f"/v1/workspaces/{first}").json()["desired_state"] == "suspended"


def test_admins_set_project_quotas_and_bad_values_are_422(shared_cluster: Cluster) -> None:
    org, _, client = tenant(shared_cluster)
    admin, path = shared_cluster.admin(), f"/v1/admin/orgs/{org}/projects/p/quota"
    answer = admin.put(path, json={"project": {"workspaces": 1}, "per_user": {"gpus": 4}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["set"] == {"project": {"workspaces": 1}, "per_user": {"gpus": 4}}
    assert create(client).status_code == 201
    problem = assert_quota_problem(create(client), "workspaces", 1, 1)
    assert problem["scope"] == "project" and "/projects/p/quota" in problem["detail"]
    for bad in ({"project": {"workspaces": -1}}, {"project": {"disks": 1}},
                {"per_user": {"running": "lots"}}):
        assert admin.put(path, json=bad).status_code == 422, bad
    assert admin.put(f"/v1/admin/orgs/{org}/projects/nope/quota", json={}).status_code == 404
    assert client.put(path, json={}).status_code == 404  # admin routes hide from users


def test_the_cli_and_the_dashboard_show_the_quota(shared_cluster: Cluster) -> None:
    org, name, client = tenant(shared_cluster)
    admin_token = shared_cluster.admin_token
    changed = nbfleet(shared_cluster.url, admin_token, "admin", "quota", "--org", org,
                      "--user", name, "--running", "4", "--gpus", "unlimited")
    assert changed.returncode == 0, changed.stderr
    assert "quota: 0/20 workspaces, 0/4 running, 0/unlimited GPUs, 8 kernels per " \
           "workspace" in changed.stdout
    kept = nbfleet(shared_cluster.url, admin_token, "admin", "quota", "--org", org,
                   "--user", name, "--workspaces", "6")
    assert "0/6 workspaces, 0/4 running" in kept.stdout  # --running 4 kept
    assert create(client).status_code == 201
    token = token_of(client)
    listed = nbfleet(shared_cluster.url, token, "ws", "list")
    assert listed.returncode == 0, listed.stderr
    assert "quota: 1/6 workspaces, 1/4 running" in listed.stderr
    mine = nbfleet(shared_cluster.url, token, "ws", "quota")
    assert "quota: 1/6 workspaces, 1/4 running" in mine.stdout
    project = nbfleet(shared_cluster.url, admin_token, "admin", "quota", "--org", org,
                      "--project", "p", "--per-user", "--kernels", "2")
    assert project.returncode == 0, project.stderr
    assert "kernels_per_workspace 2" in project.stdout
    bad = nbfleet(shared_cluster.url, admin_token, "admin", "quota", "--org", org,
                  "--user", name, "--running", "-3")
    assert bad.returncode == 1 and "invalid --running" in bad.stderr
    page = client.get("/")
    assert page.status_code == 200
    assert "Your quota: 1 of 6 workspaces, 1 of 4 running, 0 of unlimited GPUs" in page.text
    assert "Your project:" not in page.text  # no totals set: none counted or shown
    totals = nbfleet(shared_cluster.url, admin_token, "admin", "quota", "--org", org,
                     "--project", "p", "--gpus", "8")
    assert "project quota: 1/unlimited workspaces, 1/unlimited running, 0/8 GPUs" \
        in totals.stdout
    assert "kernels_per_workspace 2" in totals.stdout  # the per-user quota was kept
    assert "Your project: 1 of unlimited workspaces, 1 of unlimited running, 0 of 8 GPUs" \
        in client.get("/").text
