"""``/v1/admin``: users and hosts. Ordinary callers get 404, as for any hidden resource."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import drain, tenancy, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.deps import platform_of, require_admin
from nbfleet.control.routers.workspaces import fleet_shapes
from nbfleet.db.tables import Agent
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.errors import InvalidInput
from nbfleet.model.limits import Limits
from nbfleet.model.quotas import MAX_LIMIT
from nbfleet.protocol.hosts import HostDrainState
from nbfleet.web.render import iso

router = APIRouter(prefix="/v1/admin", tags=["admin"])


class CreateUser(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    org: str
    project: str
    admin: bool = False


@router.post("/users", status_code=201, summary="Create a user and return its token (once)")
async def create_user(body: CreateUser, request: Request,
                      _: Principal = Depends(require_admin)) -> dict[str, Any]:
    created = await asyncio.to_thread(
        tenancy.create_user, platform_of(request).db, body.name, body.org, body.project, body.admin
    )
    return {"id": created.user_id, "name": body.name, "org": created.org,
            "project": created.project, "token": created.token}


class ProjectSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    idle_suspend_s: int | None = Field(
        None, description="Suspend idle workspaces after this many seconds; 0 never, null "
                          "the platform default", ge=0, le=30 * 86400)
    kernel_memory: str | None = Field(
        None, max_length=32, description="Memory limit of the project's kernels, e.g. '8GiB' "
                                         "(null: the platform default)")
    kernel_cpus: float | None = Field(
        None, gt=0, le=1024, description="CPU limit of the project's kernels, in CPUs")
    kernel_pids: int | None = Field(
        None, ge=1, le=1_000_000, description="Process limit of the project's kernels")
    workspace_disk: str | None = Field(
        None, max_length=32, description="Disk quota of each of the project's workspaces, "
                                         "e.g. '20GiB' (applies from its next start)")
    network: Literal["none", "egress"] | None = Field(
        None, description="'egress': the project's kernels reach the public internet "
                          "(never the platform's hosts or private ranges); 'none' or null: "
                          "no network (applies from a workspace's next start)")
    resources: workspaces.ResourceRequest | None = Field(
        None, description="What the project's workspaces ask for when created without a "
                          "request of their own (null: nothing, i.e. no GPUs); existing "
                          "workspaces keep what they were created with")


@router.put("/orgs/{org}/projects/{project}/settings",
            summary="Set a project's idle-suspend timeout and kernel limits")
async def project_settings(org: str, project: str, body: ProjectSettings, request: Request,
                           _: Principal = Depends(require_admin)) -> dict[str, Any]:
    """A PUT replaces every setting: one left out (or null) returns to the default.
    A default resource request no host shape can satisfy is refused (422), as a
    workspace's own request would be."""
    limits = Limits.parse(body.kernel_memory, body.kernel_cpus, body.kernel_pids,
                          body.workspace_disk)
    spec = body.resources.spec() if body.resources is not None else ResourceSpec()
    shapes = fleet_shapes(request)

    def check(session: Session) -> None:
        shapes.check(session, spec)

    await asyncio.to_thread(
        tenancy.set_project_settings, platform_of(request).db, org, project,
        body.idle_suspend_s, limits, body.network,
        workspaces.spec_json(spec) if body.resources is not None else None, check)
    return {"org": org, "project": project, **body.model_dump()}


class JobSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, gt=0, le=1e6, description="Fair-share weight of the project")
    guarantee_gpus: int = Field(0, ge=0, le=1_000_000,
                                description="GPUs preemption never takes the project below")
    max_running: int | None = Field(None, ge=0, description="Running jobs at most (null: no cap)")
    max_queued: int | None = Field(None, ge=0, description="Queued jobs at most (null: no cap)")
    tiers: list[str] | None = Field(None, max_length=32,
                                    description="Tiers the project may use (null: all)")


@router.put("/orgs/{org}/projects/{project}/job-settings",
            summary="Set a project's fair share and job quotas")
async def job_settings(org: str, project: str, body: JobSettings, request: Request,
                       _: Principal = Depends(require_admin)) -> dict[str, Any]:
    unknown = sorted(set(body.tiers or ()) - set(platform_of(request).jobs.tiers))
    if unknown:
        raise InvalidInput(f"unknown tiers {unknown}; known: "
                           f"{sorted(platform_of(request).jobs.tiers)}", field="tiers")
    await asyncio.to_thread(tenancy.set_job_settings, platform_of(request).db, org, project,
                            body.weight, body.guarantee_gpus, body.max_running, body.max_queued,
                            body.tiers)
    return {"org": org, "project": project, **body.model_dump()}


Limit = Annotated[int, Field(ge=0, le=MAX_LIMIT)] | Literal["unlimited"] | None


class QuotaBody(BaseModel):
    """Workspace quota limits: each a number (0 freezes it), ``"unlimited"``, or
    null / left out for the default (``model.quotas``)."""

    model_config = ConfigDict(extra="forbid")
    workspaces: Limit = Field(None, description="Workspaces, deleted ones aside")
    running: Limit = Field(None, description="Workspaces asked to run (a create or a "
                                             "resume counts)")
    kernels_per_workspace: Limit = Field(None, description="Kernels in one workspace")
    gpus: Limit = Field(None, description="GPUs asked for by running workspaces")


class ProjectQuota(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project: QuotaBody | None = Field(
        None, description="The project's totals (default: unlimited)")
    per_user: QuotaBody | None = Field(
        None, description="What each of the project's users may hold (default: 20 "
                          "workspaces, 10 running, 8 kernels per workspace, GPUs unlimited)")


def _stored(body: QuotaBody | None) -> dict[str, Any] | None:
    return body.model_dump(exclude_none=True) if body is not None else None


@router.put("/orgs/{org}/projects/{project}/quota",
            summary="Set a project's workspace quotas: its totals and each user's")
async def set_project_quota(org: str, project: str, body: ProjectQuota, request: Request,
                            _: Principal = Depends(require_admin)) -> dict[str, Any]:
    """A PUT replaces both: a field left out (or null) returns to its default. A
    limit lowered below what is held refuses only what comes next."""
    db = platform_of(request).db
    await asyncio.to_thread(tenancy.set_project_quota, db, org, project,
                            _stored(body.project), _stored(body.per_user))
    return await asyncio.to_thread(tenancy.project_quota, db, org, project)


@router.get("/orgs/{org}/projects/{project}/quota",
            summary="A project's workspace quotas and what it holds")
async def get_project_quota(org: str, project: str, request: Request,
                            _: Principal = Depends(require_admin)) -> dict[str, Any]:
    return await asyncio.to_thread(tenancy.project_quota, platform_of(request).db, org,
                                   project)


@router.put("/orgs/{org}/users/{user}/quota", summary="Set one user's workspace quota")
async def set_user_quota(org: str, user: str, body: QuotaBody, request: Request,
                         _: Principal = Depends(require_admin)) -> dict[str, Any]:
    """Each field set here wins over the project's per-user quota; left out (or
    null): the project's."""
    db = platform_of(request).db
    await asyncio.to_thread(tenancy.set_user_quota, db, org, user, _stored(body))
    return await asyncio.to_thread(tenancy.user_quota, db, org, user)


@router.get("/orgs/{org}/users/{user}/quota",
            summary="One user's workspace quota and what it holds")
async def get_user_quota(org: str, user: str, request: Request,
                         _: Principal = Depends(require_admin)) -> dict[str, Any]:
    return await asyncio.to_thread(tenancy.user_quota, platform_of(request).db, org, user)


@router.get("/agents", summary="Registered hosts")
def list_agents(request: Request, _: Principal = Depends(require_admin)) -> dict[str, Any]:
    with platform_of(request).db.transaction(write=False) as session:
        agents = session.execute(select(Agent).order_by(Agent.id)).scalars()
        return {
            "items": [
                {"id": a.id, "url": a.url, "boot_id": a.boot_id, "inventory": a.inventory,
                 "last_heartbeat_at": iso(a.last_heartbeat_at),
                 "draining": a.draining_since is not None}
                for a in agents
            ]
        }


@router.get("/hosts/{host_id}", summary="A host: whether it is draining, and what is on it")
def get_host(host_id: str, request: Request,
             _: Principal = Depends(require_admin)) -> HostDrainState:
    with platform_of(request).db.transaction(write=False) as session:
        return drain.report(session, host_id)


@router.post("/hosts/{host_id}/drain",
             summary="Drain a host: no new placements, its workspaces moved or suspended")
def drain_host(host_id: str, request: Request,
               _: Principal = Depends(require_admin)) -> HostDrainState:
    """Marks the host draining (again is fine) and answers at once: the control
    plane's fleet pass moves each workspace with its state to another host, or
    suspends it where there is none. Poll ``GET /v1/admin/hosts/{host_id}`` until
    ``workspaces`` is 0; then the host can be stopped."""
    platform = platform_of(request)
    with platform.db.transaction() as session:
        found = drain.start(session, host_id, platform.db.now(session))
    platform.wake()
    return found


@router.delete("/hosts/{host_id}/drain", summary="Stop draining a host: it takes work again")
def undrain_host(host_id: str, request: Request,
                 _: Principal = Depends(require_admin)) -> HostDrainState:
    platform = platform_of(request)
    with platform.db.transaction() as session:
        found = drain.stop(session, host_id)
    platform.wake()
    return found
