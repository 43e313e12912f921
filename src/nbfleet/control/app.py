"""The control plane's FastAPI application."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Response

from nbfleet import __version__
from nbfleet.control import credit_reaper, culler, housekeeping, job_dispatcher, leases
from nbfleet.control.dashboard import router as dashboard_router
from nbfleet.control.data_errors import install_data_error_handler
from nbfleet.control.fleet import router as fleet_router
from nbfleet.control.fleet.local_agents import local_provider
from nbfleet.control.job_intake import JobIntake
from nbfleet.control.lab import router as lab_router
from nbfleet.control.operators import require_operator
from nbfleet.control.platform import ControlConfig, Platform
from nbfleet.control.reconciler import LEASE, Reconciler
from nbfleet.control.routers import (
    admin,
    binaries,
    budgets,
    credits,
    files,
    gateway,
    holds,
    internal,
    jobs,
    workspaces,
)
from nbfleet.db.migrate import upgrade
from nbfleet.storage.files import MAX_FILE_BYTES
from nbfleet.web.apidocs import mount_api_docs
from nbfleet.web.limits import BodyLimit, BodyLimitMiddleware
from nbfleet.web.metrics import TimingMiddleware, metrics_response
from nbfleet.web.problems import install_problem_handlers
from nbfleet.web.ratelimit import RateLimitMiddleware, rate_limit, token_key

#: Request body bounds beyond the 1 MiB every other route gets: a file's content,
#: and agents' reports (a job heartbeat may list up to 10,000 attempts).
BODY_LIMITS = (
    BodyLimit("PUT", r"/v1/workspaces/[^/]+/files/.+", MAX_FILE_BYTES),
    # JupyterLab saves a whole notebook, or a file's chunk, as JSON (base64 for binary).
    BodyLimit("*", r"/w/[^/]+/api/contents(/.*)?", MAX_FILE_BYTES * 4 // 3 + 1024 * 1024),
    BodyLimit("*", r"/internal/.*", 8 * 1024 * 1024),
)


def create_app(config: ControlConfig, run_reconciler: bool = True) -> FastAPI:
    # A bad rate or storage raises here, before the database is touched.
    limit = rate_limit(config.rate_limit, config.rate_limit_storage)
    platform = Platform(config)
    upgrade(platform.db.engine)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        tasks = []
        if run_reconciler:
            platform.fleet.use_provider(local_provider(config))
            tasks = [asyncio.create_task(Reconciler(platform).run_forever()),
                     asyncio.create_task(housekeeping.run_forever(platform)),
                     asyncio.create_task(culler.run_forever(platform)),
                     asyncio.create_task(credit_reaper.run_forever(platform)),
                     asyncio.create_task(job_dispatcher.JobDispatcher(platform).run_forever())]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # Let another replica take over now.
            for lease in (LEASE, housekeeping.LEASE, culler.LEASE, job_dispatcher.LEASE):
                await asyncio.to_thread(leases.release, platform.db, lease, platform.instance_id)
            await asyncio.to_thread(job_intake.close)
            await platform.fleet.aclose()
            await platform.standbys.aclose()
            await platform.aclose()

    app = FastAPI(
        title="nbfleet",
        version=__version__,
        summary="GPU-efficient hosted notebooks and GPU jobs",
        lifespan=lifespan,
        docs_url=None,  # served from local assets by mount_api_docs
        redoc_url=None,
    )
    app.state.platform = platform
    job_intake = app.state.job_intake = JobIntake(platform)
    app.add_middleware(BodyLimitMiddleware, rules=BODY_LIMITS)
    if limit is not None:  # inside the timer, so 429s are timed and counted too
        app.add_middleware(RateLimitMiddleware, limit=limit,
                           exempt=frozenset({token_key(config.secret)}))
    app.add_middleware(TimingMiddleware, name="control")
    install_problem_handlers(app)
    install_data_error_handler(app)
    for module in (workspaces, files, gateway, admin, internal, credits, budgets, holds, jobs,
                   binaries):
        app.include_router(module.router)
    app.include_router(jobs.download)
    app.include_router(fleet_router.router)
    app.include_router(gateway.ticketed)
    app.include_router(lab_router.router)
    app.include_router(dashboard_router.router)
    mount_api_docs(app)

    @app.get("/healthz", tags=["ops"], summary="Liveness")
    async def healthz() -> dict[str, str]:  # no I/O: no worker-thread hop
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics",
             description="Bearer the cluster secret or an admin token.",
             dependencies=[Depends(require_operator)])
    def metrics() -> Response:
        return metrics_response()

    return app
