"""What is already true, read for the scheduler: the hosts that are alive, the GPU
kernels placed on them (the database), and the cells the agents report running
with GPUs bound (each agent, asked directly). A rebuild loads these; the
periodic passes compare the model with them."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from nbfleet.control import hosts
from nbfleet.control.fleet.scheduler import CellFacts, KernelFacts
from nbfleet.control.workspaces import spec_from_json
from nbfleet.db.tables import Agent, Kernel, Project, Workspace
from nbfleet.model.errors import DomainError
from nbfleet.model.resources import HostInventory, inventory_from_json
from nbfleet.model.workspace import WorkspaceState
from nbfleet.protocol.gpu import AgentBindings

if TYPE_CHECKING:
    from nbfleet.control.platform import Platform

log = logging.getLogger(__name__)

#: A host as the scheduler needs it: id, inventory, the agent's URL.
HostFact = tuple[str, HostInventory, str]

#: Workspace states whose runtime holds (or is about to hold) its placement.
PLACED_STATES = (WorkspaceState.RUNNING, WorkspaceState.RESUMING, WorkspaceState.CREATING,
                 WorkspaceState.SUSPENDING)


def alive_hosts(platform: Platform) -> list[HostFact]:
    """The agents that heartbeat within the timeout, by id."""
    with platform.db.transaction(write=False) as session:
        return _alive(platform, session)


def placed(platform: Platform) -> tuple[list[HostFact], list[KernelFacts]]:
    """The alive hosts and, read in the same transaction, every GPU workspace whose
    runtime holds its placement, with its project (its tenant in the fair queue)
    and that project's weight."""
    with platform.db.transaction(write=False) as session:
        kernels: list[KernelFacts] = []
        for ws, weight in session.execute(
                select(Workspace, Project.job_weight)
                .join(Project, Project.id == Workspace.project_id)
                .where(Workspace.state.in_([str(s) for s in PLACED_STATES]),
                       Workspace.gpu_placement.is_not(None))):
            placement = ws.gpu_placement or {}
            kernels.append(KernelFacts(
                ws.id, spec_from_json(ws.resources), tuple(placement.get("hosts", ())),
                tuple(placement.get("reserved", ())), ws.project_id, weight))
        return _alive(platform, session), kernels


def _alive(platform: Platform, session: Session) -> list[HostFact]:
    now = platform.db.now(session)
    alive = session.execute(
        select(Agent).where(Agent.last_heartbeat_at >= hosts.alive_since(
            now, platform.config.agent_timeout_s)).order_by(Agent.id)).scalars()
    return [(a.id, inventory_from_json(a.inventory), a.url) for a in alive]


async def reported_cells(platform: Platform, fleet: list[HostFact]) -> list[CellFacts]:
    """Every alive agent's bound cells; an agent that does not answer has none
    we can trust (its host is lost soon if it is really gone)."""
    answers = await asyncio.gather(*(agent_bindings(platform, url) for _, _, url in fleet))
    cells: list[CellFacts] = []
    for (host_id, _, _), report in zip(fleet, answers, strict=True):
        for active in report.bindings if report is not None else ():
            binding = active.binding
            if binding.host_id != host_id:
                continue  # a binding for another host is not this host's to report
            workspace_id = await asyncio.to_thread(_workspace_of, platform, active.kernel_id)
            if workspace_id is not None:
                cells.append(CellFacts(binding.task_id, workspace_id, host_id,
                                       tuple(binding.gpu_indices), active.age_s,
                                       active.held))
    return cells


async def agent_bindings(platform: Platform, url: str) -> AgentBindings | None:
    """The agent's own report of its bound cells; None if it cannot give one."""
    try:
        return await platform.agents.bindings(url)
    except (httpx.HTTPError, OSError, ValueError, DomainError) as exc:
        log.warning("agent %s did not report its bindings: %s", url, exc)
        return None


def _workspace_of(platform: Platform, kernel_id: str) -> str | None:
    with platform.db.transaction(write=False) as session:
        row = session.get(Kernel, kernel_id)
        return row.workspace_id if row is not None else None
