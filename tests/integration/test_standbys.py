"""Standby replicas (issue 17, points 3 to 5): under a replica policy a GPU
workspace's kernel is kept warm on its other replica hosts, each cell's state is
staged there off the cell's path, and when the executor's host is killed the
kernel continues on a standby, promoted, with the last completed cell's state.
Standbys are a database record (``standby_replicas``): also run on PostgreSQL."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

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
from tests.support.credit_api import new_tenant
from tests.support.standby_cluster import (
    AFTER,
    GPU,
    SYNC,
    agent_standbys,
    lose_the_executor_mid_cell,
    replicated_workspace,
    standbys,
    workspace,
)

pytestmark = pytest.mark.timeout(300)


async def _run_cell(cluster: Cluster, client: httpx.Client, ws: str, kernel: str,
                    code: str) -> None:
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
    try:
        done = await sock.execute(code)
        assert done.status == "ok", done.reply
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
            # A standby on the other replica host, made in the background.
            client, ws, kernel, executor, other = replicated_workspace(cluster)
            assert executor not in standbys(cluster, ws)
            # A kernel started later is kept warm there too (the standby follows).
            second = start_kernel(client, ws)
            # A cell in it at once: its checkpoint can reach the control plane before
            # the standby has the kernel (that stage is refused), and the standby then
            # made with the checkpoint's key knows no cell. The keeper sends it on.
            asyncio.run(_run_cell(cluster, client, ws, second, "v = 1"))
            wait_until(lambda: standbys(cluster, ws).get(other, {}).get(second, {})
                       .get("cell") == 1, 30, 0.2, "the second kernel's cell staged")
            assert set(standbys(cluster, ws)[other]) == {kernel, second}
            assert set(agent_standbys(cluster, other)[ws]["kernels"]) == {kernel, second}
            assert ws not in agent_standbys(cluster, executor)

            result = asyncio.run(lose_the_executor_mid_cell(cluster, client, ws, kernel,
                                                             executor, other))
            # The running cell was answered at once; the notebook stayed connected, and
            # its next cell ran on the promoted standby with the last cell's state.
            assert result["lost"]["status"] == "error", result
            assert result["lost"]["ename"] == "HostLost", result
            assert result["after"] == AFTER, result
            # The agent's blobs linked into the kernel's state stay read-only to it.
            assert isinstance(result["blobs"], list), result
            assert not [b for b in result["blobs"] if not b["own"] and b["writable"]], result
            if os.geteuid() == 0:  # the kernel runs as a uid of its own: linked, not copied
                assert [b for b in result["blobs"] if not b["own"]], result
            restore = workspace(client, ws)["restore"]
            assert restore["kernels"][kernel]["path"] == "standby", restore
            # Its values were in memory before the promotion: loaded after each cell.
            assert restore["kernels"][kernel]["preloaded"] is True, restore
            assert {"x", "y", "shared", "pair", "big"} <= set(
                restore["kernels"][kernel]["restored"]), restore
            facts = restore["host_lost"]["kernels"][kernel]
            assert (facts["as_of_cell"], facts["interrupted"]) == (2, 1), facts
            # Promoted: that host is the executor now, and holds no standby of it.
            wait_until(lambda: other not in standbys(cluster, ws), 30, 0.2,
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
            executor = workspace(client, ws)["host_id"]
            wait_until(lambda: len(standbys(cluster, ws)) == 1, 60, 0.2, "the standby")
            (first,) = standbys(cluster, ws)
            spare = next(h for h in agent_names(cluster) if h not in (executor, first))

            cluster.kill_agent(agent_names(cluster)[first])
            # Once the host is declared dead (10 s without heartbeats), the policy puts
            # the kernel's replica on the spare host, and a standby is made there.
            wait_until(lambda: set(standbys(cluster, ws)) == {spare}, 90, 0.5,
                       "the standby made again on the spare host")
            # The executor was not disturbed.
            assert workspace(client, ws)["host_id"] == executor
            assert workspace(client, ws)["state"] == "running"
            assert ws in agent_standbys(cluster, spare)
            # A drained host keeps no standby: the record goes, and so does the
            # standby on the agent itself.
            drained = cluster.admin().post(f"/v1/admin/hosts/{spare}/drain")
            assert drained.status_code in (200, 202), drained.text
            wait_until(lambda: ws not in agent_standbys(cluster, spare)
                       and spare not in standbys(cluster, ws), 30, 0.2,
                       "the standby dropped on the drained host")
        finally:
            cluster.stop()
