"""``/v1/credits/budgets``: spending limits per org, project or user and period.

Admins set them; users read the ones that apply to them (their org's, their
project's, their own), and any other answers 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, idempotent_reply, platform_of, require_admin
from nbfleet.control.routers.credits import RequestIdRoute, actor_of
from nbfleet.db.credit_tables import Budget
from nbfleet.db.tables import Org
from nbfleet.ledger import budgets
from nbfleet.model.credits import MAX_AMOUNT, Enforcement, Level, Period
from nbfleet.model.errors import NotFound

router = APIRouter(prefix="/v1/credits/budgets", tags=["credits"], route_class=RequestIdRoute)


class BudgetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    org: str = Field(min_length=1, max_length=100)
    project: str | None = Field(None, min_length=1, max_length=100)
    user: str | None = Field(None, min_length=1, max_length=100,
                             description="a user name in the org: a per-user budget")
    period: Period
    limit: int = Field(ge=0, le=MAX_AMOUNT, strict=True, description="micro-credits")
    enforcement: Enforcement = Field(
        description="hard: refuse holds past the limit; soft: admit and alert; cap: refuse "
                    "new holds once spent + held reaches the limit")


class BudgetPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limit: int = Field(ge=0, le=MAX_AMOUNT, strict=True, description="micro-credits")


def _applies_to(principal: Principal) -> ColumnElement[bool]:
    """The budgets that limit a user: their org's, their project's and their own."""
    return or_(
        and_(Budget.level == str(Level.ORG), Budget.org_id == principal.org_id),
        and_(Budget.level == str(Level.PROJECT), Budget.project_id == principal.project_id),
        and_(Budget.level == str(Level.USER), Budget.user_id == principal.user_id),
    )


def _visible(session: Session, principal: Principal, budget_id: str,
             for_update: bool = False) -> Budget:
    query = select(Budget).where(Budget.id == budget_id)
    if not principal.is_admin:
        query = query.where(_applies_to(principal))
    if for_update:
        query = query.with_for_update()
    budget = session.execute(query).scalar_one_or_none()
    if budget is None:
        raise NotFound(f"budget {budget_id} not found")
    return budget


@router.post("", status_code=201, summary="Set a budget (admin)")
def create_budget(body: BudgetBody, request: Request,
                  principal: Principal = Depends(require_admin)) -> JSONResponse:
    db = platform_of(request).db
    actor = actor_of(request, principal)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        now = db.now(session)
        target = budgets.target_by_names(session, body.org, body.project, body.user)
        budget = budgets.create(session, target, body.period, body.limit, body.enforcement,
                                actor, now)
        return 201, budgets.view(session, budget, now)

    return idempotent_reply(request, principal, body.model_dump(mode="json"), action)


@router.get("", summary="Budgets: all of an org's (admin), or those that apply to you")
def list_budgets(request: Request, principal: Principal = Depends(current_principal),
                 org: str | None = Query(None, description="admins: only this org's")
                 ) -> dict[str, Any]:
    db = platform_of(request).db
    query = select(Budget).order_by(Budget.id)
    with db.transaction(write=False) as session:
        if not principal.is_admin:
            query = query.where(_applies_to(principal))
        elif org is not None:
            org_id = session.execute(select(Org.id).where(Org.name == org)).scalar_one_or_none()
            if org_id is None:
                raise NotFound(f"org {org!r} not found")
            query = query.where(Budget.org_id == org_id)
        now = db.now(session)
        return {"items": [budgets.view(session, budget, now)
                          for budget in session.execute(query).scalars()]}


@router.get("/{budget_id}", summary="A budget and what is committed against it")
def get_budget(budget_id: str, request: Request,
               principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    db = platform_of(request).db
    with db.transaction(write=False) as session:
        return budgets.view(session, _visible(session, principal, budget_id), db.now(session))


@router.patch("/{budget_id}", summary="Change a budget's limit (admin)")
def update_budget(budget_id: str, body: BudgetPatch, request: Request,
                  principal: Principal = Depends(require_admin)) -> JSONResponse:
    db = platform_of(request).db
    actor = actor_of(request, principal)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        now = db.now(session)
        budget = budgets.update_limit(
            session, _visible(session, principal, budget_id, for_update=True), body.limit,
            actor, now)
        session.flush()
        return 200, budgets.view(session, budget, now)

    return idempotent_reply(request, principal, body.model_dump(mode="json"), action)


@router.delete("/{budget_id}", summary="Remove a budget (admin)")
def delete_budget(budget_id: str, request: Request,
                  principal: Principal = Depends(require_admin)) -> JSONResponse:
    db = platform_of(request).db
    actor = actor_of(request, principal)

    def action(session: Session) -> tuple[int, dict[str, Any]]:
        budget = _visible(session, principal, budget_id, for_update=True)
        budgets.delete(session, budget, actor, db.now(session))
        return 200, {"id": budget_id, "deleted": True}

    return idempotent_reply(request, principal, {}, action)
