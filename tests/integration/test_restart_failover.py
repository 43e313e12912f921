"""A kernel restarted before its host is lost comes back empty, as the user left it.

The user's restart clears the kernel's variables on purpose. The checkpoint of the
cell before it must not bring them back when the host is lost before the next
cell: the restart is recorded as "nothing saved" (``agent/checkpoints.py``,
``failover.record_checkpoint``) and the notebook is told why nothing came back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.conftest import running_cluster
from tests.integration.test_failover import _check, _workspace
from tests.support.cluster import (
    agent_names,
    kernel_then_second_host,
    outcome,
    run_cell,
    wait_until,
)


def _saved(client: httpx.Client, ws: str) -> dict[str, object]:
    """The snapshot summary: ``kernels`` (those with a state to restore), ``cells``."""
    return dict(_workspace(client, ws)["snapshot"] or {})


@pytest.mark.db_agnostic  # the fencing of a restart's report is a unit test's
def test_a_kernel_restarted_before_its_host_is_lost_comes_back_empty(tmp_path: Path) -> None:
    with running_cluster(tmp_path) as cluster:
        client = cluster.new_user()
        ws, kernel, a, b = kernel_then_second_host(cluster, client, "restarted")

        assert outcome(run_cell(cluster, client, ws, kernel, "x = 41\nprint(x)")) == "41\n"
        wait_until(lambda: (_saved(client, ws).get("cells") or {}).get(kernel) == 1, 30,
                   what="the checkpoint of cell 1")
        restarted = client.post(f"/v1/workspaces/{ws}/api/kernels/{kernel}/restart")
        assert restarted.status_code == 200, restarted.text
        # The restart is recorded: the kernel has no state to restore any more.
        wait_until(lambda: kernel not in (_saved(client, ws).get("kernels") or []), 30,
                   what="the restart recorded")

        cluster.kill_agent(agent_names(cluster)[a])
        wait_until(lambda: _workspace(client, ws)["state"] == "running"
                   and _workspace(client, ws)["host_id"] == b, 90,
                   what="the workspace running on the other host")
        stdout, told = asyncio.run(_check(cluster, client, ws, kernel, "print('x' in dir())"))
        assert stdout == "False\n", (stdout, told)  # the user's restart cleared it
        assert f"({a}) was lost" in told and f"restarted on {b}" in told, told
        assert "had been restarted before the host was lost" in told, told
        assert "no variables to bring back" in told and "cell [" not in told, told

        restore = _workspace(client, ws)["restore"]
        assert restore is not None and restore["host_lost"]["host"] == a, restore
        facts = restore["host_lost"]["kernels"][kernel]
        assert facts["state"] == "restarted" and facts["as_of_cell"] is None, facts
