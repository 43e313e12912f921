"""The truth after a crash: a host killed mid-cell, while the cell appends to a file
every 0.1 s, comes back (the same host, a new boot), and the restore report, the
notebook and the workspace's events say which cell's state and which moment's
files it came back to, and that what was written after is lost.

Measured before (issue 27, point 8): the running cell's recent writes were missing
after the restart, and the workspace's events said only "host restarted".
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.conftest import running_cluster
from tests.support.cluster import (
    Cluster,
    create_running,
    start_kernel,
    token_of,
    wait_state,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

SYNC_S = 0.5
AGENT_ARGS = ("--file-sync-interval", str(SYNC_S))


def _at(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()


async def _cells_then_kill(cluster: Cluster, client: httpx.Client, ws: str,
                           kernel: str) -> float:
    """Two cells; then one that appends a line every 0.1 s, and the host is killed
    while it runs. Returns when that cell began writing (the wall clock)."""
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
    try:
        for code in ("x = 41", "open('early.txt', 'w').write('written early')"):
            assert (await sock.execute(code)).status == "ok"
        await asyncio.to_thread(wait_until, lambda: client.get(
            f"/v1/workspaces/{ws}/files/early.txt").status_code == 200, 30,
            what="early.txt in the store")
        await asyncio.sleep(4 * SYNC_S)  # a heartbeat reports every file synced
        began = time.time()
        await sock.send(sock.message("execute_request", {
            "code": "import time\nfor i in range(600):\n"
                    "    open('appended.txt', 'a').write(f'{i}\\n')\n    time.sleep(0.1)",
            "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True}, "shell"))
        await asyncio.sleep(3.0)  # the file keeps changing: never settled, never synced
        cluster.kill_agent("agent1")  # the host dies, kernels with it
        return began
    finally:
        await sock.close()


async def _notice(cluster: Cluster, client: httpx.Client, ws: str, kernel: str) -> str:
    """What the platform told the notebook on its own (stream output with no parent)."""
    sock = await KernelSocket.connect(cluster.channels_url(ws, kernel), token_of(client))
    try:
        request = sock.message("execute_request", {
            "code": "print(x + 1, open('early.txt').read())", "silent": False,
            "store_history": True, "user_expressions": {}, "allow_stdin": False,
            "stop_on_error": True}, "shell")
        await sock.send(request)
        told, printed, done = [], [], False
        while not done:
            msg = await sock.receive(60)
            parent = msg.get("parent_header", {}).get("msg_id")
            if msg["msg_type"] == "stream" and not parent:
                told.append(msg["content"]["text"])
            elif parent == request["header"]["msg_id"] and msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            done = (parent == request["header"]["msg_id"] and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle")
        assert "".join(printed) == "42 written early\n", printed
        return "".join(told)
    finally:
        await sock.close()


def test_the_report_after_a_crash_names_the_cell_and_the_files_it_came_back_to(
        tmp_path: Path) -> None:
    with running_cluster(tmp_path, agent_args=AGENT_ARGS) as cluster:
        client = cluster.new_user()
        ws = create_running(client)
        kernel = start_kernel(client, ws)
        began = asyncio.run(_cells_then_kill(cluster, client, ws, kernel))
        cluster.start_agent(args=AGENT_ARGS)  # the same host, a new boot
        wait_state(client, ws, "running", timeout=90)

        told = asyncio.run(_notice(cluster, client, ws, kernel))
        assert "was lost" in told and "host restarted" in told, told
        assert "come from the state saved after cell [2]" in told, told
        assert "Its files are as the store held them at" in told, told
        assert "what its kernels wrote after that is lost" in told, told

        body: dict[str, Any] = client.get(f"/v1/workspaces/{ws}").json()
        lost = body["restore"]["host_lost"]
        assert lost["reason"] == "host restarted", lost
        assert lost["kernels"][kernel]["as_of_cell"] == 2, lost
        # The files came back as they were before the appending cell began: the
        # store never had a settled appended.txt.
        assert lost["files_as_of"] is not None, lost
        assert _at(lost["files_as_of"]) <= began + 0.5, (lost, began)
        assert _at(lost["files_as_of"]) >= began - 30, (lost, began)

        events = client.get(f"/v1/workspaces/{ws}/events").json()["items"]
        back = [e["reason"] for e in events if "back after the loss" in (e["reason"] or "")]
        assert back, [e["reason"] for e in events]
        assert "(host restarted)" in back[-1] and "variables as after cell [2]" in back[-1]
        assert "files as saved at" in back[-1] and "later writes lost" in back[-1], back
