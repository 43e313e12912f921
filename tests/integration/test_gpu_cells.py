"""GPU notebooks, live: each cell of a GPU workspace binds GPUs for its duration.

A real control plane runs the scheduling policy ``nbfleet sim`` runs, one agent
declares a single virtual A100, and real kernels print what their cells see.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from nbfleet.db.credit_tables import CreditHold
from nbfleet.sdk.kernel_socket import CellResult, KernelSocket
from tests.conftest import fresh_database
from tests.support.cluster import (
    Cluster,
    run_cell,
    start_kernel,
    token_of,
    wait_state,
    wait_until,
)
from tests.support.credit_api import CREDIT, grant, key, new_tenant, query, verified

pytestmark = pytest.mark.timeout(300)

GPU = {"gpus": 1, "gpu_types": ["A100-80GB"]}
SHOW_GPUS = ("import os, subprocess\n"
             "print(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))\n"
             "print(subprocess.run(['sh', '-c', 'echo child=$NVIDIA_VISIBLE_DEVICES'],"
             " capture_output=True, text=True).stdout.strip())")


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("gpu")
    with fresh_database(root) as url:
        cluster = Cluster(root, url, gpus="1xA100-80GB")
        try:
            cluster.start_control(args=("--policy", "nbfleet", "--gpu-prices",
                                        "default=1,A100-80GB=3", "--meter-interval", "0.5"))
            cluster.start_agent()
            yield cluster
        finally:
            cluster.stop()


CREATED: list[tuple[httpx.Client, str]] = []


@pytest.fixture(autouse=True)
def delete_workspaces() -> Iterator[None]:
    """Each test leaves the one GPU free of subscriptions: the policy's
    subscription-ratio limit would (rightly) stop placing new GPU kernels. What is
    listed before the test is not this module's: other modules make workspaces with
    ``gpu_workspace`` on clusters of their own, stopped since."""
    CREATED.clear()
    yield
    while CREATED:
        client, workspace_id = CREATED.pop()
        client.delete(f"/v1/workspaces/{workspace_id}")
        wait_state(client, workspace_id, "deleted")


def funded(cluster: Cluster, credits: int = 1000) -> httpx.Client:
    """A user in a fresh org whose project holds credit (GPU cells are paid for)."""
    tenant = new_tenant(cluster)
    grant(cluster, tenant, credits * CREDIT)
    return tenant.client


def gpu_workspace(client: httpx.Client, name: str, resources: dict[str, Any] | None = None
                  ) -> tuple[str, str]:
    response = client.post("/v1/workspaces", json={"name": name, "resources": resources or GPU})
    assert response.status_code == 201, response.text
    workspace_id = response.json()["id"]
    CREATED.append((client, workspace_id))
    wait_state(client, workspace_id, "running")
    return workspace_id, start_kernel(client, workspace_id)


def fleet(cluster: Cluster) -> dict[str, Any]:
    response = cluster.admin().get("/v1/admin/fleet")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def connect(cluster: Cluster, client: httpx.Client, workspace_id: str,
                  kernel_id: str) -> KernelSocket:
    return await KernelSocket.connect(cluster.channels_url(workspace_id, kernel_id),
                                      token_of(client))


def notices(result: CellResult) -> list[str]:
    return [o["content"]["data"]["text/plain"] for o in result.outputs
            if o["msg_type"] in ("display_data", "update_display_data")
            and "nbfleet:" in o["content"]["data"].get("text/plain", "")]


def test_a_gpu_cell_sees_its_gpus_and_holds_them_only_while_it_runs(gpu_cluster: Cluster) -> None:
    client = funded(gpu_cluster)
    workspace_id, kernel_id = gpu_workspace(client, "gpu")
    body = client.get(f"/v1/workspaces/{workspace_id}").json()
    assert body["resources"]["gpus"] == 1
    result = run_cell(gpu_cluster, client, workspace_id, kernel_id, SHOW_GPUS)
    assert result.status == "ok", result.reply
    assert result.stdout.split() == ["0", "child=0"]
    # Between cells the GPU is subscribed, not committed.
    view = fleet(gpu_cluster)
    host = view["hosts"][0]
    assert workspace_id in host["kernels"]
    assert host["gpus"]["subscribed"] >= 1 and host["gpus"]["committed"] == 0
    assert view["queue"] == [] and view["running"] == []
    # A cell that is running holds it.

    async def during() -> dict[str, Any]:
        sock = await connect(gpu_cluster, client, workspace_id, kernel_id)
        try:
            request = sock.message("execute_request", {"code": "import time; time.sleep(2)",
                                                      "silent": False}, "shell")
            await sock.send(request)
            seen = await asyncio.to_thread(wait_until, lambda: fleet(gpu_cluster)["running"],
                                           20, 0.05, "a running cell")
            await sock.collect(request["header"]["msg_id"])
            return {"running": seen}
        finally:
            await sock.close()

    running = asyncio.run(during())["running"]
    assert [c["workspace_id"] for c in running] == [workspace_id]
    assert running[0]["gpu_type"] == "A100-80GB"
    assert fleet(gpu_cluster)["totals"]["committed_gpus"] == 0


def test_a_workspace_without_gpus_pays_nothing_and_sees_none(gpu_cluster: Cluster) -> None:
    client = gpu_cluster.new_user()  # no credit at all
    response = client.post("/v1/workspaces", json={"name": "cpu"})
    workspace_id = response.json()["id"]
    CREATED.append((client, workspace_id))
    wait_state(client, workspace_id, "running")
    kernel_id = start_kernel(client, workspace_id)
    result = run_cell(gpu_cluster, client, workspace_id, kernel_id, SHOW_GPUS)
    assert result.stdout.split() == ["unset", "child="]
    assert workspace_id not in fleet(gpu_cluster)["hosts"][0]["kernels"]


def test_two_workspaces_on_one_gpu_take_turns_and_the_second_is_told_why(
        gpu_cluster: Cluster) -> None:
    first = funded(gpu_cluster)
    second = funded(gpu_cluster)
    ws1, k1 = gpu_workspace(first, "one")
    ws2, k2 = gpu_workspace(second, "two")

    async def scenario() -> tuple[CellResult, CellResult, list[dict[str, Any]]]:
        a = await connect(gpu_cluster, first, ws1, k1)
        b = await connect(gpu_cluster, second, ws2, k2)
        try:
            long_cell = a.message("execute_request", {
                "code": "import os, time; time.sleep(3); print(os.environ['CUDA_VISIBLE_DEVICES'])",
                "silent": False}, "shell")
            await a.send(long_cell)
            await asyncio.to_thread(wait_until, lambda: fleet(gpu_cluster)["running"], 20, 0.05,
                                    "the first cell running")
            waiting = asyncio.create_task(b.execute(SHOW_GPUS))
            queue = await asyncio.to_thread(wait_until, lambda: fleet(gpu_cluster)["queue"], 20,
                                            0.05, "the second cell waiting")
            one = await a.collect(long_cell["header"]["msg_id"])
            two = await waiting
            return one, two, queue
        finally:
            await a.close()
            await b.close()

    one, two, queue = asyncio.run(scenario())
    assert one.stdout.strip() == "0"
    assert two.status == "ok" and two.stdout.split() == ["0", "child=0"]
    assert [q["workspace_id"] for q in queue] == [ws2]
    assert queue[0]["reason"].startswith("waiting for 1x A100-80GB")
    shown = notices(two)
    assert shown and shown[0].startswith("nbfleet: waiting for 1x A100-80GB: next in line")
    assert any("got 1x A100-80GB after waiting" in text for text in shown)
    assert fleet(gpu_cluster)["totals"]["committed_gpus"] == 0


def test_interrupting_a_waiting_cell_withdraws_it_and_the_cells_behind_it(
        gpu_cluster: Cluster) -> None:
    first = funded(gpu_cluster)
    second = funded(gpu_cluster)
    ws1, k1 = gpu_workspace(first, "busy")
    ws2, k2 = gpu_workspace(second, "waits")

    async def scenario() -> tuple[CellResult, dict[str, Any], CellResult]:
        a = await connect(gpu_cluster, first, ws1, k1)
        b = await connect(gpu_cluster, second, ws2, k2)
        try:
            long_cell = a.message("execute_request", {"code": "import time; time.sleep(4)",
                                                      "silent": False}, "shell")
            await a.send(long_cell)
            await asyncio.to_thread(wait_until, lambda: fleet(gpu_cluster)["running"], 20, 0.05,
                                    "the first cell running")
            cell = b.message("execute_request", {"code": "x = 1", "silent": False}, "shell")
            behind = b.message("execute_request", {"code": "y = 2", "silent": False}, "shell")
            await b.send(cell)
            await b.send(behind)
            await asyncio.to_thread(wait_until, lambda: fleet(gpu_cluster)["queue"], 20, 0.05,
                                    "the cell waiting")
            response = second.post(f"/v1/workspaces/{ws2}/api/kernels/{k2}/interrupt")
            assert response.status_code == 204
            cancelled = await b.collect(cell["header"]["msg_id"])
            aborted = await b.collect(behind["header"]["msg_id"], wait_for_idle=False)
            assert fleet(gpu_cluster)["queue"] == []
            await a.collect(long_cell["header"]["msg_id"])
            after = await b.execute("print('x' in dir())")
            return cancelled, aborted.reply, after
        finally:
            await a.close()
            await b.close()

    cancelled, aborted, after = asyncio.run(scenario())
    assert cancelled.status == "error" and cancelled.error_name == "KeyboardInterrupt"
    assert "did not run" in cancelled.reply["evalue"]
    assert aborted["status"] == "aborted"
    assert after.stdout.strip() == "False", "the interrupted cell must never have run"


def test_a_forged_binding_is_replaced_by_the_schedulers(gpu_cluster: Cluster) -> None:
    client = funded(gpu_cluster)
    workspace_id, kernel_id = gpu_workspace(client, "forger")

    async def forge() -> CellResult:
        sock = await connect(gpu_cluster, client, workspace_id, kernel_id)
        try:
            request = sock.message("execute_request", {"code": SHOW_GPUS, "silent": False},
                                   "shell")
            request["metadata"]["nbfleet_binding"] = {
                "task_id": "victim/cell", "host_id": "elsewhere", "gpu_indices": [5, 6, 7]}
            await sock.send(request)
            return await sock.collect(request["header"]["msg_id"])
        finally:
            await sock.close()

    result = asyncio.run(forge())
    assert result.stdout.split() == ["0", "child=0"]


def test_kill_9_of_the_control_plane_neither_loses_nor_doubles_a_gpu(tmp_path: Path) -> None:
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus="1xA100-80GB")
        try:
            cluster.start_control()
            cluster.start_agent()
            first, second = funded(cluster), funded(cluster)
            ws1, k1 = gpu_workspace(first, "holder")
            ws2, k2 = gpu_workspace(second, "next")
            CREATED.clear()  # this cluster is stopped whole at the end

            async def hold_the_gpu() -> None:
                sock = await connect(cluster, first, ws1, k1)
                request = sock.message("execute_request", {
                    "code": "import time; time.sleep(40)", "silent": False}, "shell")
                await sock.send(request)
                await asyncio.to_thread(wait_until, lambda: fleet(cluster)["running"], 20, 0.05,
                                        "the cell running")
                await sock.connection.close()  # the notebook goes away mid-cell

            asyncio.run(hold_the_gpu())
            cluster.kill_control()
            # Down longer than the agent timeout (10 s): the agent's heartbeats lapse,
            # and the host must still come back with its running cell.
            time.sleep(12)
            cluster.start_control()
            # The rebuilt model knows the GPU is busy: the agent reported the cell.
            view = wait_until(lambda: fleet_or_none(cluster), 30, 0.1, "the fleet view")
            assert [c["workspace_id"] for c in view["running"]] == [ws1]
            assert view["totals"]["committed_gpus"] == 1
            result = run_cell(cluster, second, ws2, k2, SHOW_GPUS)  # waits for the GPU
            assert result.stdout.split() == ["0", "child=0"]
            running = fleet(cluster)["running"]
            assert running == [], f"the finished cell must not stay committed: {running}"
            assert fleet(cluster)["totals"]["committed_gpus"] == 0
        finally:
            cluster.stop()


def test_each_gpu_cell_is_captured_at_its_types_price(gpu_cluster: Cluster) -> None:
    tenant = new_tenant(gpu_cluster)
    grant(gpu_cluster, tenant, 1000 * CREDIT)
    workspace_id, kernel_id = gpu_workspace(tenant.client, "metered")
    for _ in range(2):
        result = run_cell(gpu_cluster, tenant.client, workspace_id, kernel_id,
                          "import time; time.sleep(0.5)")
        assert result.status == "ok", result.reply

    def settled_cells() -> list[Any]:
        rows = query(gpu_cluster, select(CreditHold).where(
            CreditHold.project_id == tenant.project_id, CreditHold.work_id.like("cell:%")))
        done = [r[0] for r in rows if r[0].state == "settled"]
        return done if len(done) == 2 else []

    cells = wait_until(settled_cells, 30, 0.2, "two settled cell holds")
    for hold in cells:
        assert hold.work_id.startswith(f"cell:{kernel_id}/")
        assert (hold.gpu_type, hold.rate_per_gpu_hour) == ("A100-80GB", 3 * CREDIT)
        assert 500 <= hold.gpu_ms < 10_000, hold.gpu_ms  # the cell's 0.5 s on one GPU
        assert hold.captured > 0 and hold.held == 0 and hold.settle_reason == "finished"
    # Between and around cells its one standby... (nbfleet bills replicas): the kernel's
    # own hold meters its subscribed GPU at 12.5 % of the rate.
    standby = wait_until(lambda: query(gpu_cluster, select(CreditHold).where(
        CreditHold.project_id == tenant.project_id,
        CreditHold.work_id.like(f"replicas:{workspace_id}:%"))), 10, 0.2, "a standby hold")
    assert standby[0][0].rate_per_gpu_hour == 3 * CREDIT // 8
    verified(gpu_cluster)


def test_an_org_without_credit_is_told_and_its_cell_does_not_run(gpu_cluster: Cluster) -> None:
    tenant = new_tenant(gpu_cluster)
    workspace_id, kernel_id = gpu_workspace(tenant.client, "broke")
    refused = run_cell(gpu_cluster, tenant.client, workspace_id, kernel_id,
                       "open('ran.txt', 'w').write('ran')")
    assert refused.status == "error" and refused.error_name == "InsufficientCredit"
    # Whichever hold is refused first, the cell's or its kernel's standby replicas:
    evalue = refused.reply["evalue"]
    assert evalue.startswith(("no credit for this cell", "no credit for the kernel's")), evalue
    assert "the cell did not run" in evalue, evalue
    assert fleet(gpu_cluster)["totals"]["committed_gpus"] == 0
    grant(gpu_cluster, tenant, 10 * CREDIT)
    checked = wait_until(lambda: run_cell(
        gpu_cluster, tenant.client, workspace_id, kernel_id,
        "import os; print(os.path.exists('ran.txt'))").stdout.strip(), 15, 1.0,
        "a cell that runs once credit arrived")
    assert checked == "False", "the refused cell must not have run"
    verified(gpu_cluster)


def test_a_user_over_budget_is_told_and_the_cell_does_not_run(gpu_cluster: Cluster) -> None:
    """The org has credit, but its user's daily budget (hard) is spent: the cell's
    hold is refused with the budget's reason, the cell does not run, nothing is
    committed, and the ledger verifies."""
    tenant = new_tenant(gpu_cluster)
    grant(gpu_cluster, tenant, 1000 * CREDIT)
    body = {"org": tenant.org, "user": tenant.user, "period": "day", "limit": 0,
            "enforcement": "hard"}
    created = gpu_cluster.admin().post("/v1/credits/budgets", json=body, headers=key())
    assert created.status_code == 201, created.text
    workspace_id, kernel_id = gpu_workspace(tenant.client, "capped")
    refused = run_cell(gpu_cluster, tenant.client, workspace_id, kernel_id,
                       "open('ran.txt', 'w').write('ran')")
    assert refused.status == "error" and refused.error_name == "InsufficientCredit"
    evalue = refused.reply["evalue"]
    assert "budget" in evalue and "the cell did not run" in evalue, evalue
    assert fleet(gpu_cluster)["totals"]["committed_gpus"] == 0
    raised = gpu_cluster.admin().patch(f"/v1/credits/budgets/{created.json()['id']}",
                                       json={"limit": 100 * CREDIT}, headers=key())
    assert raised.status_code == 200, raised.text
    checked = wait_until(lambda: run_cell(
        gpu_cluster, tenant.client, workspace_id, kernel_id,
        "import os; print(os.path.exists('ran.txt'))").stdout.strip(), 15, 1.0,
        "a cell that runs once the budget allows it")
    assert checked == "False", "the refused cell must not have run"
    verified(gpu_cluster)


def fleet_or_none(cluster: Cluster) -> dict[str, Any] | None:
    response = cluster.admin().get("/v1/admin/fleet")
    if response.status_code != 200:
        return None
    body: dict[str, Any] = response.json()
    return body if body["hosts"] else None


def _dump(value: Any) -> str:
    return json.dumps(value, indent=1)
