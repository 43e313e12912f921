"""A GPU workspace's kernel kept on a standby replica, and the loss of its
executor's host mid-cell: shared by the standby tests and the hosts-apart test."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from sqlalchemy import select

from nbfleet.db.tables import StandbyReplica
from nbfleet.sdk.kernel_socket import KernelSocket
from tests.support.cluster import (
    Cluster,
    agent_names,
    start_kernel,
    token_of,
    wait_state,
    wait_until,
)
from tests.support.credit_api import CREDIT, grant, new_tenant, query

GPU = {"gpus": 1, "gpu_types": ["A100-80GB"]}
#: Files kernels write reach the store within about two sync intervals (the RPO).
SYNC = ("--file-sync-interval", "0.5")
RPO_S = 1.0
#: What the promoted kernel prints after the failover (see lose_the_executor_mid_cell).
AFTER = "41 42 True False kept 200000\n"


def standbys(cluster: Cluster, ws: str) -> dict[str, Any]:
    rows = query(cluster, select(StandbyReplica).where(StandbyReplica.workspace_id == ws))
    return {row.host_id: row.staged or {} for (row,) in rows}


def agent_standbys(cluster: Cluster, host_id: str) -> dict[str, Any]:
    """What the agent itself says it keeps warm (not the control plane's record)."""
    body: dict[str, Any] = cluster.agent_api(host_id, "/agent/v1/standbys")
    return body


def workspace(client: httpx.Client, ws: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"/v1/workspaces/{ws}").json()
    return body


#: A hostile cell on the promoted kernel: for each blob in its state directory,
#: whether the kernel owns it and whether it could rewrite it. The standby's loads
#: link the agent's staged blobs there; a kernel able to change them would change
#: what the agent's next stage (linked again) holds.
TRY_THE_BLOBS = """
import json, os
folder = os.path.join(os.environ['NBFLEET_STATE_DIR'], 'blobs')
seen = []
for name in os.listdir(folder):
    path = os.path.join(folder, name)
    try:
        open(path, 'r+b').close()
        writable = True
    except OSError:
        writable = False
    try:
        os.chmod(path, 0o666)
        writable = True
    except OSError:
        pass
    seen.append({'own': os.stat(path).st_uid == os.getuid(), 'writable': writable})
print(json.dumps(seen))
"""


async def lose_the_executor_mid_cell(cluster: Cluster, client: httpx.Client, ws: str,
                                     kernel: str, executor: str,
                                     other: str) -> dict[str, Any]:
    """Two cells (the second writes early.txt), a cell running and one queued when
    the executor's agent is killed; what the running cell was answered, what the
    next cell prints on the promoted standby (:data:`AFTER` if all came back), and
    what :data:`TRY_THE_BLOBS` found there."""
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
    try:
        # big: stored as a blob file (random: it does not compress to an inline one).
        for code in ("shared = [1]\npair = (shared, shared)\nx = 41\n"
                     "big = __import__('os').urandom(200_000)",
                     "y = x + 1\nopen('early.txt', 'w').write('kept')"):
            done = await sock.execute(code)
            assert done.status == "ok", done.reply
        await asyncio.sleep(RPO_S + 1.0)  # early.txt is older than one RPO at the kill

        def staged_cell() -> int | None:
            cell = standbys(cluster, ws).get(other, {}).get(kernel, {}).get("cell")
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
            wait_until, lambda: workspace(client, ws)["state"] == "running"
            and workspace(client, ws)["host_id"] == other, 90, 0.2,
            "the workspace on the standby's host")
        after = await sock.execute("print(x, y, pair[0] is pair[1], 'queued' in dir(), "
                                   "open('early.txt').read(), len(big))", timeout=120)
        blobs = await sock.execute(TRY_THE_BLOBS, timeout=60)
        return {"lost": lost.reply, "after": after.stdout if after.status == "ok"
                else after.reply, "blobs": json.loads(blobs.stdout) if blobs.status == "ok"
                else blobs.reply}
    finally:
        await sock.close()


def replicated_workspace(cluster: Cluster) -> tuple[httpx.Client, str, str, str, str]:
    """A GPU workspace running with a kernel and a standby: client, workspace,
    kernel, executor and standby host."""
    tenant = new_tenant(cluster)
    grant(cluster, tenant, 1000 * CREDIT)
    client = tenant.client
    created = client.post("/v1/workspaces", json={"name": "apart", "resources": GPU})
    assert created.status_code == 201, created.text
    ws = created.json()["id"]
    wait_state(client, ws, "running")
    kernel = start_kernel(client, ws)
    executor = workspace(client, ws)["host_id"]
    other = next(h for h in agent_names(cluster) if h != executor)
    wait_until(lambda: other in standbys(cluster, ws), 60, 0.2, "the standby")
    return client, ws, kernel, executor, other
