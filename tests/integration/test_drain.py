"""Draining a host (issue 17 point 6): ``nbfleet admin drain HOST`` and an agent's
SIGTERM empty the host, moving each workspace with its state to another host (or
suspending it where there is none), and a drained host gets no new workspaces
until it is undrained. The drain is a DB decision (``agents.draining_since``), so
this module also runs on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from nbfleet.db.tables import Workspace
from nbfleet.sdk.kernel_socket import KernelSocket
from tests.conftest import fresh_database, running_cluster
from tests.integration.test_cli import nbfleet
from tests.integration.test_gpu_cells import fleet, funded, gpu_workspace
from tests.support.cluster import (
    Cluster,
    agent_names,
    create_running,
    outcome,
    resume,
    run_cell,
    start_kernel,
    token_of,
    wait_state,
    wait_until,
)
from tests.support.credit_api import query

PROBLEM = "application/problem+json"


def _with_variable(cluster: Cluster, client: httpx.Client) -> tuple[str, str, str]:
    """A running workspace whose kernel holds ``x = 41``: (workspace, kernel, host)."""
    ws = create_running(client, "drained")
    kernel = start_kernel(client, ws)
    assert outcome(run_cell(cluster, client, ws, kernel, "x = 41\nprint('set')")) == "set\n"
    return ws, kernel, client.get(f"/v1/workspaces/{ws}").json()["host_id"]


def _agent_kernels(cluster: Cluster, host_id: str) -> list[Any]:
    """The kernels the agent itself says it runs (not the control plane's view)."""
    kernels: list[Any] = cluster.agent_api(host_id, "/agent/v1/kernels")
    return kernels


def _host(cluster: Cluster, host_id: str) -> dict[str, Any]:
    response = cluster.admin().get(f"/v1/admin/hosts/{host_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_drain_moves_a_workspace_with_its_variables_and_keeps_new_ones_off(
        tmp_path: Path) -> None:
    with running_cluster(tmp_path) as cluster:
        cluster.start_agent("agent2")
        client = cluster.new_user()
        ws, kernel, a = _with_variable(cluster, client)
        b = next(h for h in agent_names(cluster) if h != a)

        drained = nbfleet(cluster.url, cluster.admin_token, "admin", "drain", a, "--json",
                          "--timeout", "120")
        assert drained.returncode == 0, drained.stderr
        final = json.loads(drained.stdout)
        assert final["draining"] and final["workspaces"] == 0 and final["kernels"] == 0
        assert (final["moved"], final["suspended"]) == (1, 0), final
        assert _agent_kernels(cluster, a) == []
        listed = cluster.admin().get("/v1/admin/agents").json()["items"]
        assert {x["id"]: x["draining"] for x in listed} == {a: True, b: False}

        body = wait_state(client, ws, "running")
        assert body["host_id"] == b
        # The move is over: nothing marks it as moving any more (it could move again).
        assert query(cluster, select(Workspace.move_to).where(Workspace.id == ws)) == [(None,)]
        # The same kernel id, on the other host, with the variable restored.
        assert outcome(run_cell(cluster, client, ws, kernel, "print(x + 1)")) == "42\n"

        # While A drains, new workspaces go to B, even though A is now empty.
        fresh = create_running(client, "while-draining")
        assert client.get(f"/v1/workspaces/{fresh}").json()["host_id"] == b

        undrained = nbfleet(cluster.url, cluster.admin_token, "admin", "undrain", a)
        assert undrained.returncode == 0, undrained.stderr
        assert not _host(cluster, a)["draining"]
        later = create_running(client, "after-undrain")
        assert client.get(f"/v1/workspaces/{later}").json()["host_id"] == a


#: Holds the workspace's GPU while the drain starts; appends to a file once per run.
LONG_GPU_CELL = ("import time\ntime.sleep(4)\nx = 41\n"
                 "open('runs.txt', 'a').write('ran\\n')")


async def _drain_mid_cell(cluster: Cluster, client: httpx.Client, ws: str, kernel: str,
                          host: str) -> dict[str, Any]:
    """Drain ``host`` while a GPU cell runs there: the cell's reply, and what the
    next cell prints once the workspace runs elsewhere."""
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
    try:
        cell = sock.message("execute_request", {
            "code": LONG_GPU_CELL, "silent": False, "store_history": True,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}, "shell")
        await sock.send(cell)
        await asyncio.to_thread(wait_until, lambda: fleet(cluster)["running"], 30, 0.05,
                                "the cell holding its GPU")
        drained = await asyncio.to_thread(
            cluster.admin().post, f"/v1/admin/hosts/{host}/drain")
        assert drained.status_code in (200, 202), drained.text
        done = await sock.collect(cell["header"]["msg_id"], timeout=60)
        await asyncio.to_thread(
            wait_until, lambda: (body := client.get(f"/v1/workspaces/{ws}").json())[
                "state"] == "running" and body["host_id"] != host, 90, 0.2,
            "the workspace running on the other host")
        after = await sock.execute("print(x + 1, open('runs.txt').read().count('ran'))",
                                   timeout=120)
        return {"cell": done.reply, "after": after.stdout if after.status == "ok"
                else after.reply}
    finally:
        await sock.close()


def test_a_gpu_drain_lets_the_running_cell_finish_and_moves_its_state(
        tmp_path: Path) -> None:
    """The cell holding the host's GPU ends as it would have (a suspend waits for a
    running cell), is not run again, and the next cell finds its variable and its
    file on the other host."""
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control()
            cluster.start_agent("a1")
            cluster.start_agent("a2")
            client = funded(cluster)
            ws, kernel = gpu_workspace(client, "drained-gpu")
            host = client.get(f"/v1/workspaces/{ws}").json()["host_id"]
            result = asyncio.run(_drain_mid_cell(cluster, client, ws, kernel, host))
            assert result["cell"]["status"] == "ok", result
            assert result["after"] == "42 1\n", result
            wait_until(lambda: _host(cluster, host)["kernels"] == 0, 30, 0.2,
                       "the drained host empty")
            assert _agent_kernels(cluster, host) == []
            assert (_host(cluster, host)["moved"], _host(cluster, host)["suspended"]) == (1, 0)
            assert not fleet(cluster)["running"]  # the cell's GPU was given back
        finally:
            cluster.stop()


def test_a_drain_with_nowhere_to_go_suspends_with_state(tmp_path: Path) -> None:
    with running_cluster(tmp_path) as cluster:
        client = cluster.new_user()
        ws, kernel, a = _with_variable(cluster, client)

        drained = nbfleet(cluster.url, cluster.admin_token, "admin", "drain", a,
                          "--timeout", "120")
        assert drained.returncode == 0, drained.stderr
        assert "moved 0, suspended 1" in drained.stdout, drained.stdout
        wait_state(client, ws, "suspended")
        assert _agent_kernels(cluster, a) == []
        # Draining twice is fine, and says the same.
        again = cluster.admin().post(f"/v1/admin/hosts/{a}/drain")
        assert again.status_code == 200 and again.json()["suspended"] == 1, again.text

        assert cluster.admin().delete(f"/v1/admin/hosts/{a}/drain").status_code == 200
        resume(client, ws)
        assert outcome(run_cell(cluster, client, ws, kernel, "print(x)")) == "41\n"


def test_drain_survives_a_control_plane_restart(tmp_path: Path) -> None:
    with running_cluster(tmp_path) as cluster:
        cluster.start_agent("agent2")
        a, b = sorted(agent_names(cluster))
        started = cluster.admin().post(f"/v1/admin/hosts/{a}/drain")
        assert started.status_code == 200 and started.json()["draining"], started.text
        cluster.kill_control()
        cluster.start_control()
        client = cluster.new_user()
        for name in ("one", "two"):
            ws = create_running(client, name)
            assert client.get(f"/v1/workspaces/{ws}").json()["host_id"] == b


def test_unknown_hosts_and_ordinary_callers_are_refused_clearly(tmp_path: Path) -> None:
    with running_cluster(tmp_path) as cluster:
        for method in ("GET", "POST", "DELETE"):
            path = "/v1/admin/hosts/host_nope" + ("" if method == "GET" else "/drain")
            response = cluster.admin().request(method, path)
            assert response.status_code == 404, (method, response.text)
            assert response.headers["content-type"] == PROBLEM
            assert "host_nope" in response.json()["detail"]
        a = next(iter(agent_names(cluster)))
        user = cluster.new_user()
        for method in ("GET", "POST", "DELETE"):
            path = f"/v1/admin/hosts/{a}" + ("" if method == "GET" else "/drain")
            response = user.request(method, path)
            assert response.status_code == 404, (method, response.text)
            assert response.headers["content-type"] == PROBLEM
        assert not _host(cluster, a)["draining"]
        # Only the host's current boot may drain it through the agents' route: not an
        # old process of it still stopping, nor a typo (the cluster secret is shared).
        for boot in ("boot_stale", ""):
            stale = httpx.post(f"{cluster.url}/internal/agents/{a}/drain", json={"boot_id": boot},
                               headers={"Authorization": f"Bearer {cluster.secret}"})
            assert stale.status_code == 409, stale.text
        missing = httpx.post(f"{cluster.url}/internal/agents/{a}/drain",
                             headers={"Authorization": f"Bearer {cluster.secret}"})
        assert missing.status_code == 422, missing.text
        assert not _host(cluster, a)["draining"]

        for command in ("drain", "undrain"):
            result = nbfleet(cluster.url, cluster.admin_token, "admin", command, "host_nope")
            assert result.returncode != 0
            assert "no host 'host_nope'" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr
        # A host that never empties within --timeout (its agent is gone, so its
        # workspace cannot be moved off it): a clear message, exit 1.
        client = cluster.new_user()
        create_running(client, "stays")
        cluster.kill_agent("agent1")
        stuck = nbfleet(cluster.url, cluster.admin_token, "admin", "drain", a, "--timeout", "1")
        assert stuck.returncode == 1
        assert "still draining" in stuck.stderr and "Traceback" not in stuck.stderr


def test_sigterm_drains_the_agent_within_its_bound(tmp_path: Path) -> None:
    with running_cluster(tmp_path, agent_args=("--drain-timeout", "60")) as cluster:
        client = cluster.new_user()
        ws, kernel, a = _with_variable(cluster, client)
        cluster.start_agent("agent2")
        b = next(h for h in agent_names(cluster) if h != a)

        agent = cluster.agents.pop(agent_names(cluster)[a])
        began = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        try:
            code = agent.wait(90)
        except subprocess.TimeoutExpired:
            agent.kill()
            raise
        took = time.monotonic() - began
        assert code == 0
        assert took < 60 + 20, took  # the bound, plus the shutdown that follows it
        body = wait_state(client, ws, "running")
        assert body["host_id"] == b
        # The move is over: nothing marks it as moving any more (it could move again).
        assert query(cluster, select(Workspace.move_to).where(Workspace.id == ws)) == [(None,)]
        assert _host(cluster, a)["workspaces"] == 0
        assert outcome(run_cell(cluster, client, ws, kernel, "print(x)")) == "41\n"


@pytest.mark.db_agnostic  # how the agent takes its signals; the drain's DB side is above
def test_a_second_signal_stops_the_agent_at_once(tmp_path: Path) -> None:
    with running_cluster(tmp_path, agent_args=("--drain-timeout", "120")) as cluster:
        cluster.kill_control()  # its drain requests now fail: it would wait 120 s
        agent = cluster.agents.pop("agent1")
        agent.send_signal(signal.SIGTERM)
        time.sleep(3)
        assert agent.poll() is None, "the first signal only starts the drain"
        began = time.monotonic()
        agent.send_signal(signal.SIGINT)
        assert agent.wait(30) == 0
        assert time.monotonic() - began < 15
