"""``/v1/credits/holds`` and ``/v1/credits/usage``: reserve, meter and settle credits.

For internal callers only (the cluster secret as bearer token, or an admin token);
ordinary users get 404. Idempotency:

* reserve, one usage report and settle run the ledger's session-level functions
  inside the ``Idempotency-Key`` transaction, so a repeat replays the stored answer.
  A hold is one per work id besides, and a report applies once per ``seq``.
* the batched ``/usage`` stores its answer under the key too, but a report that
  needs more credit than its hold has left is applied after, in its own transaction
  (the lock order of ``ledger.metering``): it is exactly-once by its ``seq``, and a
  repeat of the batch answers it ``duplicate`` once it was applied.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, idempotent_reply, platform_of
from nbfleet.control.routers.credits import RequestIdRoute, actor_of
from nbfleet.db.credit_tables import CreditHold
from nbfleet.db.tables import User
from nbfleet.ledger import audit, holds, metering, wallets
from nbfleet.ledger.metering import NEEDS_EXTENSION, UsageOutcome, UsageReport
from nbfleet.model.credits import MAX_AMOUNT
from nbfleet.model.errors import NotFound
from nbfleet.web.credentials import is_cluster_secret
from nbfleet.web.metrics import CREDIT_DECISIONS
from nbfleet.web.problems import bearer_token

#: The caller behind the cluster secret: its Idempotency-Keys and audit rows use this id.
INTERNAL = Principal("internal", "", "", is_admin=False)


def require_internal(request: Request) -> Principal:
    """The cluster secret, or an admin; anyone else finds no such routes."""
    token = bearer_token(request.headers.get("authorization"))
    if is_cluster_secret(token, platform_of(request).config.secret):
        return INTERNAL
    principal = current_principal(request)
    if not principal.is_admin:
        raise NotFound("not found")
    return principal


router = APIRouter(prefix="/v1/credits", tags=["credits"], route_class=RequestIdRoute,
                   dependencies=[Depends(require_internal)])


class ReserveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    work_id: str = Field(min_length=1, max_length=100, description="one hold per work id")
    org_id: str = Field(min_length=1, max_length=40)
    project_id: str = Field(min_length=1, max_length=40)
    user_id: str | None = Field(None, min_length=1, max_length=40)
    gpu_type: str = Field(min_length=1, max_length=40)
    rate_per_gpu_hour: int = Field(ge=0, le=MAX_AMOUNT, strict=True,
                                   description="micro-credits, fixed for the hold's life")
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="micro-credits")
    lease_s: int = Field(300, ge=1, le=holds.MAX_LEASE_S, strict=True,
                         description="released by the reaper if not reported within this")


class UsageBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seq: int = Field(ge=1, strict=True)
    gpu_ms: int = Field(ge=0, le=10**15, strict=True, description="cumulative GPU-ms")
    reported_at: AwareDatetime | None = Field(None, description="kept for the audit only")


class BatchItem(UsageBody):
    hold_id: str = Field(min_length=1, max_length=40)


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reports: list[BatchItem] = Field(min_length=1, max_length=1000)


class FinalUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seq: int = Field(ge=1, strict=True)
    gpu_ms: int = Field(ge=0, le=10**15, strict=True)


class SettleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Literal["finished", "preempted", "failed", "cancelled"]
    final: FinalUsage | None = None


def _check_tenant(session: Session, body: ReserveBody) -> None:
    """Unknown org, project or user is 404 (before any row refers to them)."""
    wallets.owner_by_ids(session, body.org_id, body.project_id)
    if body.user_id is not None:
        user = session.execute(select(User.id).where(
            User.id == body.user_id, User.org_id == body.org_id)).scalar_one_or_none()
        if user is None:
            raise NotFound(f"user {body.user_id} not found")


@router.post("/holds", status_code=201, summary="Reserve credits for a piece of work")
def reserve(body: ReserveBody, request: Request,
            principal: Principal = Depends(require_internal)) -> JSONResponse:
    """201 with a new hold; 200 with the work's existing one; 402 with ``reason``."""
    db = platform_of(request).db
    actor = actor_of(request, principal)
    hold_request = holds.HoldRequest(body.work_id, body.org_id, body.project_id, body.user_id,
                                     body.gpu_type, body.rate_per_gpu_hour, body.amount,
                                     body.lease_s)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        _check_tenant(session, body)
        hold, created = holds.reserve(session, hold_request, actor, db.now(session))
        session.flush()
        CREDIT_DECISIONS.labels("reserve", "created" if created else "replayed").inc()
        return (201 if created else 200), holds.view(hold)

    return idempotent_reply(request, principal, body.model_dump(mode="json"), action)


@router.get("/holds/{hold_id}", summary="A hold")
def get_hold(hold_id: str, request: Request) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        hold = session.get(CreditHold, hold_id)
        if hold is None:
            raise NotFound(f"hold {hold_id} not found")
        return holds.view(hold)


def _report_one(session: Session, report: UsageReport, actor: audit.Actor,
                now: Any) -> UsageOutcome:
    """One hold: the batch step, then (if it must grow) the extension in the same
    transaction; it only ever locked this hold, so the lock order is kept."""
    outcome = metering.report_batch(session, [report], actor, now)[0]
    if outcome.status == NEEDS_EXTENSION:
        outcome = metering.report_with_extension(session, report, actor, now)
    return outcome


@router.post("/holds/{hold_id}/usage", summary="Report a hold's cumulative usage")
def report_usage(hold_id: str, body: UsageBody, request: Request,
                 principal: Principal = Depends(require_internal)) -> JSONResponse:
    db = platform_of(request).db
    actor = actor_of(request, principal)
    report = UsageReport(hold_id, body.seq, body.gpu_ms, body.reported_at)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        outcome = _report_one(session, report, actor, db.now(session))
        if outcome.status == metering.NOT_FOUND:
            raise NotFound(f"hold {hold_id} not found")
        CREDIT_DECISIONS.labels("usage", outcome.status).inc()
        return 200, outcome.as_json()

    return idempotent_reply(request, principal, body.model_dump(mode="json"), action)


@router.post("/usage", summary="Report many holds' usage at once (the metering hot path)")
def report_batch(body: BatchBody, request: Request,
                 principal: Principal = Depends(require_internal)) -> JSONResponse:
    """Answers one result per report, in order: applied, exhausted, duplicate, settled
    or not_found."""
    db = platform_of(request).db
    actor = actor_of(request, principal)
    reports = [UsageReport(item.hold_id, item.seq, item.gpu_ms, item.reported_at)
               for item in body.reports]

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        outcomes = metering.report_batch(session, reports, actor, db.now(session))
        return 200, {"results": [outcome.as_json() for outcome in outcomes]}

    response = idempotent_reply(request, principal, body.model_dump(mode="json"), action)
    if response.status_code != 200:
        return response
    payload = json.loads(bytes(response.body))
    for index, result in enumerate(payload["results"]):
        if result["status"] == NEEDS_EXTENSION:
            with db.transaction() as session:
                result.update(metering.report_with_extension(
                    session, reports[index], actor, db.now(session)).as_json())
    for result in payload["results"]:
        CREDIT_DECISIONS.labels("usage", result["status"]).inc()
    return JSONResponse(payload, headers={k: v for k, v in response.headers.items()
                                          if k.lower() == "idempotent-replayed"})


class _Extend(Exception):
    """The final report needs more than the hold has: apply it apart, then settle."""


@router.post("/holds/{hold_id}/settle", summary="Release what a hold still holds, once")
def settle(hold_id: str, body: SettleBody, request: Request,
           principal: Principal = Depends(require_internal)) -> JSONResponse:
    """Captures ``final`` first if given; a settled hold answers ``replayed: true``."""
    db = platform_of(request).db
    actor = actor_of(request, principal)
    final = (UsageReport(hold_id, body.final.seq, body.final.gpu_ms)
             if body.final is not None else None)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        now = db.now(session)
        if final is not None:
            outcome = metering.report_batch(session, [final], actor, now, lock_buckets=True)[0]
            if outcome.status == NEEDS_EXTENSION:
                raise _Extend()
        hold, changed = holds.settle(session, hold_id, body.reason, actor, now)
        CREDIT_DECISIONS.labels("settle", "settled" if changed else "replayed").inc()
        return 200, {**holds.view(hold), "replayed": not changed}

    fingerprint_body = body.model_dump(mode="json")
    try:
        return idempotent_reply(request, principal, fingerprint_body, action)
    except _Extend:
        # Rare: the extension takes counters and buckets, so it gets its own
        # transaction (as in ``ledger.service.settle``); then the report is a
        # duplicate and the settle runs under the key as usual.
        assert final is not None
        with db.transaction() as session:
            metering.report_with_extension(session, final, actor, db.now(session))
        return idempotent_reply(request, principal, fingerprint_body, action)
