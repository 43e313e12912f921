"""The typed contract between the control plane and its agents (protocol/agent.py):
the orders the client sends, the answers it accepts, the agent app's refusals, and
the agent's reports, each checked on the wire."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from nbfleet.agent.app import create_agent_app
from nbfleet.agent.service import AgentConfig, AgentService, ControlReporter
from nbfleet.control.agent_client import AgentClient, BadAnswer
from nbfleet.model.errors import InvalidInput, Unavailable
from nbfleet.protocol.agent import (
    AddKernel,
    AttemptBeat,
    AttemptFinish,
    EnsureRuntime,
    Heartbeat,
    JobDirectives,
    JobHeartbeats,
    KernelDeath,
    KernelModel,
    KernelRef,
    Registration,
    ReleaseRuntime,
    RuntimeLimits,
    RuntimePlaced,
    RuntimeSuspended,
    StartJob,
    StopJob,
    SuspendRuntime,
)

BASE = "http://agent"
SECRET = "s3cret"

KERNEL = {"id": "k1", "name": "python3", "workspace_id": "ws_1",
          "last_activity": "2026-01-02T03:04:05.000006Z", "idle_s": 1.5,
          "execution_state": "idle", "connections": 0, "last_death": None}
#: A restore report as statesync writes it when no snapshot was downloaded: no
#: ``bytes``, no ``imports``.
REPORT = {"path": "cold", "restored": ["a"], "recomputed": [], "lost": [
    {"name": "sock", "type": "socket.socket", "reason": "cannot be saved"}],
    "files_only": False, "error": None, "seconds": 0.25}
START = {"job_id": "job_1", "attempt": 2, "command": ["gen", "--fast"],
         "args": {"prompt": "cat", "seed": 7, "scale": 1.5, "hd": True},
         "gpu_indices": [0, 3], "gpu_type": "A100", "timeout_s": 60, "idle_timeout_s": 30,
         "memory_mb": 4096, "kill_grace_s": 2.0, "blob_prefix": "jobs/job_1/2"}
FACTS = {"seq": 4, "gpu_ms": 1200, "exit_code": 0, "signal": None, "killed_for": None,
         "launch_error": None, "output_tail": "done\n",
         "result": [{"name": "a.png", "key": "k", "size": 3, "sha256": "ab"}], "log_chunks": 2}

ORDERS: list[BaseModel] = [
    EnsureRuntime(generation=3, kernels=[KernelRef(id="k1"), KernelRef(id="k2", name="ir")],
                  snapshot={"k1": "snap/k1"}, packages="layer/1",
                  limits=RuntimeLimits(memory_bytes=1 << 30, cpus=1.5), network="egress"),
    EnsureRuntime(generation=1),
    SuspendRuntime(generation=2, on_busy="interrupt", busy_timeout_s=5),
    ReleaseRuntime(generation=4, sync=False),
    AddKernel(generation=2, id="k3", name="python3"),
    AddKernel(generation=2, id="k4", env={"KERNEL_USERNAME": "ada"}),
    StartJob.model_validate(START),
    StopJob(attempt=2, reason="preempt", grace_s=1.0),
    Registration(id="host_1", url="http://h:1", boot_id="boot_1",
                 inventory={"millicpus": 4000, "gpus": [{"count": 2, "type": "A100"}]}),
    Heartbeat(boot_id="boot_1", kernel_deaths=[
        KernelDeath(workspace_id="ws_1", kernel_id="k1", reason="out of memory")]),
    JobHeartbeats(agent_id="host_1", boot_id="boot_1", attempts=[
        AttemptBeat(job_id="job_1", attempt=2, seq=3, gpu_ms=10, progress=0.5)]),
    AttemptFinish.model_validate({"agent_id": "host_1", "boot_id": "boot_1", **FACTS}),
]


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: type(o).__name__)
def test_every_order_and_report_survives_a_trip_through_json(order: BaseModel) -> None:
    wire = json.loads(json.dumps(order.model_dump(mode="json")))
    assert type(order).model_validate(wire) == order
    assert type(order).model_validate_json(order.model_dump_json()) == order


def test_a_job_argument_keeps_its_type_on_the_wire() -> None:
    """``1.5`` must not come back as ``"1.5"``, nor ``True`` as ``1``."""
    back = StartJob.model_validate_json(StartJob.model_validate(START).model_dump_json())
    assert back.args == {"prompt": "cat", "seed": 7, "scale": 1.5, "hd": True}
    assert [type(v) for v in back.args.values()] == [str, int, float, bool]


@pytest.mark.parametrize(("model", "fields"), [
    (EnsureRuntime, {"generation": 0}),
    (EnsureRuntime, {"generation": 1, "network": "bridge"}),
    (EnsureRuntime, {"generation": 1, "limits": {"cpus": 0}}),
    (SuspendRuntime, {"generation": 1, "on_busy": "later"}),
    (SuspendRuntime, {"generation": 1, "busy_timeout_s": 3601}),
    (StartJob, {**START, "command": []}),
    (StartJob, {**START, "memory_mb": 0}),
    (StopJob, {"attempt": 1, "reason": "bored"}),
    (AttemptFinish, {"agent_id": "h", "boot_id": "b", **FACTS, "output_tail": "x" * 20001}),
])
def test_an_order_outside_the_contract_is_refused(model: type[BaseModel],
                                                   fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(fields)


# ------------------------------------------------------------ the client
Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
async def client() -> AsyncIterator[AgentClient]:
    agents = AgentClient(SECRET)
    yield agents
    await agents.aclose()


def answering(agents: AgentClient, handler: Handler) -> list[httpx.Request]:
    """Route the client's calls to ``handler``; returns the requests it saw."""
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    agents.http = httpx.AsyncClient(transport=httpx.MockTransport(record),
                                    headers=agents.http.headers)
    return seen


async def test_the_client_sends_the_placement_order_the_agent_parses(
        client: AgentClient) -> None:
    seen = answering(client, lambda _: httpx.Response(
        200, json={"kernels": [KERNEL], "restore": {"k1": REPORT}, "packages": {}}))
    placed = await client.ensure_runtime(
        BASE, "ws_1", 3, [("k1", "python3")],
        {"kernels": {"k1": {"key": "snap/k1", "bytes": 10, "written": 10}},
         "packages": "layer/1"}, {}, None)
    [request] = seen
    assert (request.method, request.url.path) == ("PUT", "/agent/v1/runtimes/ws_1")
    body = json.loads(request.content)
    assert EnsureRuntime.model_validate(body) == EnsureRuntime(
        generation=3, kernels=[KernelRef(id="k1", name="python3")],
        snapshot={"k1": "snap/k1"}, packages="layer/1", limits=None, network="none")
    assert isinstance(placed, RuntimePlaced)
    assert placed.kernels[0].execution_state == "idle" and placed.restore["k1"].restored == ["a"]
    # What the agent left out stays out when the control plane keeps the report.
    assert placed.restore["k1"].model_dump(mode="json", exclude_unset=True) == REPORT
    assert placed.packages.model_dump(exclude_unset=True) == {}


async def test_a_release_order_goes_as_query_parameters(client: AgentClient) -> None:
    seen = answering(client, lambda _: httpx.Response(200, json={"released": True}))
    released = await client.release_runtime(BASE, "ws_1", 4)
    assert released.released is True
    assert dict(seen[0].url.params) == {"generation": "4", "sync": "true"}


async def test_an_answer_missing_a_required_field_is_refused_clearly(
        client: AgentClient) -> None:
    answering(client, lambda _: httpx.Response(200, json={"restore": {}, "packages": {}}))
    with pytest.raises(BadAnswer) as refused:
        await client.ensure_runtime(BASE, "ws_1", 1, [("k1", "python3")])
    assert "RuntimePlaced" in refused.value.detail and "kernels" in refused.value.detail
    # The agent's fault, as a 5xx would be; still a ValueError for callers that
    # caught a failed validation before.
    assert isinstance(refused.value, Unavailable) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize(("call", "answer", "field"), [
    (lambda c: c.suspend_runtime(BASE, "ws_1", 2, "wait", 30.0), {"released": True},
     "snapshot"),
    (lambda c: c.start_job(BASE, START), {"job_id": "job_1", "attempt": 2, "state": "running",
                                          "outcome_facts": None}, "pid"),
    (lambda c: c.stop_job(BASE, "job_1", 2, "cancel", 1.0), {}, "stopping"),
    (lambda c: c.kernel(BASE, "k1"), {k: v for k, v in KERNEL.items() if k != "idle_s"},
     "idle_s"),
    (lambda c: c.kernels(BASE), [{k: v for k, v in KERNEL.items() if k != "connections"}],
     "connections"),
    (lambda c: c.bindings(BASE), {"bindings": [{"kernel_id": "k1", "msg_id": "m",
                                                 "age_s": 1.0}]}, "binding"),
])
async def test_every_answer_is_checked(client: AgentClient, call: Callable[[AgentClient], Any],
                                       answer: Any, field: str) -> None:
    answering(client, lambda _: httpx.Response(200, json=answer))
    with pytest.raises(BadAnswer, match=field):
        await call(client)


async def test_a_suspend_answer_comes_back_typed(client: AgentClient) -> None:
    answer = {"released": True, "snapshot": {
        "kernels": {"k1": {"key": "snap/k1", "bytes": 10, "written": 4}},
        "packages": None, "bytes": 10, "notes": ["a running cell was interrupted to suspend"]}}
    seen = answering(client, lambda _: httpx.Response(200, json=answer))
    suspended = await client.suspend_runtime(BASE, "ws_1", 2, "interrupt", 5.0)
    assert json.loads(seen[0].content) == {"generation": 2, "on_busy": "interrupt",
                                           "busy_timeout_s": 5.0}
    assert isinstance(suspended, RuntimeSuspended) and suspended.snapshot is not None
    assert suspended.snapshot.kernels["k1"].written == 4
    assert suspended.model_dump(mode="json") == answer


async def test_an_order_outside_the_contract_is_never_sent(client: AgentClient) -> None:
    seen = answering(client, lambda _: httpx.Response(200, json={"stopping": True}))
    with pytest.raises(InvalidInput, match="StopJob"):
        await client.stop_job(BASE, "job_1", 1, "bored", 1.0)
    with pytest.raises(InvalidInput, match="EnsureRuntime"):
        await client.ensure_runtime(BASE, "ws_1", 0, [])
    assert seen == []


async def test_the_client_sends_a_kernels_variables(client: AgentClient) -> None:
    seen = answering(client, lambda _: httpx.Response(201, json=KERNEL))
    model = await client.add_kernel(BASE, "ws_1", 2, "k1", "python3",
                                    env={"KERNEL_USERNAME": "ada"})
    assert model.id == "k1"
    await client.add_kernel(BASE, "ws_1", 2, "k2", "python3")  # none: an empty object
    assert [json.loads(r.content) for r in seen] == [
        {"id": "k1", "name": "python3", "generation": 2, "env": {"KERNEL_USERNAME": "ada"}},
        {"id": "k2", "name": "python3", "generation": 2, "env": {}}]
    assert AddKernel.model_validate({"id": "k", "generation": 1}).env == {}  # older senders


# --------------------------------------------------------- the agent's app
@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, SimpleNamespace]]:
    """The agent's app over a stand-in runtime manager (its lifespan is not run)."""
    service = AgentService(AgentConfig(control_url="http://127.0.0.1:9", secret=SECRET,
                                       state_dir=str(tmp_path / "agent"), sandbox="none"))
    kernel = SimpleNamespace(model=lambda: KernelModel.model_validate(KERNEL))
    calls = SimpleNamespace(ensure=[], add_kernel=[])

    async def ensure(*args: Any) -> SimpleNamespace:
        calls.ensure.append(args)
        return SimpleNamespace(runtime=SimpleNamespace(kernels={"k1": kernel}),
                               restore={"k1": REPORT}, packages={})

    async def add_kernel(*args: Any, **kwargs: Any) -> SimpleNamespace:
        calls.add_kernel.append((args, kwargs))
        return kernel

    # A stand-in: only ensure and add_kernel are called.
    service.runtimes = SimpleNamespace(ensure=ensure, add_kernel=add_kernel)
    transport = httpx.ASGITransport(app=create_agent_app(service))
    async with httpx.AsyncClient(transport=transport, base_url=BASE,
                                 headers={"Authorization": f"Bearer {SECRET}"}) as http:
        yield http, calls


async def test_the_agent_refuses_an_order_with_a_bad_field(
        agent: tuple[httpx.AsyncClient, SimpleNamespace]) -> None:
    http, calls = agent
    refused = [
        await http.put("/agent/v1/runtimes/ws_1", json={"generation": 0}),
        await http.put("/agent/v1/runtimes/ws_1", json={"generation": 1, "network": "lan"}),
        await http.post("/agent/v1/runtimes/ws_1/suspend", json={"generation": 0}),
        await http.delete("/agent/v1/runtimes/ws_1", params={"generation": 0}),
        await http.delete("/agent/v1/runtimes/ws_1"),
        await http.post("/agent/v1/runtimes/ws_1/kernels", json={"id": "k", "generation": 0}),
        await http.post("/agent/v1/jobs", json={**START, "attempt": 0}),
        await http.post("/agent/v1/jobs/job_1/stop", json={"attempt": 1, "reason": "bored"}),
    ]
    assert [r.status_code for r in refused] == [422] * len(refused)
    assert calls.ensure == []


async def test_the_agent_answers_a_placement_as_its_runtime_reported_it(
        agent: tuple[httpx.AsyncClient, SimpleNamespace]) -> None:
    """Exactly the fields the restore set: no ``bytes: 0`` or ``imports: []`` added,
    and ``packages`` stays ``{}`` for a runtime that already existed."""
    http, calls = agent
    placed = await http.put("/agent/v1/runtimes/ws_1", json=EnsureRuntime(
        generation=2, kernels=[KernelRef(id="k1")]).model_dump(mode="json"))
    assert placed.status_code == 200
    assert placed.json() == {"kernels": [KERNEL], "restore": {"k1": REPORT}, "packages": {}}
    [(workspace_id, generation, kernels, snapshot, packages, limits, network,
      gpus, notices)] = calls.ensure
    assert (workspace_id, generation, kernels) == ("ws_1", 2, [("k1", "python3")])
    assert (snapshot, packages, limits, network, gpus, notices) == (
        {}, None, None, "none", 0, {})
    assert RuntimePlaced.model_validate(placed.json()).kernels[0].id == "k1"


async def test_the_agent_filters_a_kernels_variables_again(
        agent: tuple[httpx.AsyncClient, SimpleNamespace]) -> None:
    """Whatever the control plane let through, only KERNEL_* reaches the kernel."""
    http, calls = agent
    added = await http.post("/agent/v1/runtimes/ws_1/kernels", json={
        "id": "k1", "generation": 2, "env": {
            "KERNEL_USERNAME": "ada", "LD_PRELOAD": "/tmp/evil.so", "PYTHONSTARTUP": "/x.py",
            "BASH_ENV": "/x.sh", "kernel_x": "1", "KERNEL_BIG": "x" * 1_000_000,
            **{f"KERNEL_V{i}": "v" for i in range(1000)}}})
    assert added.status_code == 201
    [(args, kwargs)] = calls.add_kernel
    assert args == ("ws_1", 2, "k1", "python3")
    env = kwargs["env"]
    assert env["KERNEL_USERNAME"] == "ada" and len(env) == 32
    assert all(name.startswith("KERNEL_") and name != "KERNEL_BIG" for name in env)
    refused = await http.post("/agent/v1/runtimes/ws_1/kernels",
                              json={"id": "k1", "generation": 2, "env": {"KERNEL_X": 1}})
    assert refused.status_code == 422 and len(calls.add_kernel) == 1


# -------------------------------------------------- the agent's reports
async def test_the_agents_job_reports_are_the_contracts() -> None:
    seen: list[tuple[str, Any]] = []

    def control(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        if request.url.path == "/internal/jobs/heartbeats":
            return httpx.Response(200, json={"directives": [
                {"job_id": "job_1", "attempt": 2, "action": "stop", "reason": "cancel",
                 "grace_s": 3.0}]})
        return httpx.Response(200, json={"job_id": "job_1", "attempt": 2, "state": "done"})

    beat = {"job_id": "job_1", "attempt": 2, "seq": 3, "gpu_ms": 10, "progress": None,
            "log_chunks": 1}
    async with httpx.AsyncClient(transport=httpx.MockTransport(control),
                                 base_url="http://control") as http:
        reporter = ControlReporter(http, "host_1", "boot_1")
        [directive] = await reporter.heartbeat([beat])
        assert await reporter.finish("job_1", 2, FACTS)
    assert (directive.action, directive.reason, directive.grace_s) == ("stop", "cancel", 3.0)
    assert seen == [
        ("/internal/jobs/heartbeats", {"agent_id": "host_1", "boot_id": "boot_1",
                                       "attempts": [beat]}),
        ("/internal/jobs/job_1/attempts/2/finish",
         {"agent_id": "host_1", "boot_id": "boot_1", **FACTS}),
    ]
    assert JobHeartbeats.model_validate(seen[0][1]).attempts[0].seq == 3


def test_a_directive_outside_the_contract_is_refused() -> None:
    with pytest.raises(ValidationError):
        JobDirectives.model_validate({"directives": [{"job_id": "j", "action": "stop"}]})
