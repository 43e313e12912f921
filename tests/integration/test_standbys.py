"""Standby replicas (issue 17, points 3 to 5): under a replica policy a GPU
workspace's kernel is kept warm on its other replica hosts, each cell's state is
staged there off the cell's path, and when the executor's host is killed the
kernel continues on a standby, promoted, with the last completed cell's state.
Standbys are a database record (``standby_replicas``): also run on PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from nbfleet.db.tables import StandbyReplica
from tests.conftest import fresh_database
from tests.support.cluster import (
    Cluster,
    agent_names,
    outcome,
    run_cell,
    start_kernel,
    wait_state,
    wait_until,
)
from tests.support.credit_api import CREDIT, grant, new_tenant, query

pytestmark = pytest.mark.timeout(300)

GPU = {"gpus": 1, "gpu_types": ["A100-80GB"]}


def _standbys(cluster: Cluster, ws: str) -> dict[str, Any]:
    rows = query(cluster, select(StandbyReplica).where(StandbyReplica.workspace_id == ws))
    return {row.host_id: row.staged or {} for (row,) in rows}


def _workspace(client: httpx.Client, ws: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(f"/v1/workspaces/{ws}").json()
    return body


def test_a_standby_is_kept_in_sync_and_promoted_when_the_executor_s_host_dies(
        tmp_path: Path) -> None:
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control(args=("--policy", "nbfleet", "--replicas", "2"))
            cluster.start_agent("agent1")
            cluster.start_agent("agent2")
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
            names = agent_names(cluster)
            other = next(h for h in names if h != executor)

            # A standby on the other replica host, made in the background.
            wait_until(lambda: other in _standbys(cluster, ws), 60, 0.2, "the standby")
            assert executor not in _standbys(cluster, ws)

            assert outcome(run_cell(cluster, client, ws, kernel,
                                    "shared = [1]\npair = (shared, shared)\nx = 41\n"
                                    "print('set')")) == "set\n"
            assert outcome(run_cell(cluster, client, ws, kernel,
                                    "y = x + 1\nprint(y)")) == "42\n"

            def staged_cell() -> int | None:
                cell = _standbys(cluster, ws).get(other, {}).get(kernel, {}).get("cell")
                return cell if isinstance(cell, int) else None
            # The last cell's checkpoint reaches the standby after its reply.
            wait_until(lambda: staged_cell() == 2, 30, 0.1, "cell 2 staged on the standby")

            cluster.kill_agent(names[executor])
            wait_until(lambda: _workspace(client, ws)["state"] == "running"
                       and _workspace(client, ws)["host_id"] == other, 90, 0.2,
                       "the workspace on the standby's host")
            restore = _workspace(client, ws)["restore"]
            assert restore["kernels"][kernel]["path"] == "standby", restore
            assert restore["host_lost"]["kernels"][kernel]["as_of_cell"] == 2, restore
            result = run_cell(cluster, client, ws, kernel,
                              "print(x, y, pair[0] is pair[1])")
            assert outcome(result) == "41 42 True\n", result
            # Promoted: that host is the executor now, and holds no standby of it.
            wait_until(lambda: other not in _standbys(cluster, ws), 30, 0.2,
                       "the promoted standby's record dropped")
        finally:
            cluster.stop()
