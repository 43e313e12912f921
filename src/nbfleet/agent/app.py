"""The agent's HTTP and WebSocket API. Only the control plane calls it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response, WebSocket
from prometheus_client import Gauge
from pydantic import BaseModel, Field

from nbfleet.agent.jobs import JobSpec
from nbfleet.agent.kernel_process import Client, KernelProcess
from nbfleet.agent.service import AgentService
from nbfleet.agent.statesync import SuspendOptions
from nbfleet.agent.wire import V1_PROTOCOL, WireError, parse_client_frame
from nbfleet.model.errors import NotFound, Unauthorized
from nbfleet.model.limits import Limits
from nbfleet.protocol.gpu import AgentBindings
from nbfleet.storage.files import MAX_FILE_BYTES
from nbfleet.storage.paths import confine
from nbfleet.web.bodies import read_bounded
from nbfleet.web.credentials import is_cluster_secret
from nbfleet.web.limits import BodyLimit, BodyLimitMiddleware
from nbfleet.web.metrics import TimingMiddleware, metrics_response
from nbfleet.web.problems import bearer_token, deny_websocket, install_problem_handlers

log = logging.getLogger(__name__)

KERNELS = Gauge("nbfleet_agent_kernels", "Kernel processes on this host")
RUNTIMES = Gauge("nbfleet_agent_runtimes", "Workspace runtimes on this host")


class KernelRef(BaseModel):
    id: str
    name: str = "python3"


class LimitsBody(BaseModel):
    memory_bytes: int | None = Field(None, ge=0)
    cpus: float | None = Field(None, gt=0, le=1024)
    pids: int | None = Field(None, ge=0)
    disk_bytes: int | None = Field(None, ge=0)


class EnsureRuntime(BaseModel):
    generation: int = Field(ge=1)
    kernels: list[KernelRef] = []
    #: kernel id -> the blob key of its last complete snapshot.
    snapshot: dict[str, str] = {}
    #: The blob key of the workspace's package layer.
    packages: str | None = None
    #: The project's own limits; unset fields take the agent's defaults.
    limits: LimitsBody | None = None
    #: "egress": kernels reach the public internet; "none": no network.
    network: Literal["none", "egress"] = "none"


class Suspend(BaseModel):
    generation: int = Field(ge=1)
    on_busy: Literal["wait", "interrupt"] = "wait"
    busy_timeout_s: float = Field(30.0, ge=0, le=3600)


class AddKernel(KernelRef):
    generation: int = Field(ge=1)


class StartJob(BaseModel):
    job_id: str
    attempt: int = Field(ge=1)
    command: list[str] = Field(min_length=1)
    args: dict[str, str | int | float | bool] = {}
    gpu_indices: list[int] = []
    gpu_type: str = ""
    timeout_s: int = Field(gt=0)
    idle_timeout_s: int = Field(gt=0)
    memory_mb: int = Field(gt=0)
    kill_grace_s: float = Field(ge=0)
    blob_prefix: str


class StopJob(BaseModel):
    attempt: int = Field(ge=1)
    reason: Literal["cancel", "preempt", "stale"]
    grace_s: float = Field(10.0, ge=0, le=3600)


def create_agent_app(service: AgentService) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with service.running():
            yield

    app = FastAPI(title="nbfleet agent", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, rules=(
        BodyLimit("PUT", r"/agent/v1/runtimes/[^/]+/files/.+", MAX_FILE_BYTES),))
    app.add_middleware(TimingMiddleware, name="agent")
    install_problem_handlers(app)
    KERNELS.set_function(lambda: len(service.runtimes.kernels) if service.runtimes else 0)
    RUNTIMES.set_function(lambda: len(service.runtimes.runtimes) if service.runtimes else 0)

    def authorized(token: str | None) -> bool:
        return is_cluster_secret(token, service.config.secret)

    def require_secret(request: Request) -> None:
        if not authorized(bearer_token(request.headers.get("authorization"))):
            raise Unauthorized("agent calls need the cluster secret")

    api = APIRouter(prefix="/agent/v1", dependencies=[Depends(require_secret)])

    @api.get("/metrics")
    async def metrics() -> Response:
        return metrics_response()

    @api.get("/health")
    async def health() -> dict[str, Any]:
        return {"agent_id": service.agent_id, "boot_id": service.boot_id}

    @api.put("/runtimes/{workspace_id}")
    async def ensure_runtime(workspace_id: str, body: EnsureRuntime) -> dict[str, Any]:
        placed = await service.manager.ensure(
            workspace_id, body.generation, [(k.id, k.name) for k in body.kernels],
            body.snapshot, body.packages,
            Limits.from_dict(body.limits.model_dump()) if body.limits else None,
            body.network,
        )
        return {"kernels": [k.model() for k in placed.runtime.kernels.values()],
                "restore": placed.restore, "packages": placed.packages}

    @api.post("/runtimes/{workspace_id}/suspend")
    async def suspend_runtime(workspace_id: str, body: Suspend) -> dict[str, Any]:
        saved = await service.manager.suspend(
            workspace_id, body.generation, SuspendOptions(body.on_busy, body.busy_timeout_s)
        )
        return {"released": saved is not None, "snapshot": saved}

    @api.delete("/runtimes/{workspace_id}")
    async def release_runtime(workspace_id: str, generation: int = Query(ge=1),
                              sync: bool = True) -> dict[str, Any]:
        released = await service.manager.release(workspace_id, generation, sync=sync)
        return {"released": released}

    @api.post("/runtimes/{workspace_id}/kernels", status_code=201)
    async def add_kernel(workspace_id: str, body: AddKernel) -> dict[str, Any]:
        kernel = await service.manager.add_kernel(workspace_id, body.generation, body.id, body.name)
        return kernel.model()

    @api.put("/runtimes/{workspace_id}/files/{path:path}", status_code=204)
    async def put_file(workspace_id: str, path: str, request: Request) -> None:
        """The runtime's copy needs the bytes in memory; they are bounded as they
        arrive (413 past the file size limit), never read whole first."""
        clean = confine(path)
        data = await read_bounded(request.stream(), MAX_FILE_BYTES, clean)
        await service.manager.write_file(workspace_id, clean, data)

    @api.delete("/runtimes/{workspace_id}/files/{path:path}", status_code=204)
    async def delete_file(workspace_id: str, path: str) -> None:
        await service.manager.write_file(workspace_id, confine(path), None)

    @api.get("/kernels")
    async def list_kernels() -> list[dict[str, Any]]:
        return [k.model() for k in service.manager.kernels.values()]

    @api.get("/kernels/{kernel_id}")
    async def get_kernel(kernel_id: str) -> dict[str, Any]:
        return service.manager.get_kernel(kernel_id).model()

    @api.delete("/kernels/{kernel_id}", status_code=204)
    async def delete_kernel(kernel_id: str) -> None:
        await service.manager.remove_kernel(kernel_id)

    @api.post("/kernels/{kernel_id}/interrupt", status_code=204)
    async def interrupt_kernel(kernel_id: str) -> None:
        await service.manager.get_kernel(kernel_id).interrupt()

    @api.post("/kernels/{kernel_id}/restart")
    async def restart_kernel(kernel_id: str) -> dict[str, Any]:
        kernel = service.manager.get_kernel(kernel_id)
        await kernel.restart()
        return kernel.model()

    @api.get("/bindings")
    async def list_bindings() -> AgentBindings:
        """Every cell bound to GPUs here and not replied to yet: how a restarted
        control plane learns which GPUs are busy."""
        now = time.monotonic()
        kernels = service.runtimes.kernels.values() if service.runtimes is not None else ()
        return AgentBindings(bindings=[active for kernel in kernels
                                       for active in kernel.bindings.active(kernel.id, now)])

    @api.post("/jobs")
    async def start_job(body: StartJob) -> dict[str, Any]:
        return await service.job_runner.start(JobSpec(**body.model_dump()))

    @api.post("/jobs/{job_id}/stop", status_code=202)
    async def stop_job(job_id: str, body: StopJob) -> dict[str, Any]:
        return {"stopping": service.job_runner.stop(job_id, body.attempt, body.reason,
                                                    body.grace_s)}

    @api.get("/jobs")
    async def list_jobs() -> list[dict[str, Any]]:
        return service.job_runner.attempts()

    app.include_router(api)

    @app.websocket("/agent/v1/kernels/{kernel_id}/channels")
    async def channels(websocket: WebSocket, kernel_id: str) -> None:
        if not authorized(bearer_token(websocket.headers.get("authorization"))):
            await deny_websocket(websocket, Unauthorized("agent calls need the cluster secret"))
            return
        kernel = service.manager.kernels.get(kernel_id)
        if kernel is None:
            await deny_websocket(websocket, NotFound(f"no kernel {kernel_id} on this host"))
            return
        offered = websocket.scope.get("subprotocols") or []
        protocol = V1_PROTOCOL if V1_PROTOCOL in offered else None
        await websocket.accept(subprotocol=protocol)
        await relay(websocket, kernel, protocol)

    return app


async def relay(websocket: WebSocket, kernel: KernelProcess, protocol: str | None) -> None:
    client = kernel.attach(protocol)
    writer = asyncio.create_task(_drain(websocket, client))
    try:
        while True:
            event = await websocket.receive()
            if event["type"] == "websocket.disconnect":
                break
            data = event.get("text")
            if data is None:
                data = event.get("bytes")
            if data is None:
                continue
            try:
                message = parse_client_frame(data, protocol)
            except (WireError, ValueError) as exc:
                log.warning("ignoring a bad client frame for kernel %s: %s", kernel.id, exc)
                continue
            kernel.send_from_client(client, message)
    finally:
        kernel.detach(client)
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await writer


async def _drain(websocket: WebSocket, client: Client) -> None:
    while True:
        message = await client.queue.get()
        if message is None:
            with contextlib.suppress(Exception):
                await websocket.close()
            return
        frame = message.frame(client.protocol)
        if isinstance(frame, str):
            await websocket.send_text(frame)
        else:
            await websocket.send_bytes(frame)
