"""``/internal``: agent registration and heartbeats, authenticated by the cluster secret."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from nbfleet.control import hosts
from nbfleet.control.deps import platform_of
from nbfleet.model.errors import Unauthorized
from nbfleet.web.problems import bearer_token


def require_cluster_secret(request: Request) -> None:
    token = bearer_token(request.headers.get("authorization")) or ""
    if not hmac.compare_digest(token, platform_of(request).config.secret):
        raise Unauthorized("internal calls need the cluster secret")


router = APIRouter(prefix="/internal", tags=["internal"], include_in_schema=False,
                   dependencies=[Depends(require_cluster_secret)])


class Registration(BaseModel):
    id: str
    url: str
    boot_id: str
    inventory: dict[str, Any]


class Heartbeat(BaseModel):
    boot_id: str


@router.post("/agents")
def register_agent(body: Registration, request: Request) -> dict[str, Any]:
    platform = platform_of(request)
    with platform.db.transaction() as session:
        lost = hosts.register(session, platform.db.now(session), body.model_dump())
    if lost:
        platform.wake()
    return {"blobs_url": platform.config.blobs_url}


@router.post("/agents/{agent_id}/heartbeat", status_code=204)
def agent_heartbeat(agent_id: str, body: Heartbeat, request: Request) -> None:
    platform = platform_of(request)
    with platform.db.transaction() as session:
        hosts.heartbeat(session, platform.db.now(session), agent_id, body.boot_id)
