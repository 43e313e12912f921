"""Standby replicas (issue 17, points 3 to 5): under a replica policy a GPU
workspace's kernel is kept warm on its other replica hosts, each cell's state is
staged there off the cell's path, and when the executor's host is killed the
kernel continues on a standby, promoted, with the last completed cell's state.
Standbys are a database record (``standby_replicas``): also run on PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from nbfleet.db.tables import StandbyReplica
from nbfleet.sdk.kernel_socket import KernelSocket
from tests.conftest import fresh_database
from tests.support.cluster import (
    Cluster,
    agent_names,
    start_kernel,
    token_of,
    wait_state,
    wait_until,
)
from tests.support.credit_api import CREDIT, grant, new_tenant, query

pytestmark = pytest.mark.timeout(300)

GPU = {"gpus": 1, "gpu_types": ["A100-80GB"]}
#: Files kernels write reach the store within about two sync intervals (the RPO).
SYNC = ("--file-sync-interval", "0.5")
RPO_S = 1.0


def _standbys(cluster: Cluster, ws: str) -> dict[str, Any]:
    rows = query(cluster, select(StandbyReplica).where(StandbyReplica.workspace_id == ws))
    return {row.host_id: row.staged or {} for (row,) in rows}


def _agent_standbys(cluster: Cluster, host_id: str) -> dict[str, Any]:
    """What the agent itself says it keeps warm (not the control plane's record)."""
    agents = cluster.admin().get("/v1/admin/agents").json()["items"]
    url = next(a["url"] for a in agents if a["id"] == host_id)
    response = httpx.get(f"{url}/agent/v1/standbys", timeout=30,
                         headers={"Authorization": f"Bearer {cluster.secret}"})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _workspace(client: httpx.Client, ws: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"/v1/workspaces/{ws}").json()
    return body


async def _lose_the_executor_mid_cell(cluster: Cluster, client: httpx.Client, ws: str,
                                      kernel: str, executor: str,
                                      other: str) -> dict[str, Any]:
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
    try:
        for code in ("shared = [1]\npair = (shared, shared)\nx = 41",
                     "y = x + 1\nopen('early.txt', 'w').write('kept')"):
            done = await sock.execute(code)
            assert done.status == "ok", done.reply
        await asyncio.sleep(RPO_S + 1.0)  # early.txt is older than one RPO at the kill

        def staged_cell() -> int | None:
            cell = _standbys(cluster, ws).get(other, {}).get(kernel, {}).get("cell")
            return cell if isinstance(cell, int) else None
        # The last cell's checkpoint reaches the standby after its reply.
        await asyncio.to_thread(wait_until, lambda: staged_cell() == 2, 30, 0.1,
                                "cell 2 staged on the standby")
        running = sock.message("execute_request", {
            "code": "import time\ntime.sleep(120)\nz = 1", "silent": False,
            "store_history": True, "user_expressions": {}, "allow_stdin": False,
            "stop_on_error": True}, "shell")
        await sock.send(running)
        queued = sock.message("execute_request", {
            "code": "queued = 1", "silent": False, "store_history": True,
            "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}, "shell")
        await sock.send(queued)  # held by the cell gate behind the running one
        await asyncio.sleep(1.5)
        cluster.kill_agent(agent_names(cluster)[executor])
        lost = await sock.collect(running["header"]["msg_id"], timeout=30)
        behind = await sock.collect(queued["header"]["msg_id"], timeout=30,
                                    wait_for_idle=False)
        assert behind.reply["status"] == "aborted", behind.reply
        await asyncio.to_thread(
            wait_until, lambda: _workspace(client, ws)["state"] == "running"
            and _workspace(client, ws)["host_id"] == other, 90, 0.2,
            "the workspace on the standby's host")
        after = await sock.execute("print(x, y, pair[0] is pair[1], 'queued' in dir(), "
                                   "open('early.txt').read())", timeout=120)
        return {"lost": lost.reply, "after": after.stdout if after.status == "ok"
                else after.reply}
    finally:
        await sock.close()


def test_a_standby_is_kept_in_sync_and_promoted_when_the_executor_s_host_dies(
        tmp_path: Path) -> None:
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control(args=("--policy", "nbfleet", "--replicas", "2"))
            cluster.start_agent("agent1", args=SYNC)
            cluster.start_agent("agent2", args=SYNC)
            tenant = new_tenant(cluster)
            grant(cluster, tenant, 1000 * CREDIT)
            client = tenant.client
            created = client.post("/v1/workspaces", json={"name": "replicated",
                                                           "resources": GPU})
            assert created.status_code == 201, created.text
            ws = created.json()["id"]
            wait_state(client, ws, "running")
            kernel = start_kernel(client, ws)
            executor = _workspace(client, ws)["host_id"]
            other = next(h for h in agent_names(cluster) if h != executor)

            # A standby on the other replica host, made in the background.
            wait_until(lambda: other in _standbys(cluster, ws), 60, 0.2, "the standby")
            assert executor not in _standbys(cluster, ws)
            # A kernel started later is kept warm there too (the standby follows).
            second = start_kernel(client, ws)
            wait_until(lambda: set(_standbys(cluster, ws).get(other, {})) == {kernel, second},
                       30, 0.2, "the second kernel in the standby")
            assert set(_agent_standbys(cluster, other)[ws]["kernels"]) == {kernel, second}
            assert ws not in _agent_standbys(cluster, executor)

            result = asyncio.run(_lose_the_executor_mid_cell(cluster, client, ws, kernel,
                                                             executor, other))
            # The running cell was answered at once; the notebook stayed connected, and
            # its next cell ran on the promoted standby with the last cell's state.
            assert result["lost"]["status"] == "error", result
            assert result["lost"]["ename"] == "HostLost", result
            assert result["after"] == "41 42 True False kept\n", result
            restore = _workspace(client, ws)["restore"]
            assert restore["kernels"][kernel]["path"] == "standby", restore
            facts = restore["host_lost"]["kernels"][kernel]
            assert (facts["as_of_cell"], facts["interrupted"]) == (2, 1), facts
            # Promoted: that host is the executor now, and holds no standby of it.
            wait_until(lambda: other not in _standbys(cluster, ws), 30, 0.2,
                       "the promoted standby's record dropped")
        finally:
            cluster.stop()


def test_a_standby_whose_host_dies_is_made_again_on_another_host(tmp_path: Path) -> None:
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control(args=("--policy", "nbfleet", "--replicas", "2"))
            for name in ("agent1", "agent2", "agent3"):
                cluster.start_agent(name)
            tenant = new_tenant(cluster)
            client = tenant.client
            created = client.post("/v1/workspaces", json={"name": "r", "resources": GPU})
            assert created.status_code == 201, created.text
            ws = created.json()["id"]
            wait_state(client, ws, "running")
            start_kernel(client, ws)
            executor = _workspace(client, ws)["host_id"]
            wait_until(lambda: len(_standbys(cluster, ws)) == 1, 60, 0.2, "the standby")
            (first,) = _standbys(cluster, ws)
            spare = next(h for h in agent_names(cluster) if h not in (executor, first))

            cluster.kill_agent(agent_names(cluster)[first])
            # Once the host is declared dead (10 s without heartbeats), the policy puts
            # the kernel's replica on the spare host, and a standby is made there.
            wait_until(lambda: set(_standbys(cluster, ws)) == {spare}, 90, 0.5,
                       "the standby made again on the spare host")
            # The executor was not disturbed.
            assert _workspace(client, ws)["host_id"] == executor
            assert _workspace(client, ws)["state"] == "running"
            assert ws in _agent_standbys(cluster, spare)
            # A drained host keeps no standby: the record goes, and so does the
            # standby on the agent itself.
            drained = cluster.admin().post(f"/v1/admin/hosts/{spare}/drain")
            assert drained.status_code in (200, 202), drained.text
            wait_until(lambda: ws not in _agent_standbys(cluster, spare)
                       and spare not in _standbys(cluster, ws), 30, 0.2,
                       "the standby dropped on the drained host")
        finally:
            cluster.stop()
