"""``/v1/binaries`` (read) and ``/v1/admin/binaries`` (register, canary, promote,
roll back): the registry of job binaries and their rollouts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from nbfleet.control.auth import Principal
from nbfleet.control.deps import current_principal, platform_of, require_admin
from nbfleet.jobs import binaries
from nbfleet.model.jobs import CanaryRule

router = APIRouter(tags=["binaries"])


def _public(view: dict[str, Any], admin: bool) -> dict[str, Any]:
    """Users see what they may run; only admins see how it is run."""
    return view if admin else {k: v for k, v in view.items() if k != "command"}


@router.get("/v1/binaries", summary="Registered binaries and their versions")
def list_binaries(request: Request, name: str | None = None,
                  principal: Principal = Depends(current_principal)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        rows = binaries.versions(session, name)
        return {"items": [_public(binaries.view(r), principal.is_admin) for r in rows]}


class RegisterBinary(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    version: str = Field(min_length=1, max_length=50)
    command: list[str] = Field(min_length=1, max_length=64,
                               description="argv prefix; job arguments follow as --name=value")
    canary_percent: int = Field(0, ge=0, le=100,
                                description="Share of new unpinned jobs (versions after the "
                                            "first)")
    failure_threshold: float = Field(0.5, ge=0, le=1,
                                     description="Roll back past this binary failure rate")
    min_samples: int = Field(5, ge=1, le=100000)


@router.post("/v1/admin/binaries", status_code=201, summary="Register a binary version")
def register_binary(body: RegisterBinary, request: Request,
                    _: Principal = Depends(require_admin)) -> dict[str, Any]:
    db = platform_of(request).db
    with db.transaction() as session:
        row = binaries.register(session, body.name, body.version, body.command,
                                body.canary_percent,
                                CanaryRule(body.failure_threshold, body.min_samples),
                                db.now(session))
        return binaries.view(row)


class CanaryPercent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    canary_percent: int = Field(ge=0, le=100)


@router.patch("/v1/admin/binaries/{name}/{version}", summary="Change a canary's share")
def set_canary(name: str, version: str, body: CanaryPercent, request: Request,
               _: Principal = Depends(require_admin)) -> dict[str, Any]:
    db = platform_of(request).db
    with db.transaction() as session:
        row = binaries.set_canary_percent(session, name, version, body.canary_percent,
                                          db.now(session))
        return binaries.view(row)


@router.post("/v1/admin/binaries/{name}/{version}/promote", summary="Make a version stable")
def promote(name: str, version: str, request: Request,
            _: Principal = Depends(require_admin)) -> dict[str, Any]:
    db = platform_of(request).db
    with db.transaction() as session:
        return binaries.view(binaries.promote(session, name, version, db.now(session)))


@router.post("/v1/admin/binaries/{name}/{version}/rollback", summary="Roll a canary back")
def rollback(name: str, version: str, request: Request,
             _: Principal = Depends(require_admin)) -> dict[str, Any]:
    """Idempotent: a version already rolled back (by hand or automatically) answers
    200 with its state and first reason unchanged."""
    db = platform_of(request).db
    with db.transaction() as session:
        row = binaries.get(session, name, version, for_update=True)
        moved = binaries.roll_back(session, row, "rolled back by an admin", db.now(session))
        return {**binaries.view(row), "jobs_moved_to_stable": moved}
