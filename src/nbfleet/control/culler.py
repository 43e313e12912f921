"""Idle auto-suspend: running workspaces that nobody uses are suspended.

One replica runs it, under a lease. Each pass asks every host with running
workspaces for its kernels (one call per host, not per workspace) and applies
:func:`nbfleet.policy.idle.should_suspend` with the project's timeout, or the
platform's. A suspend is requested like a user's, so the reconciler does the work,
and a workspace a user resumed or touched in the meantime is left alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import Counter
from sqlalchemy import select

from nbfleet.control import hosts, leases
from nbfleet.control.platform import Platform
from nbfleet.control.workspaces import request_state
from nbfleet.db.tables import Agent, Kernel, Project, Workspace
from nbfleet.model.errors import DomainError
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.policy.idle import KernelActivity, should_suspend
from nbfleet.protocol.agent import KernelModel

log = logging.getLogger(__name__)

LEASE = "idle-culler"
IDLE_SUSPENDS = Counter("nbfleet_idle_suspends_total", "Workspaces suspended for being idle")


@dataclass(frozen=True, slots=True)
class Candidate:
    workspace_id: str
    host_url: str
    generation: int
    running_s: float
    timeout_s: float
    kernel_ids: frozenset[str]


def candidates(platform: Platform) -> list[Candidate]:
    """Running workspaces whose timeout is on, with the host they run on."""
    config = platform.config
    with platform.db.transaction(write=False) as session:
        now = platform.db.now(session)
        rows = session.execute(
            select(Workspace, Agent.url, Project.idle_suspend_s)
            .join(Agent, Agent.id == Workspace.host_id)
            .join(Project, Project.id == Workspace.project_id)
            .where(Workspace.state == WorkspaceState.RUNNING,
                   Workspace.desired_state == DesiredState.RUNNING,
                   Agent.last_heartbeat_at >= hosts.alive_since(now, config.agent_timeout_s))
        ).all()
        kernels: dict[str, set[str]] = defaultdict(set)
        ids = [ws.id for ws, _, _ in rows]
        for start in range(0, len(ids), 500):
            for kernel_id, ws_id in session.execute(
                select(Kernel.id, Kernel.workspace_id)
                .where(Kernel.workspace_id.in_(ids[start:start + 500]))
            ).all():
                kernels[ws_id].add(kernel_id)
        found = []
        for ws, url, project_timeout in rows:
            timeout = config.idle_suspend_s if project_timeout is None else project_timeout
            if timeout > 0:
                found.append(Candidate(ws.id, url, ws.generation, _age(now, ws.updated_at),
                                       float(timeout), frozenset(kernels[ws.id])))
        return found


def _age(now: datetime, then: datetime) -> float:
    return max(0.0, (now - then).total_seconds())


def idle_ones(found: list[Candidate], models: dict[str, list[KernelModel]]) -> list[Candidate]:
    """The candidates to suspend, given each host's kernel models."""
    chosen = []
    for candidate in found:
        activity = [
            KernelActivity(m.execution_state, m.connections, m.idle_s)
            for m in models.get(candidate.host_url, []) if m.id in candidate.kernel_ids
        ]
        if len(activity) < len(candidate.kernel_ids):
            continue  # a kernel the host does not report: let the reconciler sort it out
        if should_suspend(activity, candidate.running_s, candidate.timeout_s):
            chosen.append(candidate)
    return chosen


def suspend(platform: Platform, candidate: Candidate, token: int) -> bool:
    """Ask for the suspend unless the workspace changed since it was judged idle."""
    with platform.db.transaction() as session:
        if not leases.still_held(session, LEASE, token):
            return False
        ws = session.get(Workspace, candidate.workspace_id, with_for_update=True)
        if (ws is None or ws.generation != candidate.generation
                or ws.state != WorkspaceState.RUNNING):
            return False
        request_state(ws, DesiredState.SUSPENDED, platform.db.now(session))
    IDLE_SUSPENDS.inc()
    log.info("suspending %s: idle for over %.0f s", candidate.workspace_id, candidate.timeout_s)
    return True


async def tick(platform: Platform) -> int:
    config = platform.config
    token = await asyncio.to_thread(leases.acquire, platform.db, LEASE, platform.instance_id,
                                    config.cull_interval_s * 2 + config.lease_ttl_s)
    if token is None:
        return 0
    found = await asyncio.to_thread(candidates, platform)
    urls = sorted({c.host_url for c in found})
    answers = await asyncio.gather(*(platform.agents.kernels(url) for url in urls),
                                   return_exceptions=True)
    models = {url: answer for url, answer in zip(urls, answers, strict=True)
              if not isinstance(answer, BaseException)}
    for url, answer in zip(urls, answers, strict=True):
        if isinstance(answer, DomainError):
            log.info("idle check skipped host %s: %s", url, answer.detail)
    suspended = 0
    for candidate in idle_ones(found, models):
        suspended += await asyncio.to_thread(suspend, platform, candidate, token)
    if suspended:
        platform.wake()
    return suspended


async def run_forever(platform: Platform) -> None:
    while True:
        try:
            await tick(platform)
        except Exception:
            log.exception("idle culler pass failed")
        await asyncio.sleep(platform.config.cull_interval_s)
