"""GPU notebooks across hosts: a kernel follows its cell's GPUs to another host
with its state, and the autoscaler starts and stops real agent processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from nbfleet.db.tables import Agent
from nbfleet.sdk.kernel_socket import CellResult, KernelSocket
from tests.conftest import fresh_database
from tests.integration.test_gpu_cells import fleet, funded, gpu_workspace, notices
from tests.support.cluster import (
    Cluster,
    run_cell,
    token_of,
    wait_state,
    wait_until,
)
from tests.support.credit_api import query

pytestmark = pytest.mark.timeout(400)

WHERE = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"


def host_of(client: httpx.Client, workspace_id: str) -> str:
    return str(client.get(f"/v1/workspaces/{workspace_id}").json()["host_id"])


Kernel = tuple[httpx.Client, str, str]  # (its user, workspace id, kernel id)


async def while_another_runs(cluster: Cluster, busy: Kernel, seconds: int, other: Kernel,
                             code: str) -> CellResult:
    """Run ``code`` on ``other`` while ``busy`` runs a ``seconds``-long cell that
    holds its GPU; the result of ``code``."""
    (busy_user, busy_ws, busy_kernel), (user, ws, kernel) = busy, other
    holder = await KernelSocket.connect(cluster.channels_url(busy_ws, busy_kernel),
                                        token_of(busy_user))
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(user))
    try:
        long_cell = holder.message("execute_request", {
            "code": f"import time; time.sleep({seconds})", "silent": False}, "shell")
        await holder.send(long_cell)
        await asyncio.to_thread(wait_until, lambda: fleet(cluster)["running"], 30, 0.05,
                                "the long cell running")
        result = await sock.execute(code, timeout=180)
        await holder.collect(long_cell["header"]["msg_id"], timeout=60)
        return result
    finally:
        await sock.close()
        await holder.close()


def test_a_cell_whose_gpus_are_elsewhere_moves_its_kernel_there_with_its_state(
        tmp_path: Path) -> None:
    """``batch`` binds each cell on the best-fitting host (the lowest id when both
    are free): a kernel elsewhere moves, through the blob store, keeping its
    variables and its kernel id; the notebook is told."""
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control(args=("--policy", "batch"))
            cluster.start_agent("a1")
            cluster.start_agent("a2")
            one, two = funded(cluster), funded(cluster)
            ws1, k1 = gpu_workspace(one, "one")
            ws2, k2 = gpu_workspace(two, "two")
            assert host_of(one, ws1) != host_of(two, ws2), "least loaded: one per host"
            low = min(host_of(one, ws1), host_of(two, ws2))
            # The workspace whose kernel sits on the higher id moves for its first cell.
            (mover, mws, mk), (stayer, sws, sk) = (
                ((one, ws1, k1), (two, ws2, k2)) if host_of(one, ws1) != low
                else ((two, ws2, k2), (one, ws1, k1)))
            high = host_of(mover, mws)
            first = run_cell(cluster, mover, mws, mk, "x = 41\n" + WHERE)
            assert first.status == "ok", first.reply
            assert host_of(mover, mws) == low
            assert any("moving the kernel" in text for text in notices(first))

            # The other kernel holds ``low``'s GPU; the mover's next cell gets
            # ``high``'s and moves back there with ``x``.
            moved = asyncio.run(while_another_runs(cluster, (stayer, sws, sk), 15,
                                                   (mover, mws, mk), "x += 1\nprint(x)\n" + WHERE))
            assert moved.status == "ok", moved.reply
            assert moved.stdout.split() == ["42", "0"]
            assert host_of(mover, mws) == high
            shown = notices(moved)
            assert any(f"on host {high}: the kernel moved there" in text for text in shown)
            # The kernel id survived both moves.
            kernels = mover.get(f"/v1/workspaces/{mws}/api/kernels").json()
            assert [k["id"] for k in kernels] == [mk]
            assert fleet(cluster)["totals"]["committed_gpus"] == 0
        finally:
            cluster.stop()


def agent_pids(home: Path) -> list[int]:
    """The agent processes the control plane's host provider started."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent" in cmdline and any(str(home / "hosts").encode() in arg for arg in cmdline):
            pids.append(int(proc.name))
    return pids


def test_the_autoscaler_starts_a_host_for_waiting_work_and_stops_it_after(
        tmp_path: Path) -> None:
    """Two kernels share one 1-GPU host (subscribed, as NotebookOS oversubscribes);
    when both run cells at once the demand exceeds the host: the local provider
    starts an agent process, the waiting cell's kernel moves there and runs, and the
    host is stopped once its work has ended and the scale-in delay has passed."""
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control(args=(
                "--policy", "nbfleet", "--replicas", "1", "--max-hosts", "3",
                "--host-gpus", "1xA100-80GB", "--autoscale-interval", "1",
                "--scale-in-delay", "3", "--host-agent-args", "--workspace-disk 0"))
            cluster.start_agent()
            first, second = funded(cluster), funded(cluster)
            ws1, k1 = gpu_workspace(first, "first")
            ws2, k2 = gpu_workspace(second, "second")
            original = host_of(first, ws1)
            assert host_of(second, ws2) == original, "subscribed, not committed: one host"
            assert agent_pids(cluster.home) == [], "no demand yet: no host added"

            waited = asyncio.run(while_another_runs(cluster, (first, ws1, k1), 20,
                                                    (second, ws2, k2), "y = 7\n" + WHERE))
            assert waited.status == "ok", waited.reply
            assert waited.stdout.strip() == "0"
            added = host_of(second, ws2)
            assert added != original
            # The policy's backlog rule may add more than one (its spare buffer).
            assert 1 <= len(agent_pids(cluster.home)) <= 2
            assert any("a host is being added" in text for text in notices(waited)), \
                notices(waited)
            assert fleet(cluster)["totals"]["hosts"] >= 2
            # The kernel kept its variables on the added host.
            assert run_cell(cluster, second, ws2, k2, "print(y)").stdout.strip() == "7"
            # Its work ends: the host is emptied and stopped after the delay.
            second.delete(f"/v1/workspaces/{ws2}")
            wait_state(second, ws2, "deleted")
            wait_until(lambda: agent_pids(cluster.home) == [], 90, 0.5, "the added host stopped")
            wait_until(lambda: fleet(cluster)["totals"]["hosts"] == 1, 30, 0.5,
                       "the fleet back to one host")
            # And it stays so: the released hosts, still registered until their
            # heartbeats lapse, once counted as hosts the autoscaler could not stop,
            # which raised its floor to 3 and scaled out again at once, forever.
            steady_until = time.monotonic() + 6  # six autoscaler passes
            while time.monotonic() < steady_until:
                assert (agent_pids(cluster.home), fleet(cluster)["totals"]["provisioning"]) \
                    == ([], 0), "the autoscaler scaled out again with no new demand"
                time.sleep(0.5)
            # The scale-in emptied and released the host: its agent did not drain itself
            # on the way out too (that marks a host draining, as an admin's drain does,
            # and a rebuilt model then dropped the kernels' replicas there: an endless
            # scale-out and scale-in).
            assert query(cluster, select(Agent.id).where(Agent.draining_since.is_not(None))) == []
            assert host_of(first, ws1) == original
            assert run_cell(cluster, first, ws1, k1, WHERE).stdout.strip() == "0"
        finally:
            for pid in agent_pids(cluster.home):
                os.kill(pid, signal.SIGKILL)
            cluster.stop()
