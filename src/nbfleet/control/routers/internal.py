"""``/internal``: agent registration and heartbeats, authenticated by the cluster secret."""

from __future__ import annotations

import asyncio
import random

from fastapi import APIRouter, Depends, Request

from nbfleet.control import drain, failover, hosts
from nbfleet.control.deps import platform_of
from nbfleet.jobs import attempts
from nbfleet.model.errors import InvalidInput, Unauthorized
from nbfleet.protocol.agent import (
    AttemptFinish,
    AttemptFinished,
    DrainRequest,
    Heartbeat,
    HeartbeatReply,
    JobDirectives,
    JobHeartbeats,
    Registered,
    Registration,
)
from nbfleet.protocol.checkpoints import CellCheckpoint, CheckpointRecorded
from nbfleet.protocol.gpu import ReleasedCells
from nbfleet.protocol.hosts import HostDrainState
from nbfleet.web.credentials import is_cluster_secret
from nbfleet.web.problems import bearer_token


def require_cluster_secret(request: Request) -> None:
    token = bearer_token(request.headers.get("authorization"))
    if not is_cluster_secret(token, platform_of(request).config.secret):
        raise Unauthorized("internal calls need the cluster secret")


router = APIRouter(prefix="/internal", tags=["internal"], include_in_schema=False,
                   dependencies=[Depends(require_cluster_secret)])


@router.post("/agents")
def register_agent(body: Registration, request: Request) -> Registered:
    platform = platform_of(request)
    with platform.db.transaction() as session:
        lost = hosts.register(session, platform.db.now(session), body.model_dump())
    if lost:
        platform.wake()
    return Registered(blobs_url=platform.config.blobs_url)


@router.post("/agents/{agent_id}/heartbeat")
def agent_heartbeat(agent_id: str, body: Heartbeat, request: Request) -> HeartbeatReply:
    """Record the host alive; answer with the agent timeout (the agent's lease on
    writing files to the store) and which of its runtimes are no longer its own.
    Older agents ignored the 204 this used to be, and ignore the body."""
    platform = platform_of(request)
    with platform.db.transaction() as session:
        now = platform.db.now(session)
        hosts.heartbeat(session, now, agent_id, body.boot_id, body.files_lag_s,
                        body.disk_short)
        hosts.record_file_syncs(session, agent_id, body.boot_id,
                                [(r.workspace_id, r.files_unsynced_s) for r in body.runtimes],
                                now)
        for death in body.kernel_deaths:
            hosts.kernel_died(session, agent_id, death.workspace_id,
                              f"kernel {death.kernel_id}: {death.reason}")
        stale = hosts.stale_runtimes(session, agent_id, body.boot_id,
                                     [(r.workspace_id, r.generation) for r in body.runtimes])
    return HeartbeatReply(agent_timeout_s=platform.config.agent_timeout_s, stale=stale)


@router.post("/agents/{agent_id}/drain")
def agent_drain(agent_id: str, body: DrainRequest, request: Request) -> HostDrainState:
    """An agent told to stop (SIGTERM) asks to be drained, and asks again to see
    how many workspaces are still on it: the admin drain, started by the host. Only
    the host's current boot may (409 otherwise, as for heartbeats)."""
    platform = platform_of(request)
    with platform.db.transaction() as session:
        hosts.heartbeat(session, platform.db.now(session), agent_id, body.boot_id)
        found = drain.start(session, agent_id, platform.db.now(session))
    platform.wake()
    return found


@router.post("/workspaces/{workspace_id}/checkpoints")
async def cell_checkpoint(workspace_id: str, body: CellCheckpoint,
                          request: Request) -> CheckpointRecorded:
    """An agent saved a kernel's state after a cell: kept as the kernel's latest
    state if the agent still runs the workspace (``failover``), and sent on to its
    standby replicas (``standbys``). A restart's report (no key) has nothing to
    stage: a promotion restores the recorded state, which is then none."""
    platform = platform_of(request)
    recorded = await asyncio.to_thread(failover.record_checkpoint, platform.db,
                                       workspace_id, body)
    if recorded.kept and body.key is not None:
        await platform.standbys.checkpointed(workspace_id, body.generation, body.kernel_id,
                                             body.key, body.cell)
    return recorded


@router.post("/agents/{agent_id}/released", status_code=204)
async def cells_released(agent_id: str, body: ReleasedCells, request: Request) -> None:
    """An agent reports GPU cells that ended (reply, interrupt, death, suspend); the
    scheduler releases those it placed on that agent, and ignores the rest. Those
    ``held`` (a GPU still open in their slot) stay committed and billed."""
    if body.agent_id != agent_id:
        raise InvalidInput("agent_id in the body does not match the path")
    platform_of(request).fleet.released(agent_id, body.task_ids, body.held)


@router.post("/jobs/heartbeats")
def job_heartbeats(body: JobHeartbeats, request: Request) -> JobDirectives:
    """An agent's report on its running attempts; answers what each should do."""
    platform = platform_of(request)
    beats = [attempts.Beat(b.job_id, b.attempt, b.seq, b.gpu_ms, b.progress, b.log_chunks)
             for b in body.attempts]
    with platform.db.transaction() as session:
        directives = attempts.heartbeat(session, body.agent_id, body.boot_id, beats,
                                        platform.jobs, platform.db.now(session))
    return JobDirectives.model_validate({"directives": [d.as_json() for d in directives]})


@router.post("/jobs/{job_id}/attempts/{attempt}/finish")
def finish_attempt(job_id: str, attempt: int, body: AttemptFinish,
                   request: Request) -> AttemptFinished:
    """An attempt's process ended. 409 if the attempt is stale (fenced off)."""
    platform = platform_of(request)
    facts = attempts.Facts(seq=body.seq, gpu_ms=body.gpu_ms, exit_code=body.exit_code,
                           signal=body.signal, killed_for=body.killed_for,
                           launch_error=body.launch_error, output_tail=body.output_tail,
                           result=body.result, log_chunks=body.log_chunks)
    with platform.db.transaction() as session:
        job = attempts.finish(session, job_id, attempt, body.agent_id, body.boot_id, facts,
                              platform.jobs, platform.db.now(session), random.random())
        state = job.state
    platform.wake_jobs()
    return AttemptFinished(job_id=job_id, attempt=attempt, state=state)
