"""Per-workspace limits as a user meets them: the platform's defaults, a project's
own, and a warm kernel taking over a workspace on its own small filesystem."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nbfleet.agent.service import local_id
from tests.conftest import running_cluster
from tests.support.cluster import Cluster, create_running, run_cell, start_kernel, wait_state
from tests.support.hostile import disk_bomb

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None,
    reason="disk quotas need root (loop mounts) and bubblewrap")

DEFAULTS = ("--sandbox", "bwrap", "--workspace-disk", "48MiB", "--kernel-memory", "1GiB",
            "--kernel-pids", "256")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("quotas")
    with running_cluster(root, warm_pool=1, agent_args=DEFAULTS) as running:
        yield running


def _cgroup_limit(cluster: Cluster, workspace_id: str, controller: str, name: str) -> str:
    """A limit of the cgroup whose kernel works in ``workspace_id``'s files (the
    slot may be a warm one, named after the warm kernel, not the workspace)."""
    agent_id = (cluster.root / "agent1" / "agent-id").read_text().strip()
    name_of_agent = local_id(agent_id, str(cluster.root / "agent1"))
    slots = glob.glob(f"/sys/fs/cgroup/{controller}/**/nbfleet-{name_of_agent}/*/",
                      recursive=True)
    for slot in slots:
        for pid in Path(slot, "cgroup.procs").read_text().split():
            # Every kernel sees its files at the same path: look through /proc.
            if os.path.exists(f"/proc/{pid}/cwd/{workspace_id}.marker"):
                return Path(slot, name).read_text().strip()
    raise AssertionError(f"no kernel of {workspace_id} in {slots}")


def _mark(client: httpx.Client, workspace_id: str) -> None:
    client.put(f"/v1/workspaces/{workspace_id}/files/{workspace_id}.marker",
               content=b"").raise_for_status()


def test_a_warm_kernel_takes_over_a_workspace_with_its_files_and_quota(
        cluster: Cluster) -> None:
    client = cluster.new_user(org="q1")
    ws = create_running(client)
    client.put(f"/v1/workspaces/{ws}/files/notes/todo.txt", content=b"one").raise_for_status()
    kernel = start_kernel(client, ws)  # the warm kernel's slot adopts the workspace
    appended = run_cell(cluster, client, ws, kernel,
                        "with open('notes/todo.txt', 'a') as f: f.write(' two')\n"
                        "print(open('notes/todo.txt').read())")
    assert appended.stdout == "one two\n", appended.outputs
    bomb = run_cell(cluster, client, ws, kernel, disk_bomb(".", 200))
    assert '"refusal": "ENOSPC"' in bomb.stdout, bomb.outputs
    client.post(f"/v1/workspaces/{ws}/suspend").raise_for_status()
    wait_state(client, ws, "suspended")
    assert client.get(f"/v1/workspaces/{ws}/files/notes/todo.txt").content == b"one two"
    client.post(f"/v1/workspaces/{ws}/resume").raise_for_status()
    wait_state(client, ws, "running")
    again = run_cell(cluster, client, ws, kernel, "print(open('notes/todo.txt').read())")
    assert again.stdout == "one two\n"


def test_a_projects_own_limits_apply_to_its_workspaces(cluster: Cluster) -> None:
    admin = cluster.admin()
    client = cluster.new_user(org="q2", project="big")
    answer = admin.put("/v1/admin/orgs/q2/projects/big/settings",
                       json={"kernel_memory": "512MiB", "kernel_pids": 64,
                             "workspace_disk": "24MiB"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["kernel_memory"] == "512MiB"
    ws = create_running(client)
    _mark(client, ws)
    kernel = start_kernel(client, ws)
    assert _cgroup_limit(cluster, ws, "memory", "memory.limit_in_bytes") == str(512 << 20)
    assert _cgroup_limit(cluster, ws, "pids", "pids.max") == "64"
    assert _cgroup_limit(cluster, ws, "cpu", "cpu.cfs_quota_us") == "100000"  # the default
    bomb = run_cell(cluster, client, ws, kernel, disk_bomb(".", 200))
    assert '"refusal": "ENOSPC"' in bomb.stdout, bomb.outputs
    written = int(bomb.stdout.split('"written_mib": ')[1].split(",")[0])
    assert written <= 24, bomb.stdout
    # Other projects keep the platform's defaults.
    other = cluster.new_user(org="q3")
    other_ws = create_running(other)
    _mark(other, other_ws)
    start_kernel(other, other_ws)
    assert _cgroup_limit(cluster, other_ws, "memory", "memory.limit_in_bytes") == str(1 << 30)


@pytest.mark.parametrize("body", [
    {"kernel_memory": "lots"},
    {"kernel_memory": "1MiB"},
    {"kernel_pids": 0},
    {"kernel_cpus": -1},
    {"workspace_disk": "10 parsecs"},
    {"kernel_memory": "4GiB", "unknown": 1},
])
def test_bad_limits_are_refused_with_a_reason(cluster: Cluster, body: dict[str, object]) -> None:
    answer = cluster.admin().put("/v1/admin/orgs/q1/projects/research/settings", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["detail"]


def _images(cluster: Cluster) -> list[Path]:
    return list((cluster.root / "agent1" / "sandbox" / "disks").glob("*.img"))


def test_a_workspace_disk_costs_the_host_what_it_holds_not_its_limit(cluster: Cluster) -> None:
    """Images are thin: before, each running workspace and warm slot allocated its
    whole limit up front, and five default workspaces took 50 GiB."""
    client = cluster.new_user(org="thin")
    ws = create_running(client)
    _mark(client, ws)
    kernel = start_kernel(client, ws)
    assert run_cell(cluster, client, ws, kernel,
                    "open('blob.bin', 'wb').write(b'x' * (4 << 20))").status == "ok"
    images = _images(cluster)
    assert images
    for image in images:
        allocated = image.stat().st_blocks * 512
        assert allocated < image.stat().st_size, (image, allocated)
    allocated = sum(image.stat().st_blocks * 512 for image in images)
    assert allocated < len(images) * (12 << 20), [(i.name, i.stat().st_blocks) for i in images]


def test_a_workspace_near_its_disk_limit_is_told_in_its_cell(cluster: Cluster) -> None:
    client = cluster.new_user(org="nearly")
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    result = run_cell(cluster, client, ws, kernel,
                      "import time\nopen('big.bin', 'wb').write(b'x' * (37 << 20))\n"
                      "time.sleep(6)")  # at least two heartbeats
    warning = [o["content"]["text"] for o in result.outputs
               if o["msg_type"] == "stream" and o["content"]["name"] == "stderr"]
    assert any("this workspace's disk is" in w and "full" in w for w in warning), \
        result.outputs
    again = run_cell(cluster, client, ws, kernel, "import time\ntime.sleep(5)")
    assert not any("disk is" in o["content"].get("text", "") for o in again.outputs), \
        "told once per crossing, not at every heartbeat"
