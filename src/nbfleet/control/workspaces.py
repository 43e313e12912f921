"""Workspace rows: tenant-scoped lookup, resource requests, desired-state requests
and audited transitions."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from sqlalchemy import select
from sqlalchemy.orm import Session, object_session

from nbfleet.control import quotas
from nbfleet.control.auth import Principal
from nbfleet.db.ids import new_id
from nbfleet.db.tables import Agent, Project, Workspace, WorkspaceEvent
from nbfleet.model.cluster import ResourceSpec
from nbfleet.model.errors import InvalidInput, NotFound
from nbfleet.model.resources import GpuGroup, HostInventory, inventory_from_json, parse_gpu_spec
from nbfleet.model.workspace import (
    DesiredState,
    WorkspaceState,
    check_request,
    check_transition,
    is_settled,
)
from nbfleet.policy.shapes import UNBOUNDED, autoscaled_shape, unsatisfiable_reason
from nbfleet.protocol.agent import LayerRestore, RestoreReport
from nbfleet.web.metrics import WORKSPACE_TRANSITIONS
from nbfleet.web.render import iso

# ------------------------------------------------------------------ resources
#: A GPU type as agents declare it (``model/resources.py``): e.g. ``A100-80GB``.
GPU_TYPE_PATTERN = r"^[A-Za-z0-9]+-[0-9]+GB$"
GpuType = Annotated[str, StringConstraints(pattern=GPU_TYPE_PATTERN, max_length=64)]


class ResourceRequest(BaseModel):
    """What a workspace asks for (the API's form of ``model.cluster.ResourceSpec``);
    every field may be left out. Unknown fields are refused, so a typo is a 422
    naming it rather than a request silently asking for less."""

    model_config = ConfigDict(extra="forbid")
    millicpus: int = Field(default=0, ge=0, le=1_024_000,
                           description="CPU, in thousandths of a CPU")
    memory_mb: int = Field(default=0, ge=0, le=16 << 20, description="Memory, in MiB")
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs, all of one type")
    vram_gb: int = Field(default=0, ge=0, le=4096, description="VRAM floor per GPU, in GB")
    gpu_types: list[GpuType] = Field(
        default_factory=list, max_length=16,
        description="Acceptable GPU types, most preferred first (empty: any), e.g. A100-80GB")

    @model_validator(mode="after")
    def _gpu_details_need_gpus(self) -> ResourceRequest:
        if self.gpus == 0 and (self.vram_gb or self.gpu_types):
            raise ValueError("gpu_types and vram_gb need gpus of at least 1")
        self.gpu_types = list(dict.fromkeys(self.gpu_types))  # a repeat adds nothing
        return self

    def spec(self) -> ResourceSpec:
        return ResourceSpec(millicpus=self.millicpus, memory_mb=self.memory_mb, gpus=self.gpus,
                            vram_gb=self.vram_gb, gpu_types=tuple(self.gpu_types))


def spec_json(spec: ResourceSpec) -> dict[str, Any]:
    """How a spec is stored and shown: all five fields, always."""
    return {"millicpus": spec.millicpus, "memory_mb": spec.memory_mb, "gpus": spec.gpus,
            "vram_gb": spec.vram_gb, "gpu_types": list(spec.gpu_types)}


def spec_from_json(value: dict[str, Any] | None) -> ResourceSpec:
    """A stored spec (None: nothing asked)."""
    if not value:
        return ResourceSpec()
    return ResourceSpec(millicpus=int(value.get("millicpus", 0)),
                        memory_mb=int(value.get("memory_mb", 0)),
                        gpus=int(value.get("gpus", 0)), vram_gb=int(value.get("vram_gb", 0)),
                        gpu_types=tuple(str(t) for t in value.get("gpu_types", ())))


def resources_of(ws: Workspace) -> ResourceSpec:
    """What the workspace asked for, for the scheduler: its stored, resolved spec, or
    an empty one (no GPUs, no CPU or memory floor) for rows older than requests."""
    return spec_from_json(ws.resources)


def asks_capacity(spec: ResourceSpec) -> bool:
    """Whether a spec needs checking against the fleet (a plain 0-GPU request does not)."""
    return bool(spec.gpus or spec.millicpus or spec.memory_mb)


#: How long the registered host shapes are reused before being read again.
SHAPES_TTL_S = 5.0
#: A refusal is only given on shapes at most this old: a cached read that misses a
#: host registered since must not refuse what that host can hold.
SHAPES_RECHECK_S = 1.0


def read_shapes(session: Session) -> tuple[HostInventory, ...]:
    """The distinct shapes of the registered agents: O(hosts), hence cached."""
    shapes = {inventory_from_json(inv, UNBOUNDED)
              for inv in session.execute(select(Agent.inventory)).scalars()}
    return tuple(sorted(shapes, key=repr))


class FleetShapes:
    """The registered host shapes, read at most every ``SHAPES_TTL_S`` per process
    (per-request cost stays O(1): creations never scan the hosts on their own)."""

    def __init__(self, host_gpus: str = "", max_hosts: int = 0) -> None:
        self._read: tuple[float, tuple[HostInventory, ...]] | None = None
        self.autoscaled_gpus = _autoscaler_gpus(host_gpus, max_hosts)

    def get(self, session: Session, max_age_s: float = SHAPES_TTL_S
            ) -> tuple[HostInventory, ...]:
        if self._read is None or time.monotonic() - self._read[0] >= max_age_s:
            self._read = (time.monotonic(), read_shapes(session))
        return self._read[1]

    def reason(self, session: Session, spec: ResourceSpec, max_age_s: float = SHAPES_TTL_S
               ) -> str | None:
        """Why no host could ever hold ``spec`` (None: some could)."""
        shapes = self.get(session, max_age_s)
        autoscaled = (autoscaled_shape(self.autoscaled_gpus, shapes)
                      if self.autoscaled_gpus else None)
        return unsatisfiable_reason(spec, shapes, autoscaled=autoscaled)

    def check(self, session: Session, spec: ResourceSpec) -> None:
        """Refuse (422) a spec no host shape can ever satisfy, saying why."""
        if not asks_capacity(spec):
            return  # as cheap as before requests existed: no hosts query
        reason = self.reason(session, spec)
        if reason is not None:
            reason = self.reason(session, spec, SHAPES_RECHECK_S)
        if reason is not None:
            raise InvalidInput(f"resources cannot be satisfied: {reason}", field="resources",
                               reason="unsatisfiable")


def _autoscaler_gpus(host_gpus: str, max_hosts: int) -> tuple[GpuGroup, ...]:
    """The GPUs of an autoscaled host, or none if the autoscaler adds no hosts. A
    spec that does not parse adds none either (the control plane's own config is
    checked where it starts; a user's request must not fail on it)."""
    if max_hosts <= 0 or not host_gpus.strip():
        return ()
    try:
        return parse_gpu_spec(host_gpus)
    except InvalidInput:
        return ()


def resolve_resources(session: Session, principal: Principal,
                      requested: ResourceSpec | None) -> ResourceSpec:
    """The request as given, else the project's default, else nothing (no GPUs)."""
    if requested is not None:
        return requested
    default = session.execute(
        select(Project.default_resources).where(Project.id == principal.project_id)
    ).scalar_one_or_none()
    return spec_from_json(default)


# ------------------------------------------------------------------ API bodies
class ResourcesBody(BaseModel):
    """A workspace's resource request as resolved at creation (all fields, always)."""

    millicpus: int
    memory_mb: int
    gpus: int
    vram_gb: int
    gpu_types: list[str]


class CheckpointFailure(BaseModel):
    """A cell whose state could not be checkpointed (the kept one is older)."""

    cell: int
    at: str
    reason: str


class SnapshotSummary(BaseModel):
    """What a user may know of the last snapshot: when, how big, what it holds."""

    at: str | None = None
    bytes: int = 0
    kernels: list[str] = []
    packages: bool = False
    #: Said to the user (a running cell was interrupted to suspend).
    notes: list[str] = []
    #: kernel id -> the last cell whose state was saved after it ran (kernels whose
    #: latest state is a cell's checkpoint, not a suspend's).
    cells: dict[str, int] = {}
    #: kernel id -> the latest cell whose checkpoint failed since one was last kept.
    checkpoint_failures: dict[str, CheckpointFailure] = {}


class KernelLoss(BaseModel):
    """What one kernel came back with after its host was lost."""

    #: ``after_cell``: the state a cell's checkpoint saved; ``last_suspend``: the last
    #: suspend's; ``restarted``: the kernel had been restarted and nothing saved since,
    #: so it had no variables to bring back; ``none``: nothing had been saved.
    state: Literal["after_cell", "last_suspend", "restarted", "none"]
    as_of_cell: int | None = None
    #: The last cell the gateway saw complete (None when no client watched it).
    last_completed_cell: int | None = None
    #: Cells that completed but whose state had not reached the store.
    cells_not_saved: int | None = None
    #: Cells running or queued when the host was lost: answered with an error
    #: (``HostLost``) and never run again.
    interrupted: int = 0


class HostLoss(BaseModel):
    host: str | None
    at: str | None
    reason: str | None
    #: Until when the store held every file its kernels wrote, as the host last
    #: reported (None: not known): what they wrote after it was lost.
    files_as_of: str | None = None
    kernels: dict[str, KernelLoss] = {}


class RestoreSummary(BaseModel):
    """What one resume (of ``generation``) restored, each kernel's report as its agent
    sent it: only the fields its restore set."""

    generation: int
    at: str
    kernels: dict[str, RestoreReport] = {}
    packages: LayerRestore = Field(default_factory=LayerRestore)
    #: Kernels restored by an earlier attempt whose report was lost.
    unreported: list[str] = []
    #: Set when this placement followed the loss of the workspace's host.
    host_lost: HostLoss | None = None


class WorkspaceBody(BaseModel):
    """A workspace as the API shows it (documentation: bodies are built by ``to_json``)."""

    id: str
    name: str
    state: WorkspaceState
    desired_state: DesiredState
    generation: int
    host_id: str | None
    last_error: str | None
    resources: ResourcesBody
    snapshot: SnapshotSummary | None
    #: The last resume's restore (a resume's own answer: that resume's only, else null).
    restore: RestoreSummary | None
    created_at: str
    updated_at: str


class WorkspacePage(BaseModel):
    items: list[WorkspaceBody]
    #: The cursor of the next page (``after``), null on the last.
    next: str | None


def to_json(ws: Workspace) -> dict[str, Any]:
    return {
        "id": ws.id,
        "name": ws.name,
        "state": ws.state,
        "desired_state": ws.desired_state,
        "generation": ws.generation,
        "host_id": ws.host_id,
        "last_error": ws.last_error,
        "resources": spec_json(resources_of(ws)),
        "snapshot": _snapshot_summary(ws.snapshot),
        "restore": ws.restore,
        "created_at": iso(ws.created_at),
        "updated_at": iso(ws.updated_at),
    }


def _snapshot_summary(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a user may know of the last snapshot: when, how big, what it holds."""
    if not snapshot:
        return None
    return {"at": snapshot.get("at"), "bytes": snapshot.get("bytes", 0),
            "kernels": sorted(snapshot.get("kernels", {})),
            "packages": snapshot.get("packages") is not None,
            "notes": snapshot.get("notes", []),
            "cells": {kid: k["cell"] for kid, k in (snapshot.get("kernels") or {}).items()
                      if isinstance(k, dict) and isinstance(k.get("cell"), int)},
            "checkpoint_failures": dict(snapshot.get("checkpoint_failures") or {})}


def is_done(ws: Workspace) -> bool:
    """True once a requested change has run its course. ``failed`` is not the end of
    one: the reconciler retries a failed placement (with backoff) until it succeeds
    or another state is requested, so a wait goes on and, if time runs out, answers
    202 with the last error rather than a final-looking failure."""
    state = WorkspaceState(ws.state)
    return is_settled(state, DesiredState(ws.desired_state)) or state is WorkspaceState.DELETED


def for_request(body: dict[str, Any], generation: int) -> dict[str, Any]:
    """``body`` answering the request that produced ``generation``: a restore summary
    recorded for another generation (an earlier resume) is left out."""
    restore = body.get("restore")
    if isinstance(restore, dict) and restore.get("generation") != generation:
        return {**body, "restore": None}
    return body


def get_visible(session: Session, principal: Principal, workspace_id: str,
                for_update: bool = False) -> Workspace:
    """The workspace if this principal may see it; 404 otherwise (no existence leak)."""
    query = select(Workspace).where(Workspace.id == workspace_id)
    if for_update:
        query = query.with_for_update()
    ws = session.execute(query).scalar_one_or_none()
    if ws is None or not principal.can_see(ws.org_id, ws.project_id):
        raise NotFound(f"workspace {workspace_id} not found")
    return ws


def create(session: Session, principal: Principal, name: str, now: datetime,
           resources: ResourceSpec | None = None) -> Workspace:
    """A new workspace asking for ``resources`` (already resolved and checked), if
    its owner's and project's quotas have room (403 otherwise): counted in this
    transaction, before the insert, so concurrent creates cannot all fit."""
    resources = resources or ResourceSpec()
    quotas.admit_new_workspace(session, principal.project_id, principal.user_id,
                               resources.gpus)
    ws = Workspace(
        id=new_id("ws"),
        org_id=principal.org_id,
        project_id=principal.project_id,
        owner_id=principal.user_id,
        name=name,
        state=WorkspaceState.CREATING,
        desired_state=DesiredState.RUNNING,
        generation=1,
        pending=True,
        attempts=0,
        resources=spec_json(resources),
        created_at=now,
        updated_at=now,
    )
    session.add(ws)
    session.add(WorkspaceEvent(workspace_id=ws.id, from_state=None, to_state=ws.state,
                               reason="created", created_at=now))
    return ws


def request_state(ws: Workspace, desired: DesiredState, now: datetime) -> None:
    """Record a new desired state; a repeat of the current one changes nothing.
    Asking a workspace that is not to run to run again (a resume, by any door: the
    API, the dashboard, Lab, a kernel request) counts against the running and GPU
    quotas, in the caller's transaction (``ws`` is locked by it)."""
    check_request(WorkspaceState(ws.state), desired, DesiredState(ws.desired_state))
    if ws.desired_state == desired:
        if desired is DesiredState.RUNNING and ws.state == WorkspaceState.FAILED:
            ask_again(ws, now)
        return
    session = object_session(ws)
    if desired is DesiredState.RUNNING and session is not None:
        quotas.admit_running(session, ws)
    ws.desired_state = desired
    ws.generation += 1
    ws.pending = True
    ws.attempts = 0
    ws.next_attempt_at = None
    ws.updated_at = now


def ask_again(ws: Workspace, now: datetime) -> None:
    """A resume of a ``failed`` workspace: its placement is tried again at once.
    Its desired state is already ``running``, so without this the resume changed
    nothing: a placement refused for good stayed failed, and one waiting out a
    backoff grown to minutes went on waiting. The reason stays in ``last_error``
    until the attempt settles or says another; the generation is the same request's."""
    ws.pending = True
    ws.attempts = 0
    ws.next_attempt_at = None
    ws.updated_at = now


def transition(session: Session, ws: Workspace, new: WorkspaceState, now: datetime,
               reason: str | None = None) -> None:
    old = WorkspaceState(ws.state)
    check_transition(old, new)
    ws.state = new
    ws.updated_at = now
    ws.pending = not is_settled(new, DesiredState(ws.desired_state))
    session.add(WorkspaceEvent(workspace_id=ws.id, from_state=old, to_state=new, reason=reason,
                               created_at=now))
    WORKSPACE_TRANSITIONS.labels(str(old), str(new)).inc()
