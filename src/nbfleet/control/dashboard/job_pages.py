"""GPU jobs in the browser: the list (newest first, keyset pages on the tenant's
index), and a job's page with its attempts, events, the tail of an attempt's log
and, once it succeeded, links to its result files (the API's signed URLs)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from sqlalchemy import select

from nbfleet.control.dashboard.pages import PAGE_SIZE, PageRoute, render, viewer
from nbfleet.control.deps import platform_of
from nbfleet.control.platform import Platform
from nbfleet.control.routers.jobs import _visible, newest_visible
from nbfleet.db.job_tables import JobAttempt, JobEvent
from nbfleet.jobs import results
from nbfleet.jobs.views import job_view
from nbfleet.model.errors import DomainError
from nbfleet.model.jobs import JobState
from nbfleet.web.render import iso

router = APIRouter(route_class=PageRoute)

#: The most of a log a page shows: its end, where failures are.
LOG_TAIL_BYTES = 64 * 1024


@router.get("/ui/jobs")
def jobs_page(request: Request, before: str | None = Query(None, max_length=64)) -> Response:
    me = viewer(request)
    principal = me.principal
    query = newest_visible(principal, PAGE_SIZE, before)
    with platform_of(request).db.transaction(write=False) as session:
        rows = list(session.execute(query).scalars())
    page = rows[:PAGE_SIZE]
    return render(request, me, "jobs.html", title="Jobs", section="jobs",
                  jobs=[job_view(job) for job in page], paged=before is not None,
                  next_before=page[-1].id if len(rows) > PAGE_SIZE else None)


def _log_tail(platform: Platform, job_id: str, attempt: int) -> tuple[str, bool]:
    """The end of an attempt's log (at most ``LOG_TAIL_BYTES``), and whether it was cut."""
    prefix = f"jobs/{job_id}/{attempt}/log"
    chunks: list[bytes] = []
    size = 0
    for blob in reversed(platform.blobs.list(prefix)):
        data = platform.blobs.get(f"{prefix}/{blob.key}")
        chunks.append(data)
        size += len(data)
        if size >= LOG_TAIL_BYTES:
            break
    text = b"".join(reversed(chunks))
    cut = len(text) > LOG_TAIL_BYTES
    return text[-LOG_TAIL_BYTES:].decode("utf-8", "replace"), cut


@router.get("/ui/jobs/{job_id}")
def job_page(job_id: str, request: Request,
             attempt: int | None = Query(None, ge=1, le=1000)) -> Response:
    me = viewer(request)
    platform = platform_of(request)
    with platform.db.transaction(write=False) as session:
        job = _visible(session, me.principal, job_id)
        attempts = list(session.execute(select(JobAttempt).where(JobAttempt.job_id == job.id)
                                        .order_by(JobAttempt.attempt)).scalars())
        events = list(session.execute(select(JobEvent).where(JobEvent.job_id == job.id)
                                      .order_by(JobEvent.id.desc()).limit(50)).scalars())
        view = job_view(job, attempts)
        downloads: dict[str, Any] | None = None
        result_note = None
        if job.state == JobState.SUCCEEDED:
            try:
                downloads = results.downloads(
                    job, platform.blobs, results.signing_key(platform.config.secret),
                    str(request.base_url).rstrip("/"), time.time(),
                    platform.jobs.result_url_ttl_s)
            except DomainError as exc:
                result_note = exc.detail
    shown = attempt or job.attempt
    log, cut = _log_tail(platform, job.id, shown) if shown >= 1 else ("", False)
    return render(request, me, "job.html", title=f"Job {job.name or job.id}", section="jobs",
                  job=view, downloads=downloads, result_note=result_note, log=log, cut=cut,
                  shown=shown,
                  events=[{"attempt": e.attempt, "from": e.from_state, "to": e.to_state,
                           "reason": e.reason, "at": iso(e.created_at)} for e in events])
