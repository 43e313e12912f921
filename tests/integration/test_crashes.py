"""kill -9 of the control plane or an agent, mid-transition: nothing is lost or stuck."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import (
    Cluster,
    create_running,
    events_of,
    outcome,
    run_cell,
    start_kernel,
    wait_state,
    wait_until,
)

SLOW_RELEASE = {"NBFLEET_FAULT_RELEASE_DELAY_S": "3"}


def _runner(cluster: Cluster, client, ws: str, kernel: str):  # type: ignore[no-untyped-def]
    """run(code) -> stdout or the error name, through the gateway."""
    return lambda code: outcome(run_cell(cluster, client, ws, kernel, code))


@pytest.fixture
def slow_release(tmp_path: Path, db_url: str) -> Iterator[Cluster]:
    """A cluster whose agent holds every release open for 3 s: time to crash mid-way."""
    cluster = Cluster(tmp_path, db_url)
    try:
        cluster.start_control()
        cluster.start_agent(env=SLOW_RELEASE)
        yield cluster
    finally:
        cluster.stop()


def test_kill_control_mid_suspend_converges_to_suspended(slow_release: Cluster) -> None:
    cluster = slow_release
    client = cluster.new_user()
    ws = create_running(client)
    run = _runner(cluster, client, ws, start_kernel(client, ws))
    assert run("open('out.txt','w').write('kept'); print(1)") == "1\n"

    client.post(f"/v1/workspaces/{ws}/suspend")
    wait_state(client, ws, "suspending")
    cluster.kill_control()  # the agent is still holding the release open

    cluster.start_control()
    body = wait_state(client, ws, "suspended", timeout=60)
    assert body["host_id"] is None and body["last_error"] is None
    assert events_of(client, ws)[-2:] == [("running", "suspending"), ("suspending", "suspended")]
    assert client.get(f"/v1/workspaces/{ws}/files/out.txt").content == b"kept"
    # The runtime really is gone from the host: no kernel processes left behind.
    host = cluster.admin().get("/v1/admin/agents").json()["items"][0]["url"]
    secret = (cluster.home / "cluster-secret").read_text().strip()
    left = httpx.get(f"{host}/agent/v1/kernels", headers={"Authorization": f"Bearer {secret}"})
    assert left.json() == []
    # And it resumes normally afterwards.
    client.post(f"/v1/workspaces/{ws}/resume")
    wait_state(client, ws, "running")


def test_control_restart_adopts_running_kernels(cluster: Cluster) -> None:
    client = cluster.new_user()
    ws = create_running(client)
    run = _runner(cluster, client, ws, start_kernel(client, ws))
    before = run("import os; pid = os.getpid(); state = 'alive'; print(pid)")
    assert before.strip().isdigit()

    cluster.kill_control()
    cluster.start_control()

    assert run("print(pid, state)") == f"{before.strip()} alive\n"
    assert client.get(f"/v1/workspaces/{ws}").json()["state"] == "running"
    assert events_of(client, ws)[-1] == ("creating", "running")  # no re-placement happened


def test_a_control_plane_down_longer_than_the_agent_timeout_loses_no_kernel(
        cluster: Cluster) -> None:
    """While no control plane runs, agents' heartbeats fail because of us: a restart
    slower than the agent timeout (10 s) must not declare every host dead."""
    client = cluster.new_user()
    ws = create_running(client)
    run = _runner(cluster, client, ws, start_kernel(client, ws))
    before = run("import os; pid = os.getpid(); print(pid)")
    cluster.kill_control()
    time.sleep(12)
    cluster.start_control()
    time.sleep(3)  # a reconciler tick or more, with every heartbeat older than 10 s
    assert run("print(pid)") == before
    assert events_of(client, ws)[-1] == ("creating", "running")  # not re-placed


def test_kill_agent_while_running_replaces_the_runtime(cluster: Cluster) -> None:
    client = cluster.new_user()
    ws = create_running(client)
    client.put(f"/v1/workspaces/{ws}/files/keep.txt", content=b"safe in the blob store")
    run = _runner(cluster, client, ws, start_kernel(client, ws))
    run("v = 1")

    cluster.kill_agent()  # the host dies with its kernels
    cluster.start_agent()  # comes back with a new boot id

    def replaced() -> bool:
        events = events_of(client, ws)
        return ("running", "resuming") in events and events[-1] == ("resuming", "running")

    wait_until(replaced, 60, what="re-placement after the agent restart")
    assert run("print(open('keep.txt').read())") == "safe in the blob store\n"
    assert run("print(v)") == "NameError"


def test_kill_agent_mid_suspend_still_suspends(slow_release: Cluster) -> None:
    cluster = slow_release
    client = cluster.new_user()
    ws = create_running(client)
    client.put(f"/v1/workspaces/{ws}/files/keep.txt", content=b"x")
    client.post(f"/v1/workspaces/{ws}/suspend")
    wait_state(client, ws, "suspending")
    cluster.kill_agent()
    cluster.start_agent()
    wait_state(client, ws, "suspended", timeout=60)
    assert client.get(f"/v1/workspaces/{ws}/files/keep.txt").content == b"x"
    client.post(f"/v1/workspaces/{ws}/resume")
    wait_state(client, ws, "running")


def test_two_control_planes_do_not_double_apply(tmp_path: Path, db_url: str) -> None:
    """Two replicas on one DB: the lease lets one reconcile; every step happens once."""
    cluster = Cluster(tmp_path, db_url)
    twin = Cluster(tmp_path / "twin", db_url)
    try:
        cluster.start_control()
        twin.home = cluster.home  # same secrets and admin token, second port
        twin.start_control()
        cluster.start_agent()
        client = cluster.new_user()
        other_door = twin.client(client.headers["Authorization"].split()[1])
        ids = [client.post("/v1/workspaces", json={"name": f"w{i}"}).json()["id"]
               for i in range(6)]
        for ws in ids:
            wait_state(client, ws, "running")
        for i, ws in enumerate(ids):
            (client if i % 2 else other_door).post(f"/v1/workspaces/{ws}/suspend")
        for ws in ids:
            wait_state(other_door, ws, "suspended")
            assert events_of(client, ws) == [
                (None, "creating"), ("creating", "running"),
                ("running", "suspending"), ("suspending", "suspended"),
            ]
    finally:
        cluster.stop()
        twin.stop()


def test_a_workspace_waits_for_a_host_and_says_why(tmp_path: Path, db_url: str) -> None:
    cluster = Cluster(tmp_path, db_url)
    try:
        cluster.start_control()  # no agent yet
        client = cluster.new_user()
        ws = client.post("/v1/workspaces", json={"name": "patient"}).json()["id"]
        body = wait_until(
            lambda: (b := client.get(f"/v1/workspaces/{ws}").json())["last_error"] and b,
            30, what="the reason to be reported")
        assert body["state"] == "creating"
        assert body["last_error"] == "no host is available"
        time.sleep(16)  # five failed attempts: the next would come 8 to 16 s later
        cluster.start_agent()
        body = wait_state(client, ws, "running", timeout=4)  # the new host ends the backoff
        assert body["last_error"] is None
    finally:
        cluster.stop()
