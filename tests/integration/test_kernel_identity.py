"""A kernel keeps its id while its workspace is suspended, and a client that
connects to it resumes the workspace and carries on with its variables.

jupyter_server's gateway client drops a kernel for good once its id answers 404
(measured: the next cell then ran in a new, empty kernel), so a suspended kernel
must stay listed and answer its id.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import httpx
import pytest

from nbfleet.sdk.kernel_socket import KernelSocket
from tests.support.cluster import (
    Cluster,
    create_running,
    outcome,
    run_cell,
    start_kernel,
    token_of,
    wait_state,
)

pytestmark = pytest.mark.timeout(240)

JUPYTER_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"  # what jupyter_server's gateway client parses


def kernels_of(client: httpx.Client, workspace_id: str) -> list[dict[str, object]]:
    response = client.get(f"/v1/workspaces/{workspace_id}/api/kernels")
    response.raise_for_status()
    body: list[dict[str, object]] = response.json()
    return body


def suspend(client: httpx.Client, workspace_id: str) -> None:
    response = client.post(f"/v1/workspaces/{workspace_id}/suspend", params={"wait": 60})
    assert response.status_code == 200, response.text
    assert response.json()["state"] == "suspended"


def test_a_suspended_kernel_is_listed_answers_its_id_and_wakes_on_connect(
        shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    kernel_id = start_kernel(client, workspace_id)
    assert outcome(run_cell(shared_cluster, client, workspace_id, kernel_id,
                            "counter = 41")) == ""
    suspend(client, workspace_id)

    listed = kernels_of(client, workspace_id)
    assert [(k["id"], k["execution_state"], k["connections"]) for k in listed] == [
        (kernel_id, "suspended", 0)]
    datetime.strptime(str(listed[0]["last_activity"]), JUPYTER_TIME)
    one = client.get(f"/v1/workspaces/{workspace_id}/api/kernels/{kernel_id}")
    assert one.status_code == 200 and one.json()["execution_state"] == "suspended"
    # Interrupting a kernel that runs nothing does nothing, and wakes nothing.
    assert client.post(f"/v1/workspaces/{workspace_id}/api/kernels/{kernel_id}/interrupt"
                       ).status_code == 204
    assert client.get(f"/v1/workspaces/{workspace_id}").json()["state"] == "suspended"

    # Connecting resumes the workspace; the cell waits for it and sees the variable.
    result = run_cell(shared_cluster, client, workspace_id, kernel_id, "print(counter + 1)")
    assert outcome(result) == "42\n"
    assert client.get(f"/v1/workspaces/{workspace_id}").json()["state"] == "running"
    assert [k["id"] for k in kernels_of(client, workspace_id)] == [kernel_id]


def test_another_tenant_can_neither_see_nor_wake_a_suspended_kernel(
        shared_cluster: Cluster) -> None:
    owner = shared_cluster.new_user()
    intruder = shared_cluster.new_user(org="evil", project="x")
    workspace_id = create_running(owner)
    kernel_id = start_kernel(owner, workspace_id)
    suspend(owner, workspace_id)
    base = f"/v1/workspaces/{workspace_id}/api/kernels"
    assert intruder.get(base).status_code == 404
    assert intruder.get(f"{base}/{kernel_id}").status_code == 404
    assert intruder.post(f"{base}/{kernel_id}/restart").status_code == 404
    assert intruder.delete(f"{base}/{kernel_id}").status_code == 404
    with pytest.raises(Exception, match=r"404|4404"):
        run_cell(shared_cluster, intruder, workspace_id, kernel_id, "1")
    # A made-up kernel id in the owner's own workspace is 404 too, and wakes nothing.
    assert owner.get(f"{base}/00000000-0000-0000-0000-000000000000").status_code == 404
    with pytest.raises(Exception, match=r"404|4404"):
        run_cell(shared_cluster, owner, workspace_id, "00000000-0000-0000-0000-000000000000",
                 "1")
    assert owner.get(f"/v1/workspaces/{workspace_id}").json()["desired_state"] == "suspended"


def test_a_kernel_shut_down_while_suspended_does_not_come_back(
        shared_cluster: Cluster) -> None:
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    keep = start_kernel(client, workspace_id)
    drop = start_kernel(client, workspace_id)
    suspend(client, workspace_id)
    assert client.delete(f"/v1/workspaces/{workspace_id}/api/kernels/{drop}"
                         ).status_code == 204
    assert [k["id"] for k in kernels_of(client, workspace_id)] == [keep]
    client.post(f"/v1/workspaces/{workspace_id}/resume", params={"wait": 60})
    wait_state(client, workspace_id, "running")
    assert [k["id"] for k in kernels_of(client, workspace_id)] == [keep]


def test_starting_a_kernel_in_a_suspended_workspace_resumes_it(shared_cluster: Cluster) -> None:
    """Also as Enterprise Gateway's client sends it: JSON with no Content-Type."""
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    suspend(client, workspace_id)
    response = client.post(f"/v1/workspaces/{workspace_id}/api/kernels",
                           content=b'{"name": "python3"}')
    assert response.status_code == 201, response.text
    assert response.headers["location"].endswith(response.json()["id"])
    assert client.get(f"/v1/workspaces/{workspace_id}").json()["state"] == "running"
    bad = client.post(f"/v1/workspaces/{workspace_id}/api/kernels", content=b"{not json")
    assert bad.status_code == 422 and "not valid JSON" in bad.json()["detail"]


def test_a_connection_that_only_greets_leaves_the_workspace_suspended(
        shared_cluster: Cluster) -> None:
    """JupyterLab reconnects on its own after a suspend and asks for kernel_info: an
    open tab must not undo the suspend. Its first real request wakes the workspace."""
    client = shared_cluster.new_user()
    workspace_id = create_running(client)
    kernel_id = start_kernel(client, workspace_id)
    run_cell(shared_cluster, client, workspace_id, kernel_id, "seen = 'before'")
    suspend(client, workspace_id)

    async def scenario() -> str:
        sock = await KernelSocket.connect(
            shared_cluster.channels_url(workspace_id, kernel_id), token_of(client))
        try:
            await sock.send(sock.message("kernel_info_request", {}, "shell"))
            await asyncio.sleep(4)
            state = client.get(f"/v1/workspaces/{workspace_id}").json()["state"]
            assert state == "suspended"
            return (await sock.execute("print(seen)", timeout=90)).stdout
        finally:
            await sock.close()

    assert asyncio.run(scenario()) == "before\n"
    assert client.get(f"/v1/workspaces/{workspace_id}").json()["state"] == "running"


def test_a_channel_ticket_opens_only_its_own_workspaces_kernels(shared_cluster: Cluster) -> None:
    """For clients that cannot send credentials (jupyter_server's gateway kernel
    client): the ticket in the path is the credential, and it is narrow."""
    owner = shared_cluster.new_user()
    intruder = shared_cluster.new_user(org="evil", project="x")
    mine = create_running(owner)
    kernel_id = start_kernel(owner, mine)
    other = create_running(owner)
    assert intruder.post(f"/v1/workspaces/{mine}/channel-tickets").status_code == 404
    ticket = owner.post(f"/v1/workspaces/{other}/channel-tickets").json()
    assert ticket["ws_url"].endswith(f"/v1/workspaces/{other}")

    async def connect(ws_url: str) -> str:
        sock = await KernelSocket.connect(f"{ws_url}/api/kernels/{kernel_id}/channels")
        try:
            return (await sock.execute("print('in')", timeout=60)).stdout
        finally:
            await sock.close()

    # Another workspace's ticket, a forged one: refused before anything runs.
    with pytest.raises(Exception, match=r"401|4401"):
        asyncio.run(connect(ticket["ws_url"].replace(other, mine)))
    last = ticket["ticket"][-1]
    forged = ticket["ws_url"].replace(ticket["ticket"],
                                      ticket["ticket"][:-1] + ("0" if last != "0" else "1"))
    with pytest.raises(Exception, match=r"401|4401"):
        asyncio.run(connect(forged.replace(other, mine)))
    good = owner.post(f"/v1/workspaces/{mine}/channel-tickets").json()
    assert asyncio.run(connect(good["ws_url"])) == "in\n"
    assert asyncio.run(connect(good["lab_ws_url"])) == "in\n"
