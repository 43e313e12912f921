"""Admin pages: the GPU fleet, users, orgs and their projects, credit grants.

They do not exist for anyone else: an ordinary user gets 404, as from
``/v1/admin``. Lists are keyset pages on primary keys or unique indexes.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import tenancy
from nbfleet.control.dashboard.pages import (
    PAGE_SIZE,
    PageRoute,
    Viewer,
    form_viewer,
    redirect,
    render,
    viewer,
)
from nbfleet.control.deps import platform_of
from nbfleet.control.fleet.view import fleet_view
from nbfleet.control.idempotency import request_fingerprint, run_idempotent
from nbfleet.db.credit_tables import CreditBucket, Wallet
from nbfleet.db.tables import Agent, Org, Project, User
from nbfleet.ledger import audit, grants, wallets
from nbfleet.model.credits import MAX_AMOUNT, GrantKind
from nbfleet.model.errors import DomainError, InvalidInput, NotFound
from nbfleet.web.render import iso

router = APIRouter(route_class=PageRoute)



def _admin(me: Viewer) -> Viewer:
    if not me.is_admin:
        raise NotFound("not found")  # admin pages do not exist for ordinary users
    return me


@router.get("/ui/admin/fleet")
def fleet_page(request: Request) -> Response:
    me = _admin(viewer(request))
    platform = platform_of(request)
    scheduler = platform.fleet.scheduler
    fleet = fleet_view(scheduler) if scheduler is not None else None
    with platform.db.transaction(write=False) as session:
        agents = list(session.execute(select(Agent).order_by(Agent.id).limit(500)).scalars())
    return render(request, me, "admin_fleet.html", title="Fleet", section="fleet", fleet=fleet,
                  agents=[{"id": a.id, "url": a.url, "inventory": a.inventory,
                           "last_heartbeat_at": iso(a.last_heartbeat_at)} for a in agents])


def _users_page(request: Request, me: Viewer, after: str | None, status: int = 200,
                **extra: Any) -> Response:
    query = (select(User.id, User.name, User.is_admin, User.created_at, Org.name.label("org"),
                    Project.name.label("project"))
             .join(Org, Org.id == User.org_id).join(Project, Project.id == User.project_id)
             .order_by(User.id).limit(PAGE_SIZE + 1))
    if after:
        query = query.where(User.id > after)
    with platform_of(request).db.transaction(write=False) as session:
        rows = [dict(row._mapping) for row in session.execute(query)]
    page = rows[:PAGE_SIZE]
    return render(request, me, "admin_users.html", status, title="Users", section="users",
                  users=page, paged=after is not None,
                  next_after=page[-1]["id"] if len(rows) > PAGE_SIZE else None, **extra)


@router.get("/ui/admin/users")
def users_page(request: Request, after: str | None = Query(None, max_length=100)) -> Response:
    return _users_page(request, _admin(viewer(request)), after)


@router.post("/ui/admin/users")
async def create_user(request: Request) -> Response:
    """The new token is shown once, on this answer (never in a URL), as the API does."""
    me, form = await form_viewer(request)
    _admin(me)
    try:
        created = await asyncio.to_thread(
            tenancy.create_user, platform_of(request).db, form.get("name", "").strip(),
            form.get("org", "").strip(), form.get("project", "").strip(),
            form.get("admin") == "on")
    except DomainError as exc:
        return _users_page(request, me, None, exc.status, error=exc.detail, values=form)
    return render(request, me, "admin_user_created.html", 201, title="User created",
                  section="users", created=created, name=form.get("name", "").strip())


@router.get("/ui/admin/orgs")
def orgs_page(request: Request, after: str | None = Query(None, max_length=100)) -> Response:
    me = _admin(viewer(request))
    query = select(Org).order_by(Org.name).limit(PAGE_SIZE + 1)
    if after:
        query = query.where(Org.name > after)
    with platform_of(request).db.transaction(write=False) as session:
        orgs = list(session.execute(query).scalars())
        page = orgs[:PAGE_SIZE]
        projects: dict[str, list[Project]] = {org.id: [] for org in page}
        if page:
            for project in session.execute(select(Project).where(
                    Project.org_id.in_(list(projects))).order_by(Project.name)).scalars():
                projects[project.org_id].append(project)
    return render(request, me, "admin_orgs.html", title="Orgs", section="orgs",
                  orgs=[{"id": o.id, "name": o.name, "created_at": iso(o.created_at),
                         "projects": projects[o.id]} for o in page],
                  paged=after is not None,
                  next_after=page[-1].name if len(orgs) > PAGE_SIZE else None)


def _grants_page(request: Request, me: Viewer, before: str | None, status: int = 200,
                 **extra: Any) -> Response:
    query = (select(CreditBucket, Org.name.label("org"), Project.name.label("project"))
             .join(Wallet, Wallet.id == CreditBucket.wallet_id)
             .join(Org, Org.id == Wallet.org_id)
             .outerjoin(Project, Project.id == Wallet.project_id)
             .order_by(CreditBucket.id.desc()).limit(PAGE_SIZE + 1))
    if before:
        query = query.where(CreditBucket.id < before)
    with platform_of(request).db.transaction(write=False) as session:
        rows = [(grants.bucket_view(bucket), org, project)
                for bucket, org, project in session.execute(query)]
    page = rows[:PAGE_SIZE]
    return render(request, me, "admin_grants.html", status, title="Grants", section="grants",
                  grants=[{**view, "org": org, "project": project} for view, org, project in page],
                  kinds=[str(kind) for kind in GrantKind], key=uuid.uuid4().hex,
                  paged=before is not None,
                  next_before=page[-1][0]["id"] if len(rows) > PAGE_SIZE else None,
                  **{"error": None, "values": {}, **extra})


@router.get("/ui/admin/grants")
def grants_page(request: Request, before: str | None = Query(None, max_length=100),
                done: str | None = None) -> Response:
    notice = "Credits issued." if done == "issued" else None
    return _grants_page(request, _admin(viewer(request)), before, notice=notice)


def _micro(text: str) -> int:
    """Credits as typed (``12.5``) in micro-credits, exactly."""
    try:
        value = Decimal(text.strip()) * 1_000_000
    except InvalidOperation:
        raise InvalidInput("amount must be a number of credits, e.g. 12.5") from None
    if not value.is_finite() or value != value.to_integral_value() \
            or not 0 < value <= MAX_AMOUNT:
        raise InvalidInput("amount must be positive, at most 6 decimals, and not too large")
    return int(value)


def _expiry(text: str) -> datetime | None:
    """A ``datetime-local`` value, read as UTC (the form says so)."""
    if not text.strip():
        return None
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput("expires must be a date and time, e.g. 2027-01-01T00:00") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@router.post("/ui/admin/grants")
async def issue_grant(request: Request) -> Response:
    """Issue credits, as ``POST /v1/credits/grants``; the form's hidden ``key`` makes a
    double submit issue them once."""
    me, form = await form_viewer(request)
    _admin(me)
    db = platform_of(request).db
    key = form.get("key") or None
    try:
        kind = GrantKind(form.get("kind", ""))
        request_body = grants.GrantRequest(
            kind, _micro(form.get("amount", "")), _expiry(form.get("expires", "")),
            int(form.get("priority") or 0), form.get("memo", "").strip()[:1000] or None)
    except ValueError as exc:  # InvalidInput is not a ValueError: a bad kind or priority
        return _grants_page(request, me, None, 422, error=f"invalid grant: {exc}", values=form)
    except InvalidInput as exc:
        return _grants_page(request, me, None, 422, error=exc.detail, values=form)
    org, project = form.get("org", "").strip(), form.get("project", "").strip() or None
    actor = audit.Actor(me.principal.user_id, None, key)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        owner = wallets.owner_by_names(session, org, project)
        bucket = grants.issue(session, owner, request_body, actor, db.now(session))
        return 201, grants.bucket_view(bucket)

    fingerprint = request_fingerprint("POST", "/ui/admin/grants", {
        "org": org, "project": project, "kind": str(kind), "amount": request_body.amount,
        "expires": form.get("expires", ""), "priority": request_body.priority,
        "memo": request_body.memo})
    try:
        (status, payload), _ = await asyncio.to_thread(
            run_idempotent, db, me.principal.user_id, key, fingerprint, action)
    except DomainError as exc:
        return _grants_page(request, me, None, exc.status, error=exc.detail, values=form)
    if status >= 400:
        return _grants_page(request, me, None, status, error=str(payload.get("detail")),
                            values=form)
    return redirect("/ui/admin/grants?done=issued")
