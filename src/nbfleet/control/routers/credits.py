"""``/v1/credits``: grants, balances, the journal and the audit trail.

Every answer carries ``X-Request-Id`` (the caller's, or a new one), and every credit
decision records it with the caller and the ``Idempotency-Key`` in the audit trail.
Another tenant's wallet answers 404 exactly like a missing one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, idempotent_reply, platform_of, require_admin
from nbfleet.db.credit_tables import CreditAudit, LedgerEntry
from nbfleet.db.ids import new_id
from nbfleet.ledger import audit, grants, wallets
from nbfleet.ledger.wallets import WalletOwner
from nbfleet.model.credits import MAX_AMOUNT, GrantKind
from nbfleet.model.errors import InvalidInput, NotFound
from nbfleet.web.render import iso

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,100}")


class RequestIdRoute(APIRoute):
    """Names each request (``X-Request-Id``) and echoes the name back, errors included."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_request_id(request: Request) -> Response:
            given = request.headers.get("x-request-id", "")
            request_id = given if _REQUEST_ID.fullmatch(given) else new_id("req")
            request.state.request_id = request_id
            try:
                response = await handler(request)
            except Exception as exc:
                on_error = next((request.app.exception_handlers[kind]
                                 for kind in type(exc).__mro__
                                 if kind in request.app.exception_handlers), None)
                if on_error is None:
                    raise
                response = await on_error(request, exc)
            response.headers["X-Request-Id"] = request_id
            return response

        return with_request_id


def actor_of(request: Request, principal: Principal) -> audit.Actor:
    """Who asks, under which request and key: what the audit trail records."""
    return audit.Actor(principal.user_id or "internal", getattr(request.state, "request_id", None),
                       request.headers.get("idempotency-key"))


def wallet_owner(session: Session, principal: Principal, org: str | None, project: str | None,
                 scope: str | None) -> WalletOwner:
    """The wallet a caller may read: admins name any; users get their own project's (or
    with ``scope=org`` their org's), and naming any other answers like a missing one."""
    if principal.is_admin:
        if org is None:
            raise InvalidInput("admins must name an org", field="org")
        if scope == "project" and project is None:
            raise InvalidInput("scope=project needs a project", field="project")
        return wallets.owner_by_names(session, org, None if scope == "org" else project)
    own = wallets.owner_by_ids(session, principal.org_id, principal.project_id)
    if org is not None and org != own.org:
        raise NotFound(f"org {org!r} not found")
    if project is not None and project != own.project:
        raise NotFound(f"project {org or own.org}/{project} not found")
    return WalletOwner(own.org_id, own.org) if scope == "org" else own


router = APIRouter(prefix="/v1/credits", tags=["credits"], route_class=RequestIdRoute)

ORG_Q = Query(None, description="Org name (admins must give it; users may name their own)")
PROJECT_Q = Query(None, description="Project name; none: the org's shared wallet (admins)")
SCOPE_Q = Query(None, description="project (default for users) or org: the org's shared wallet")


class GrantBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    org: str = Field(min_length=1, max_length=100)
    project: str | None = Field(None, min_length=1, max_length=100,
                                description="null: the org's shared wallet")
    kind: GrantKind
    amount: int = Field(gt=0, le=MAX_AMOUNT, strict=True, description="micro-credits")
    expires_at: AwareDatetime | None = Field(None, description="RFC 3339 with a zone")
    priority: int = Field(0, ge=-1_000_000, le=1_000_000, strict=True,
                          description="lower numbers are spent first")
    memo: str | None = Field(None, max_length=1000)


@router.post("/grants", status_code=201, summary="Issue credits to a wallet (admin)")
def create_grant(body: GrantBody, request: Request,
                 principal: Principal = Depends(require_admin)) -> JSONResponse:
    db = platform_of(request).db
    actor = actor_of(request, principal)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        owner = wallets.owner_by_names(session, body.org, body.project)
        bucket = grants.issue(session, owner, grants.GrantRequest(
            body.kind, body.amount, body.expires_at, body.priority, body.memo), actor,
            db.now(session))
        return 201, {**grants.bucket_view(bucket), "org": owner.org, "project": owner.project}

    return idempotent_reply(request, principal, body.model_dump(mode="json"), action)


@router.get("/balance", summary="A wallet's balance: promo against paid, next expirations")
def balance(request: Request, principal: Principal = Depends(current_principal),
            org: str | None = ORG_Q, project: str | None = PROJECT_Q,
            scope: Literal["project", "org"] | None = SCOPE_Q) -> dict[str, Any]:
    db = platform_of(request).db
    with db.transaction() as session:  # expire first: expired credits never show available
        owner = wallet_owner(session, principal, org, project, scope)
        now = db.now(session)
        wallet = wallets.find(session, owner)
        if wallet is not None:
            grants.expire_due(session, now, wallet_ids=[wallet.id])
        return grants.balance(session, owner, now)


@router.get("/ledger", summary="A wallet's journal entries, oldest first")
def ledger(request: Request, principal: Principal = Depends(current_principal),
           org: str | None = ORG_Q, project: str | None = PROJECT_Q,
           scope: Literal["project", "org"] | None = SCOPE_Q,
           after: int | None = Query(None, ge=0, description="cursor: the previous page's next"),
           limit: int = Query(100, ge=1, le=500)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        owner = wallet_owner(session, principal, org, project, scope)
        wallet = wallets.find(session, owner)
        if wallet is None:
            return {"items": [], "next": None}
        query = (select(LedgerEntry).where(LedgerEntry.wallet_id == wallet.id)
                 .order_by(LedgerEntry.id).limit(limit + 1))
        if after is not None:
            query = query.where(LedgerEntry.id > after)
        rows = list(session.execute(query).scalars())
    page = rows[:limit]
    return {
        "items": [{"id": e.id, "txn_id": e.txn_id, "kind": e.kind, "bucket_id": e.bucket_id,
                   "hold_id": e.hold_id, "account": e.account, "amount": e.amount,
                   "created_at": iso(e.created_at)} for e in page],
        "next": page[-1].id if len(rows) > limit else None,
    }


def _audit_view(row: CreditAudit) -> dict[str, Any]:
    return {"id": row.id, "org_id": row.org_id, "project_id": row.project_id,
            "wallet_id": row.wallet_id, "actor": row.actor, "request_id": row.request_id,
            "idempotency_key": row.idempotency_key, "action": row.action,
            "subject_id": row.subject_id, "before": row.before, "after": row.after,
            "created_at": iso(row.created_at)}


@router.get("/audit", summary="Credit decisions: who, which request, before and after")
def audit_trail(request: Request, principal: Principal = Depends(current_principal),
                org: str | None = ORG_Q, project: str | None = PROJECT_Q,
                since: datetime | None = Query(None, description="RFC 3339 with a zone"),
                until: datetime | None = Query(None, description="RFC 3339 with a zone"),
                after: int | None = Query(None, ge=0), limit: int = Query(100, ge=1, le=500),
                ) -> dict[str, Any]:
    for name, moment in (("since", since), ("until", until)):
        if moment is not None and moment.tzinfo is None:
            raise InvalidInput(f"{name} must carry a time zone", field=name)
    query = select(CreditAudit).order_by(CreditAudit.id).limit(limit + 1)
    with platform_of(request).db.transaction(write=False) as session:
        if principal.is_admin and org is None:
            if project is not None:
                raise InvalidInput("a project needs its org", field="org")
        else:
            owner = (wallets.owner_by_names(session, org, project)
                     if principal.is_admin and org is not None
                     else wallet_owner(session, principal, org, project, "project"))
            query = query.where(CreditAudit.org_id == owner.org_id)
            if owner.project_id is not None:
                query = query.where(CreditAudit.project_id == owner.project_id)
        if since is not None:
            query = query.where(CreditAudit.created_at >= since)
        if until is not None:
            query = query.where(CreditAudit.created_at < until)
        if after is not None:
            query = query.where(CreditAudit.id > after)
        rows = list(session.execute(query).scalars())
    page = rows[:limit]
    return {"items": [_audit_view(row) for row in page],
            "next": page[-1].id if len(rows) > limit else None}
