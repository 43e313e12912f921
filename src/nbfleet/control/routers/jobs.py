"""``/v1/jobs``: submit, read, list, cancel, logs and results of GPU jobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, outcome_response, platform_of, token_of
from nbfleet.control.idempotency import check_key, request_fingerprint
from nbfleet.control.job_intake import JobIntake, Submission
from nbfleet.db.job_tables import Job, JobAttempt, JobEvent
from nbfleet.db.tables import Agent
from nbfleet.jobs import admission, attempts, results
from nbfleet.jobs.views import job_view
from nbfleet.model.errors import Conflict, DomainError, Forbidden, NotFound
from nbfleet.model.jobs import TERMINAL, JobState
from nbfleet.web.render import iso

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

Scalar = str | int | float | bool


class SubmitJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    binary: str = Field(min_length=1, max_length=100, description="A registered binary")
    version: str | None = Field(None, max_length=50,
                                description="Pin a version; by default stable (or a canary)")
    args: dict[str, Scalar] = Field(default_factory=dict,
                                    description="Passed as --name=value flags, e.g. prompt, "
                                                "resolution, duration, seed")
    gpus: int = Field(1, ge=1, le=64)
    gpu_types: list[str] = Field(default_factory=list, max_length=16,
                                 description="Acceptable GPU types, most preferred first")
    vram_gb: int = Field(0, ge=0, le=4096, description="VRAM floor per GPU")
    memory_mb: int | None = Field(None, description="Host memory limit of the process group")
    timeout_s: int = Field(3600, ge=1, description="Wall-clock limit per attempt")
    idle_timeout_s: int | None = Field(None, ge=1, description="No output or progress this "
                                       "long: hung (default 300 s, at most timeout_s)")
    max_attempts: int = Field(3, ge=1, le=20)
    tier: str = Field("free", max_length=20)
    preemptible: bool = False
    project: str | None = Field(None, description="Defaults to the caller's project")
    name: str | None = Field(None, max_length=200)


def _visible(session: Session, principal: Principal, job_id: str,
             for_update: bool = False) -> Job:
    query = select(Job).where(Job.id == job_id)
    if for_update:
        query = query.with_for_update()
    job = session.execute(query).scalar_one_or_none()
    if job is None or not principal.can_see(job.org_id, job.project_id):
        raise NotFound(f"no job {job_id}")
    return job


@router.post("", status_code=202, summary="Submit a GPU job (queued at once)")
async def submit_job(body: SubmitJob, request: Request) -> JSONResponse:
    """Admitted in a batch with whatever else is being submitted (``job_intake``)."""
    key = request.headers.get("idempotency-key")
    check_key(key)
    submission = Submission(
        token=token_of(request.headers, request.query_params), idempotency_key=key,
        fingerprint=request_fingerprint(request.method, request.url.path, body.model_dump()),
        project=body.project, request_id=request.headers.get("x-request-id"),
        request=admission.JobRequest(
            binary=body.binary, version=body.version, args=body.args, gpus=body.gpus,
            gpu_types=tuple(body.gpu_types), vram_gb=body.vram_gb, memory_mb=body.memory_mb,
            timeout_s=body.timeout_s, idle_timeout_s=body.idle_timeout_s,
            max_attempts=body.max_attempts, tier=body.tier, preemptible=body.preemptible,
            name=body.name))
    intake: JobIntake = request.app.state.job_intake
    reply = await intake.submit(submission)
    if reply.error is not None:
        raise reply.error
    assert reply.outcome is not None
    status, payload = reply.outcome
    return outcome_response(request, status, payload, reply.replayed)


def newest_visible(principal: Principal, limit: int, before: str | None) -> Select[Job]:
    """The caller's jobs (all of them for an admin), newest first, a keyset page of
    ``limit`` plus one (to tell whether another page follows)."""
    query = select(Job).order_by(Job.id.desc()).limit(limit + 1)
    if not principal.is_admin:
        query = query.where(Job.org_id == principal.org_id,
                            Job.project_id == principal.project_id)
    if before:
        query = query.where(Job.id < before)
    return query


@router.get("", summary="List jobs, newest first")
def list_jobs(
    request: Request,
    principal: Principal = Depends(current_principal),
    limit: int = Query(50, ge=1, le=500),
    before: str | None = Query(None, description="cursor: the last id of the previous page"),
    state: JobState | None = None,
    binary: str | None = None,
    tier: str | None = None,
) -> dict[str, Any]:
    query = newest_visible(principal, limit, before)
    if state is not None:
        query = query.where(Job.state == state)
    if binary is not None:
        query = query.where(Job.binary == binary)
    if tier is not None:
        query = query.where(Job.tier == tier)
    with platform_of(request).db.transaction(write=False) as session:
        rows = list(session.execute(query).scalars())
    page = rows[:limit]
    return {"items": [job_view(job) for job in page],
            "next": page[-1].id if len(rows) > limit else None}


@router.get("/{job_id}", summary="A job, with every attempt and its reason")
def get_job(job_id: str, request: Request,
            principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        job = _visible(session, principal, job_id)
        rows = session.execute(select(JobAttempt).where(JobAttempt.job_id == job.id)
                               .order_by(JobAttempt.attempt)).scalars()
        return job_view(job, list(rows))


@router.get("/{job_id}/events", summary="A job's state changes")
def job_events(job_id: str, request: Request,
               principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        _visible(session, principal, job_id)
        rows = session.execute(select(JobEvent).where(JobEvent.job_id == job_id)
                               .order_by(JobEvent.id)).scalars()
        return {"items": [{"attempt": e.attempt, "from": e.from_state, "to": e.to_state,
                           "reason": e.reason, "at": iso(e.created_at)} for e in rows]}


@router.post("/{job_id}/cancel", status_code=202, summary="Cancel a job in any state")
async def cancel_job(job_id: str, request: Request,
                     principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    platform = platform_of(request)

    def run() -> tuple[dict[str, Any], tuple[str, int, str] | None]:
        with platform.db.transaction() as session:
            job = _visible(session, principal, job_id, for_update=True)
            tell = attempts.cancel(session, job, platform.jobs, platform.db.now(session))
            agent = session.get(Agent, job.host_id) if tell and job.host_id else None
            stop = (agent.url, job.attempt, job.id) if agent is not None else None
            return job_view(job), stop

    view, stop = await asyncio.to_thread(run)
    if stop is not None:
        url, attempt, _ = stop
        # Best effort: the heartbeat's directive repeats it until the agent obeys.
        with contextlib.suppress(DomainError):
            await platform.agents.stop_job(url, job_id, attempt, "cancel",
                                           platform.jobs.kill_grace_s)
    platform.wake_jobs()
    return view


@router.get("/{job_id}/logs", summary="An attempt's stdout and stderr, streamed while it runs")
async def job_logs(job_id: str, request: Request,
                   principal: Principal = Depends(current_principal),
                   attempt: int | None = Query(None, ge=1, description="default: the latest"),
                   follow: bool = Query(False, description="keep streaming until it ends"),
                   ) -> Response:
    platform = platform_of(request)

    def lookup() -> tuple[int, bool]:
        with platform.db.transaction(write=False) as session:
            job = _visible(session, principal, job_id)
            number = attempt or job.attempt
            if number < 1:
                return 0, job.state in TERMINAL
            row = session.execute(select(JobAttempt).where(
                JobAttempt.job_id == job_id, JobAttempt.attempt == number)
            ).scalar_one_or_none()
            if row is None:
                raise NotFound(f"job {job_id} has no attempt {number}")
            return number, row.state == attempts.ENDED

    number, ended = await asyncio.to_thread(lookup)

    async def chunks() -> AsyncIterator[bytes]:
        sent = 0
        done = ended or number == 0
        while True:
            prefix = f"jobs/{job_id}/{number}/log"
            keys = await asyncio.to_thread(platform.blobs.list, prefix)
            for blob in keys[sent:]:
                yield await asyncio.to_thread(platform.blobs.get, f"{prefix}/{blob.key}")
            sent = max(sent, len(keys))
            if done or not follow or await request.is_disconnected():
                return
            await asyncio.sleep(0.5)
            done = (await asyncio.to_thread(lookup))[1]

    return StreamingResponse(chunks(), media_type="text/plain; charset=utf-8")


@router.get("/{job_id}/result", summary="Signed, expiring URLs of the job's output files")
def job_result(job_id: str, request: Request,
               principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    platform = platform_of(request)
    with platform.db.transaction(write=False) as session:
        job = _visible(session, principal, job_id)
        if job.state != JobState.SUCCEEDED:
            raise Conflict(f"job {job_id} has no result: it is {job.state}", state=job.state)
        base = str(request.base_url).rstrip("/")
        return results.downloads(job, platform.blobs, results.signing_key(platform.config.secret),
                                 base, time.time(), platform.jobs.result_url_ttl_s)


download = APIRouter(prefix="/v1/results", tags=["jobs"])


@download.get("/{job_id}/{attempt}/{name}", summary="Download a result file (signed URL)")
def get_result_file(job_id: str, attempt: int, name: str, request: Request,
                    expires: int = Query(...), signature: str = Query(...)) -> Response:
    """No token: the signature is the permission. 403 if it was tampered with or
    has expired; 410 once retention deleted the file."""
    platform = platform_of(request)
    results.check(results.signing_key(platform.config.secret), job_id, attempt, name, expires,
                  signature, time.time())
    with platform.db.transaction(write=False) as session:
        job = session.get(Job, job_id)
        if job is None:
            raise results.Gone("this result no longer exists")
        key = results.result_key(job, attempt, name)
    if platform.blobs.local:
        return FileResponse(platform.blobs.local_path(key), filename=name,
                            media_type="application/octet-stream")
    # S3: the object store serves the bytes, through a presigned URL that expires
    # with this one, never later (a file may be gigabytes; the control plane never
    # holds it), and makes it a download of ``name``, as FileResponse above does.
    if not platform.blobs.exists(key):
        raise NotFound(f"no such file: {key}")  # as local_path says
    left = int(expires - time.time())
    if left < 1:
        raise Forbidden("this link has expired; ask the API for a new one")
    return RedirectResponse(platform.blobs.signed_url(key, left, filename=name),
                            status_code=307)

