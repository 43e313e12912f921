"""Workspaces ask for resources: requests, project defaults, refusals that say why,
idempotency and the CLI, on real processes. The shared cluster's one agent declares
``2xA100-80GB`` (``tests/support/cluster.py``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from tests.integration.test_cli import nbfleet
from tests.support.cluster import Cluster

GPU_REQUEST = {"gpus": 1, "gpu_types": ["A100-80GB", "H100-80GB"], "vram_gb": 40,
               "millicpus": 500, "memory_mb": 256}
NOTHING = {"millicpus": 0, "memory_mb": 0, "gpus": 0, "vram_gb": 0, "gpu_types": []}


def settings_path(org: str, project: str) -> str:
    return f"/v1/admin/orgs/{org}/projects/{project}/settings"


def tenant(cluster: Cluster) -> tuple[str, httpx.Client]:
    """A user in a project of its own (its settings touch no other test)."""
    org = f"res-{uuid.uuid4().hex[:8]}"
    return org, cluster.new_user(org=org, project="p")


def create(client: httpx.Client, resources: dict[str, Any] | None = None,
           **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"name": "w"}
    if resources is not None:
        body["resources"] = resources
    return client.post("/v1/workspaces", json=body, headers=headers)


def assert_problem(response: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    problem: dict[str, Any] = response.json()
    for fragment in fragments:
        assert fragment in problem["detail"], (fragment, problem["detail"])
    return problem


def test_requested_resources_are_stored_and_shown(shared_cluster: Cluster) -> None:
    _, client = tenant(shared_cluster)
    created = create(client, GPU_REQUEST)
    assert created.status_code == 201, created.text
    assert created.json()["resources"] == GPU_REQUEST
    ws = created.json()["id"]
    assert client.get(f"/v1/workspaces/{ws}").json()["resources"] == GPU_REQUEST
    listed = {w["id"]: w for w in client.get("/v1/workspaces").json()["items"]}
    assert listed[ws]["resources"] == GPU_REQUEST
    # Fields left out are zero; nothing asked and no default: no GPUs, as before.
    partial = create(client, {"gpus": 2})
    assert partial.json()["resources"] == {**NOTHING, "gpus": 2}
    assert create(client).json()["resources"] == NOTHING


def test_unsatisfiable_requests_are_refused_saying_why(shared_cluster: Cluster) -> None:
    _, client = tenant(shared_cluster)
    assert_problem(create(client, {"gpus": 4}), 422, "no host has 4 GPUs; the largest has 2",
                   "the autoscaler adds none")
    assert_problem(create(client, {"gpus": 1, "gpu_types": ["H200-141GB"]}), 422,
                   "no GPU type H200-141GB exists in the fleet (types: A100-80GB)")
    assert_problem(create(client, {"gpus": 1, "vram_gb": 96}), 422,
                   "no GPU has at least 96 GB of VRAM; the largest has 80 GB")
    assert_problem(create(client, {"gpus": 3, "gpu_types": ["A100-80GB"], "vram_gb": 80}), 422,
                   "no host has 3 GPUs of type A100-80GB with at least 80 GB; the largest "
                   "fitting host has 2")
    assert_problem(create(client, {"memory_mb": 16 << 20}), 422, "16 TiB of memory")
    problem = assert_problem(create(client, {"millicpus": 1_024_000}), 422, "1024 CPUs")
    assert problem["field"] == "resources" and problem["reason"] == "unsatisfiable"
    assert client.get("/v1/workspaces").json()["items"] == []  # nothing was created


def test_malformed_requests_name_the_field(shared_cluster: Cluster) -> None:
    _, client = tenant(shared_cluster)
    cases: list[tuple[dict[str, Any], str]] = [
             ({"gpus": 1, "gpu_typo": ["A100-80GB"]}, "resources.gpu_typo"),
             ({"gpus": 65}, "resources.gpus"),
             ({"gpus": 1, "gpu_types": ["a100"]}, "resources.gpu_types.0"),
             ({"gpu_types": ["A100-80GB"]}, "need gpus of at least 1"),
             ({"gpus": 1, "gpu_types": ["A100-80GB"] * 17}, "resources.gpu_types")]
    for resources, named in cases:
        assert_problem(create(client, resources), 422, named)
    misspelt = client.post("/v1/workspaces", json={"name": "w", "resource": {"gpus": 1}})
    assert_problem(misspelt, 422, "resource")
    assert client.get("/v1/workspaces").json()["items"] == []


def test_project_default_applies_to_new_workspaces_only(shared_cluster: Cluster) -> None:
    org, client = tenant(shared_cluster)
    admin = shared_cluster.admin()
    default = {"gpus": 1, "gpu_types": ["A100-80GB"]}
    answer = admin.put(settings_path(org, "p"), json={"resources": default})
    assert answer.status_code == 200, answer.text
    assert answer.json()["resources"] == {**NOTHING, **default}
    first = create(client).json()
    assert first["resources"] == {**NOTHING, **default}
    # An explicit request replaces the default entirely, even an empty one.
    assert create(client, {}).json()["resources"] == NOTHING
    assert create(client, {"millicpus": 250}).json()["resources"] == {**NOTHING,
                                                                        "millicpus": 250}

    assert admin.put(settings_path(org, "p"), json={"resources": {"gpus": 2}}).status_code == 200
    assert create(client).json()["resources"] == {**NOTHING, "gpus": 2}
    # Not retroactive: the first workspace keeps what it was created with.
    assert client.get(f"/v1/workspaces/{first['id']}").json()["resources"] == first["resources"]

    cleared = admin.put(settings_path(org, "p"), json={"resources": None})
    assert cleared.status_code == 200 and cleared.json()["resources"] is None
    assert create(client).json()["resources"] == NOTHING
    assert client.get(f"/v1/workspaces/{first['id']}").json()["resources"] == first["resources"]


def test_project_default_is_validated_like_a_request(shared_cluster: Cluster) -> None:
    org, client = tenant(shared_cluster)
    admin = shared_cluster.admin()
    path = settings_path(org, "p")
    assert_problem(admin.put(path, json={"resources": {"gpus": 4}}), 422,
                   "resources cannot be satisfied: no host has 4 GPUs; the largest has 2")
    assert_problem(admin.put(path, json={"resources": {"gpus": 1, "gpu_types": ["V100-16GB"]}}),
                   422, "no GPU type V100-16GB exists in the fleet")
    assert_problem(admin.put(path, json={"resources": {"gpus": 1, "vram": 40}}), 422,
                   "resources.vram")
    # Nothing was stored by the refusals.
    assert create(client).json()["resources"] == NOTHING
    # Unknown projects are 404 before their settings are judged.
    assert_problem(admin.put(settings_path(org, "nope"), json={"resources": {"gpus": 4}}), 404)
    # Another tenant (any non-admin, the project's own users too) finds no such route.
    _, outsider = tenant(shared_cluster)
    for caller in (outsider, client):
        assert_problem(caller.put(path, json={"resources": {"gpus": 1}}), 404)
    assert create(client).json()["resources"] == NOTHING


def test_idempotency_covers_the_resources(shared_cluster: Cluster) -> None:
    _, client = tenant(shared_cluster)
    key = {"Idempotency-Key": f"res-{uuid.uuid4().hex}"}
    first = create(client, {"gpus": 1}, **key)
    assert first.status_code == 201
    replay = create(client, {"gpus": 1}, **key)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == first.json()["id"]
    assert_problem(create(client, {"gpus": 2}, **key), 422, "different request")
    assert_problem(create(client, None, **key), 422, "different request")
    # A refusal is an answer too: the same key gets it again.
    refused_key = {"Idempotency-Key": f"res-{uuid.uuid4().hex}"}
    assert_problem(create(client, {"gpus": 9}, **refused_key), 422, "no host has 9 GPUs")
    again = create(client, {"gpus": 9}, **refused_key)
    assert_problem(again, 422, "no host has 9 GPUs")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(client.get("/v1/workspaces").json()["items"]) == 1


def test_rows_from_before_requests_show_no_resources(shared_cluster: Cluster) -> None:
    _, client = tenant(shared_cluster)
    ws = create(client, {"gpus": 1}).json()["id"]
    engine = create_engine(shared_cluster.db_url.replace("postgresql://",
                                                         "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(text("UPDATE workspaces SET resources = NULL WHERE id = :id"), {"id": ws})
    engine.dispose()
    assert client.get(f"/v1/workspaces/{ws}").json()["resources"] == NOTHING


def test_cli_asks_for_resources_and_shows_them(shared_cluster: Cluster) -> None:
    org = f"res-{uuid.uuid4().hex[:8]}"
    token = nbfleet(shared_cluster.url, shared_cluster.admin_token, "user", "create", "erin",
                    "--org", org, "--project", "p").stdout.strip()
    made = nbfleet(shared_cluster.url, token, "ws", "create", "demo", "--gpus", "1",
                   "--gpu-type", "A100-80GB", "--gpu-type", "H100-80GB", "--vram", "40",
                   "--cpus", "0.5", "--memory", "256MiB")
    assert made.returncode == 0, made.stderr
    ws = json.loads(made.stdout)
    assert ws["resources"] == GPU_REQUEST
    listing = nbfleet(shared_cluster.url, token, "ws", "list")
    assert "1x A100-80GB|H100-80GB >=40GB" in listing.stdout
    shown = nbfleet(shared_cluster.url, token, "ws", "get", ws["id"])
    assert json.loads(shown.stdout)["resources"] == GPU_REQUEST
    assert "gpus 1x A100-80GB|H100-80GB >=40GB, cpus 0.5, memory 256 MiB" in shown.stderr
    plain = json.loads(nbfleet(shared_cluster.url, token, "ws", "create", "plain").stdout)
    assert plain["resources"]["gpus"] == 0

    cases = [
        (("--gpus", "4"), "no host has 4 GPUs; the largest has 2"),
        (("--gpus", "1", "--gpu-type", "H200-141GB"), "no GPU type H200-141GB exists"),
        (("--memory", "lots"), "invalid --memory 'lots'"),
        (("--cpus", "-1"), "invalid --cpus"),
        (("--cpus", "two"), "--cpus"),
        (("--gpu-type", "A100-80GB"), "need --gpus 1 or more"),
        (("--gpus", "1", "--gpu-type", "a100"), "invalid --gpu-type 'a100'"),
        (("--gpus", "99"), "--gpus"),
    ]
    for args, message in cases:
        result = nbfleet(shared_cluster.url, token, "ws", "create", "bad", *args)
        assert result.returncode != 0, (args, result.stdout)
        assert message in result.stderr, (args, message, result.stderr)
        assert "Traceback" not in result.stderr
