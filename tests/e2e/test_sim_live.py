"""One policy core, proven: a trace replayed through ``nbfleet sim`` and through the
live platform gives the same decisions.

The simulator runs the trace first (``tests/support/equivalence.py``) and records
every call it makes into the policy, in order: hosts joining, warm containers
ready, sessions opening and closing, cells submitted and finished. The live
platform (a real control plane, four agents with one virtual A100 each and a
local host provider for scale-out, real kernels) is then driven through the same
events in the same order: a session is a GPU workspace with a kernel; a cell is an
``execute_request`` whose code waits on ``input()``, so that it ends exactly when
the trace says (the driver answers its ``input_request``); a host that the
simulator adds is one the live autoscaler starts. Time is compressed to order:
the driver performs an event only when the control plane has acted on the one
before (its decision log, ``/v1/admin/fleet/decisions``, and fleet view say so).

Every decision is compared, with live names mapped to the trace's: which hosts
each kernel is placed on, which host runs each cell and by which path, which
cells wait, which kernels migrate, which cell triggers a scale-out, and every
prewarm.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from nbfleet.control.fleet.sizing import FleetSettings, sized_policy
from nbfleet.model.resources import inventory_from_json
from nbfleet.sdk.kernel_socket import KernelSocket
from tests.conftest import fresh_database
from tests.support.cluster import Cluster, token_of
from tests.support.credit_api import CREDIT, grant, new_tenant
from tests.support.equivalence import GPU_TYPE, Step, simulate, small_trace

#: Minutes long, and the database is not what it tests: once, on SQLite, is enough.
pytestmark = [pytest.mark.timeout(900), pytest.mark.db_agnostic]

STATIC_HOSTS = 4
HOST_GPUS = f"1x{GPU_TYPE}"
#: Long enough that no autoscaler pass falls inside the trace, on either side.
NO_TICKS = "86400"
#: The live side's wait for one event's effects (a kernel move takes seconds).
STEP_TIMEOUT_S = 120.0


def settings(policy: str) -> FleetSettings:
    return FleetSettings(policy=policy, host_gpus=HOST_GPUS, max_hosts=STATIC_HOSTS + 1,
                         autoscale_interval_s=float(NO_TICKS), scale_in_delay_s=float(NO_TICKS))


@pytest.mark.parametrize("policy", ["notebookos", "nbfleet"])
def test_the_live_platform_decides_exactly_as_the_simulator(tmp_path: Path, policy: str) -> None:
    with fresh_database(tmp_path) as url:
        cluster = Cluster(tmp_path, url, gpus=HOST_GPUS)
        try:
            cluster.start_control(args=(
                "--policy", policy, "--max-hosts", str(STATIC_HOSTS + 1),
                "--host-gpus", HOST_GPUS, "--autoscale-interval", NO_TICKS,
                "--scale-in-delay", NO_TICKS, "--host-agent-args", "--workspace-disk 0",
                "--prewarm", "-1"))  # the policy's own, as the simulator's
            names = [f"host-{n:05d}" for n in range(1, STATIC_HOSTS + 1)]
            for name in names:  # named as the simulator names its hosts
                (tmp_path / name).mkdir()
                (tmp_path / name / "agent-id").write_text(name)
                cluster.start_agent(name)
            inventories = {a["id"]: inventory_from_json(a["inventory"])
                           for a in cluster.admin().get("/v1/admin/agents").json()["items"]}
            hosts = [(name, inventories[name]) for name in names]
            steps = simulate(small_trace(), sized_policy(settings(policy),
                                                         [inv for _, inv in hosts],
                                                         STATIC_HOSTS), hosts)
            kinds = {d["kind"] for s in steps for d in s.decisions}
            # The trace exercises what the comparison is about.
            assert {"Placed", "Started", "Queued", "Migrated", "ScaleOut", "Prewarm"} <= kinds
            asyncio.run(Replay(cluster, steps, names).run())
        finally:
            cluster.stop()


class Replay:
    def __init__(self, cluster: Cluster, steps: list[Step], hosts: list[str]) -> None:
        self.cluster, self.steps = cluster, steps
        tenant = new_tenant(cluster)
        grant(cluster, tenant, 100_000 * CREDIT)
        self.user = tenant.client
        self.token = token_of(self.user)
        self.http = httpx.AsyncClient(base_url=cluster.url, timeout=60.0,
                                      headers={"Authorization": f"Bearer {token_of(self.user)}"})
        self.admin = httpx.AsyncClient(base_url=cluster.url, timeout=60.0,
                                       headers={"Authorization":
                                                f"Bearer {cluster.admin_token}"})
        #: live name -> trace name, for hosts, kernels (workspaces) and cells.
        self.names: dict[str, str] = {name: name for name in hosts}
        self.workspaces: dict[str, str] = {}  # session -> workspace id
        self.sockets: dict[str, KernelSocket] = {}
        self.kernel_ids: dict[str, str] = {}  # session -> jupyter kernel id
        self.cells: dict[str, dict[str, Any]] = {}  # trace cell -> its execute_request
        self.inputs: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.replies: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.readers: list[asyncio.Task[None]] = []
        self.cursor = -1

    async def run(self) -> None:
        try:
            for index, step in enumerate(self.steps):
                await self.perform(step)
                live = await self.decisions(len(step.decisions), step)
                if live != step.decisions:
                    before = self.steps[index - 1].hosts if index else {}
                    raise AssertionError(
                        f"step {index} {step.event}: the live platform decided\n  {live}\n"
                        f"where the simulator decided\n  {step.decisions}\n"
                        f"live hosts now: {await self.host_state()}\n"
                        f"simulated hosts before the step: {before}")
            # Nothing more was decided than the simulator did.
            await asyncio.sleep(1.0)
            extra = await self.decisions(0, None)
            assert extra == [], f"the live platform decided more: {extra}"
        finally:
            for task in self.readers:
                task.cancel()
            for sock in self.sockets.values():
                with contextlib.suppress(Exception):
                    await sock.close()
            await self.http.aclose()
            await self.admin.aclose()

    # ------------------------------------------------------------- the events
    async def perform(self, step: Step) -> None:
        kind, *args = step.event
        if kind == "host":
            await self.host_joined(args[0])
        elif kind == "prewarmed":
            await self.until(lambda view: self.warm(view, args[0]) == step.warm[args[0]],
                             f"warm containers ready on {args[0]}")
        elif kind == "tick":
            assert step.decisions == [], "the trace must not depend on autoscaler passes"
            # The simulator's only pass is at its start; the live one's first waits for
            # hosts to report (the agent timeout). Here, not in the middle of the trace
            # where the state may call for a host: the pass is one event, as simulated.
            await self.until(lambda view: view["autoscaler_passes"] >= 1,
                             "the autoscaler's first pass")
        elif kind == "open":
            await self.open(args[0])
        elif kind == "submit":
            await self.submit(args[0])
        elif kind == "finish":
            await self.finish(args[0])
        elif kind == "close":
            await self.close(args[0])
        else:
            raise AssertionError(f"unknown event {step.event}")

    async def host_joined(self, name: str) -> None:
        if name in self.names:  # one of the cluster's own hosts: it joined already
            return

        def added(view: dict[str, Any]) -> str | None:
            new = [h["id"] for h in view["hosts"] if h["id"] not in self.names]
            return new[0] if new else None

        live = await self.until(added, f"the autoscaler's host {name}")
        self.names[live] = name

    async def open(self, session: str) -> None:
        response = await self.http.post("/v1/workspaces", json={
            "name": session, "resources": {"gpus": 1, "gpu_types": [GPU_TYPE]}})
        assert response.status_code == 201, response.text
        workspace_id = response.json()["id"]
        self.workspaces[session] = workspace_id
        self.names[workspace_id] = session

        async def running() -> bool:
            body = (await self.http.get(f"/v1/workspaces/{workspace_id}")).json()
            return bool(body["state"] == "running")

        await poll(running, f"{session} running")
        started = await self.http.post(f"/v1/workspaces/{workspace_id}/api/kernels", json={})
        assert started.status_code == 201, started.text
        kernel_id = started.json()["id"]
        self.kernel_ids[session] = kernel_id
        sock = await KernelSocket.connect(self.cluster.channels_url(workspace_id, kernel_id),
                                          self.token)
        self.sockets[session] = sock
        self.readers.append(asyncio.create_task(self.read(sock)))

    async def submit(self, cell: str) -> None:
        session = cell.split("/")[0]
        sock = self.sockets[session]
        request = sock.message("execute_request", {
            "code": "input()", "silent": False, "store_history": True,
            "user_expressions": {}, "allow_stdin": True, "stop_on_error": True}, "shell")
        msg_id = request["header"]["msg_id"]
        loop = asyncio.get_running_loop()
        self.inputs[msg_id], self.replies[msg_id] = loop.create_future(), loop.create_future()
        self.cells[cell] = request
        self.names[f"{self.kernel_ids[session]}/{msg_id}"] = cell
        await sock.send(request)

    async def finish(self, cell: str) -> None:
        request = self.cells[cell]
        msg_id = request["header"]["msg_id"]
        sock = self.sockets[cell.split("/")[0]]
        asked = await asyncio.wait_for(self.inputs[msg_id], STEP_TIMEOUT_S)
        answer = sock.message("input_reply", {"value": ""}, "stdin")
        answer["parent_header"] = asked["header"]
        await sock.send(answer)
        reply = await asyncio.wait_for(self.replies[msg_id], STEP_TIMEOUT_S)
        assert reply["content"]["status"] == "ok", reply["content"]
        live_cell = f"{self.kernel_ids[cell.split('/')[0]]}/{msg_id}"
        await self.until(lambda view: all(r["cell"] != live_cell for r in view["running"]),
                         f"{cell} released")

    async def close(self, session: str) -> None:
        workspace_id = self.workspaces[session]
        await self.sockets.pop(session).close()
        response = await self.http.delete(f"/v1/workspaces/{workspace_id}")
        assert response.status_code in (200, 202, 204), response.text
        await self.until(lambda view: all(workspace_id not in h["kernels"]
                                          for h in view["hosts"]),
                         f"{session}'s kernel closed")

    async def read(self, sock: KernelSocket) -> None:
        while True:
            msg = await sock.receive(timeout=3600)
            parent = msg.get("parent_header", {}).get("msg_id")
            kind = msg.get("msg_type")
            waiting = (self.inputs if kind == "input_request"
                       else self.replies if kind == "execute_reply" else {})
            if parent in waiting and not waiting[parent].done():
                waiting[parent].set_result(msg)

    # ------------------------------------------------------------ observation
    async def view(self) -> dict[str, Any]:
        response = await self.admin.get("/v1/admin/fleet")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def until(self, predicate: Any, what: str) -> Any:
        async def check() -> Any:
            return predicate(await self.view())

        return await poll(check, what)

    async def host_state(self) -> dict[str, tuple[list[str], int]]:
        view = await self.view()
        return {self.names.get(h["id"], h["id"]): (
            sorted(self.names.get(k, k) for k in h["kernels"]), h["gpus"]["committed"])
            for h in view["hosts"]}

    def warm(self, view: dict[str, Any], name: str) -> int:
        for host in view["hosts"]:
            if self.names.get(host["id"], host["id"]) == name:
                return int(host["warm"])
        return -1

    async def decisions(self, count: int, step: Step | None) -> list[dict[str, Any]]:
        """The next ``count`` live decisions (waiting for them), in the trace's names;
        with ``count`` 0, whatever else there is."""
        got: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STEP_TIMEOUT_S
        while True:
            response = await self.admin.get("/v1/admin/fleet/decisions", params={
                "after": self.cursor, "limit": max(1, count - len(got)) if count else 1000})
            assert response.status_code == 200, response.text
            for item in response.json()["items"]:
                self.cursor = item["seq"]
                got.append(self.rename(item))
            if len(got) >= count or loop.time() > deadline:
                return got
            await asyncio.sleep(0.05)

    def rename(self, item: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in item.items():
            if key in ("seq", "at_s"):
                continue
            if isinstance(value, str):
                value = self.names.get(value, value)
            elif isinstance(value, list):
                value = [self.names.get(v, v) if isinstance(v, str) else v for v in value]
            out[key] = value
        return out


async def poll(check: Any, what: str, timeout: float = STEP_TIMEOUT_S) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = await check()
        if result:
            return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)

