"""The agent's HTTP and WebSocket API. Only the control plane calls it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response, WebSocket
from prometheus_client import Gauge

from nbfleet.agent.jobs import JobSpec
from nbfleet.agent.kernel_process import KernelProcess
from nbfleet.agent.output import Client
from nbfleet.agent.service import AgentService
from nbfleet.agent.statesync import SuspendOptions
from nbfleet.agent.wire import V1_PROTOCOL, WireError, parse_client_frame
from nbfleet.model.errors import NotFound, Unauthorized, Unavailable
from nbfleet.model.limits import Limits
from nbfleet.protocol.agent import (
    AddKernel,
    AgentHealth,
    EnsureRuntime,
    JobAttempt,
    JobStatus,
    JobStopping,
    KernelModel,
    ReleaseRuntime,
    ResizeWarmPool,
    RuntimePlaced,
    RuntimeReleased,
    RuntimeSuspended,
    StartJob,
    StopJob,
    SuspendRuntime,
    WarmPoolState,
)
from nbfleet.protocol.checkpoints import StageCheckpoint, StandbyState
from nbfleet.protocol.gpu import AgentBindings
from nbfleet.protocol.kernel_env import allowed_kernel_env
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
    async def health() -> AgentHealth:
        return AgentHealth(agent_id=service.agent_id, boot_id=service.boot_id)

    # Only the fields set go out: a restore report says what its restore knew (see
    # RuntimePlaced), and the control plane keeps it as it came.
    @api.put("/runtimes/{workspace_id}", response_model_exclude_unset=True)
    async def ensure_runtime(workspace_id: str, body: EnsureRuntime) -> RuntimePlaced:
        placed = await service.manager.ensure(
            workspace_id, body.generation, [(k.id, k.name) for k in body.kernels],
            body.snapshot, body.packages,
            Limits.from_dict(body.limits.model_dump()) if body.limits else None,
            body.network, body.gpus, body.notices,
        )
        return RuntimePlaced.model_validate({
            "kernels": [k.model() for k in placed.runtime.kernels.values()],
            "restore": placed.restore, "packages": placed.packages})

    @api.post("/runtimes/{workspace_id}/suspend")
    async def suspend_runtime(workspace_id: str, body: SuspendRuntime) -> RuntimeSuspended:
        saved = await service.manager.suspend(
            workspace_id, body.generation, SuspendOptions(body.on_busy, body.busy_timeout_s)
        )
        return RuntimeSuspended.model_validate({"released": saved is not None,
                                                "snapshot": saved})

    @api.delete("/runtimes/{workspace_id}")
    async def release_runtime(workspace_id: str,
                              order: Annotated[ReleaseRuntime, Query()]) -> RuntimeReleased:
        released = await service.manager.release(workspace_id, order.generation,
                                                  sync=order.sync)
        return RuntimeReleased(released=released)

    @api.get("/standbys")
    async def list_standbys() -> dict[str, StandbyState]:
        """The workspaces kept warm here for another host, and what each holds."""
        return {ws: StandbyState.model_validate({"kernels": standby.state()})
                for ws, standby in service.manager.standbys.by_workspace.items()}

    @api.put("/standbys/{workspace_id}")
    async def keep_standby(workspace_id: str, body: EnsureRuntime) -> StandbyState:
        standby = await service.manager.keep_standby(
            workspace_id, body.generation, [(k.id, k.name) for k in body.kernels],
            body.snapshot, body.packages,
            Limits.from_dict(body.limits.model_dump()) if body.limits else None,
            body.network, body.gpus)
        return StandbyState.model_validate({"kernels": standby.state()})

    @api.post("/standbys/{workspace_id}/stage")
    async def stage_checkpoint(workspace_id: str, body: StageCheckpoint) -> StandbyState:
        standby = await service.manager.standbys.stage(
            workspace_id, body.generation, body.kernel_id, body.key, body.cell)
        return StandbyState.model_validate({"kernels": standby.state()})

    @api.delete("/standbys/{workspace_id}", status_code=204)
    async def drop_standby(workspace_id: str) -> None:
        await service.manager.drop_standby(workspace_id)

    @api.post("/runtimes/{workspace_id}/kernels", status_code=201)
    async def add_kernel(workspace_id: str, body: AddKernel) -> KernelModel:
        # Filtered again here, whatever the control plane let through: only
        # KERNEL_* variables ever reach a kernel (defense in depth).
        kernel = await service.manager.add_kernel(workspace_id, body.generation, body.id,
                                                  body.name, env=allowed_kernel_env(body.env))
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
    async def list_kernels() -> list[KernelModel]:
        return [k.model() for k in service.manager.kernels.values()]

    @api.get("/kernels/{kernel_id}")
    async def get_kernel(kernel_id: str) -> KernelModel:
        return service.manager.get_kernel(kernel_id).model()

    @api.delete("/kernels/{kernel_id}", status_code=204)
    async def delete_kernel(kernel_id: str) -> None:
        await service.manager.remove_kernel(kernel_id)

    @api.post("/kernels/{kernel_id}/interrupt", status_code=204)
    async def interrupt_kernel(kernel_id: str) -> None:
        await service.manager.get_kernel(kernel_id).interrupt()

    @api.post("/kernels/{kernel_id}/restart")
    async def restart_kernel(kernel_id: str) -> KernelModel:
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

    @api.get("/warm-pool")
    async def warm_pool() -> WarmPoolState:
        pool = service.runtimes.pool if service.runtimes is not None else None
        if pool is None:
            return WarmPoolState(target=0, ready=0)
        return WarmPoolState(target=pool.target, ready=len(pool.ready),
                             prepared=sum(1 for w in pool.ready if w.modules))

    @api.put("/warm-pool")
    async def resize_warm_pool(body: ResizeWarmPool) -> WarmPoolState:
        if service.runtimes is None:
            raise Unavailable("the agent is still starting")
        pool = service.runtimes.pool
        return WarmPoolState(target=pool.resize(body.target), ready=len(pool.ready),
                             prepared=sum(1 for w in pool.ready if w.modules))

    @api.post("/jobs")
    async def start_job(body: StartJob) -> JobStatus:
        return JobStatus.model_validate(
            await service.job_runner.start(JobSpec(**body.model_dump())))

    @api.post("/jobs/{job_id}/stop", status_code=202)
    async def stop_job(job_id: str, body: StopJob) -> JobStopping:
        return JobStopping(stopping=service.job_runner.stop(job_id, body.attempt, body.reason,
                                                            body.grace_s))

    @api.get("/jobs")
    async def list_jobs() -> list[JobAttempt]:
        return [JobAttempt.model_validate(a) for a in service.job_runner.attempts()]

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
        message = await client.take()
        if message is None:
            with contextlib.suppress(Exception):
                await websocket.close()
            return
        frame = message.frame(client.protocol)
        if isinstance(frame, str):
            await websocket.send_text(frame)
        else:
            await websocket.send_bytes(frame)
