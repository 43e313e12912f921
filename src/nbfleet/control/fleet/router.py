"""``/v1/admin/fleet``: the GPU fleet as the live scheduler sees it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from nbfleet.control.auth import Principal
from nbfleet.control.deps import platform_of, require_admin
from nbfleet.control.fleet.view import fleet_view
from nbfleet.model.errors import Unavailable

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.get("/fleet", summary="Hosts, GPUs, subscriptions, warm pools and waiting cells")
async def get_fleet(request: Request, _: Principal = Depends(require_admin)) -> dict[str, Any]:
    scheduler = platform_of(request).fleet.scheduler
    if scheduler is None:
        raise Unavailable("the GPU scheduler is not active on this control-plane replica "
                          "(it runs on the one holding the reconciler's lease); retry")
    return fleet_view(scheduler)
