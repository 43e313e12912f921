"""``/v1/admin/fleet``: the GPU fleet as the live scheduler sees it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from nbfleet.control.auth import Principal
from nbfleet.control.deps import platform_of, require_admin
from nbfleet.control.fleet.scheduler import LiveScheduler
from nbfleet.control.fleet.view import decisions_view, fleet_view
from nbfleet.model.errors import Unavailable

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/fleet", summary="Hosts, GPUs, subscriptions, warm pools and waiting cells")
async def get_fleet(request: Request, _: Principal = Depends(require_admin)) -> dict[str, Any]:
    return fleet_view(_scheduler(request))


@router.get("/fleet/decisions", summary="The GPU scheduler's decisions, oldest first")
async def get_decisions(
        request: Request, _: Principal = Depends(require_admin),
        after: int = Query(-1, ge=-1, description="Only decisions with a larger seq"),
        limit: int = Query(1000, ge=1, le=10_000)) -> dict[str, Any]:
    return decisions_view(_scheduler(request), after, limit)


def _scheduler(request: Request) -> LiveScheduler:
    scheduler = platform_of(request).fleet.scheduler
    if scheduler is None:
        raise Unavailable("the GPU scheduler is not active on this control-plane replica "
                          "(it runs on the one holding the reconciler's lease); retry")
    return scheduler
