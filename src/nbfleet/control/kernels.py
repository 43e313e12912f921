"""A workspace's kernels: where they run, starting and stopping them, their models.

Kernels are rows that outlive their processes: while the workspace does not run
they rest (``resting_kernels``) and keep their ids. The gateway routes, JupyterLab's
sessions and the channels relay all go through here.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from nbfleet.control import hosts, quotas, resting_kernels, workspaces
from nbfleet.control.auth import Principal
from nbfleet.control.platform import Platform
from nbfleet.db.tables import Agent, Kernel, Workspace
from nbfleet.model.errors import Conflict, InvalidInput, NotFound
from nbfleet.model.workspace import DesiredState, WorkspaceState
from nbfleet.protocol.agent import KernelModel

JUPYTER_FIELDS = ("id", "name", "last_activity", "execution_state", "connections")


@dataclass(frozen=True, slots=True)
class Placement:
    host_url: str
    generation: int
    kernel_ids: tuple[str, ...]
    specs: dict[str, Any]
    #: GPUs each cell binds (0: the workspace has none, and its frames pass untouched).
    gpus: int = 0
    host_id: str = ""


def placement(platform: Platform, principal: Principal, workspace_id: str) -> Placement:
    """Where the workspace runs now; 409 naming its state when it is not running."""
    with platform.db.transaction(write=False) as session:
        ws = workspaces.get_visible(session, principal, workspace_id)
        if ws.desired_state == DesiredState.DELETED:
            raise Conflict("workspace is being deleted", current_state=ws.state)
        if ws.state != WorkspaceState.RUNNING:
            raise Conflict(f"workspace is {ws.state}; resume it to use kernels",
                           current_state=ws.state)
        now = platform.db.now(session)
        agent = hosts.alive_agent(session, ws.host_id, now, platform.config.agent_timeout_s)
        if agent is None or agent.boot_id != ws.host_boot_id:
            raise Conflict("workspace runtime is being re-placed; retry shortly",
                           current_state=ws.state)
        kernel_ids = tuple(
            session.execute(select(Kernel.id).where(Kernel.workspace_id == ws.id)).scalars()
        )
        specs = dict(agent.inventory.get("kernelspecs", {}))
        return Placement(agent.url, ws.generation, kernel_ids, specs,
                         workspaces.resources_of(ws).gpus, agent.id)


def any_specs(platform: Platform, principal: Principal, workspace_id: str) -> dict[str, Any]:
    """Kernelspecs are listed even while suspended: from any host's inventory."""
    with platform.db.transaction(write=False) as session:
        workspaces.get_visible(session, principal, workspace_id)
        for inventory in session.execute(select(Agent.inventory)).scalars():
            if inventory.get("kernelspecs"):
                return dict(inventory["kernelspecs"])
    return {}


def jupyter_model(model: KernelModel) -> dict[str, Any]:
    return model.model_dump(mode="json", include=set(JUPYTER_FIELDS))


def default_spec(specs: dict[str, Any]) -> str:
    return "python3" if "python3" in specs else next(iter(specs), "python3")


async def kernel_models(platform: Platform, principal: Principal,
                        workspace_id: str) -> dict[str, dict[str, Any]]:
    """The workspace's kernels by id: live models, or resting ones while it does not run."""
    try:
        where = await asyncio.to_thread(placement, platform, principal, workspace_id)
    except Conflict:
        models = await asyncio.to_thread(resting_kernels.resting_models, platform, principal,
                                         workspace_id)
        return {model["id"]: model for model in models}
    mine = set(where.kernel_ids)
    return {m.id: jupyter_model(m) for m in await platform.agents.kernels(where.host_url)
            if m.id in mine}


async def launch_kernel(platform: Platform, principal: Principal, workspace_id: str,
                        name: str | None, env: dict[str, str]) -> dict[str, Any]:
    """Start a kernel (resuming a suspended workspace first); its Jupyter model."""
    where = await woken_placement(platform, principal, workspace_id)
    name = name or default_spec(where.specs)
    if name not in where.specs:
        raise InvalidInput(f"unknown kernelspec {name!r}; available: {sorted(where.specs)}")
    kernel_id = str(uuid.uuid4())
    await asyncio.to_thread(_insert_kernel, platform, workspace_id, kernel_id, name)
    try:
        model = await platform.agents.add_kernel(where.host_url, workspace_id, where.generation,
                                                 kernel_id, name, env=env)
    except BaseException:
        await asyncio.to_thread(_delete_kernel_row, platform, kernel_id)
        raise
    return jupyter_model(model)


def _insert_kernel(platform: Platform, workspace_id: str, kernel_id: str, name: str) -> None:
    """The kernel's row, if the workspace's kernel quota has room (403 otherwise).
    The workspace row is locked first, so two starts in one workspace are counted
    one after the other and cannot both take its last place."""
    with platform.db.transaction() as session:
        ws = session.get(Workspace, workspace_id, with_for_update=True)
        if ws is None:
            raise NotFound(f"workspace {workspace_id} not found")
        quotas.admit_kernel(session, ws)
        session.add(Kernel(id=kernel_id, workspace_id=workspace_id, name=name,
                           created_at=platform.db.now(session)))


def _delete_kernel_row(platform: Platform, kernel_id: str) -> None:
    with platform.db.transaction() as session:
        row = session.get(Kernel, kernel_id)
        if row is not None:
            session.delete(row)


async def woken_placement(platform: Platform, principal: Principal,
                          workspace_id: str) -> Placement:
    """Where the workspace runs, resuming it first if it is suspended."""
    try:
        return await asyncio.to_thread(placement, platform, principal, workspace_id)
    except Conflict:
        await resting_kernels.wake(platform, principal, workspace_id)
        return await asyncio.to_thread(placement, platform, principal, workspace_id)


async def kernel_placement(platform: Platform, principal: Principal, workspace_id: str,
                           kernel_id: str, wake: bool = False) -> Placement:
    """Where the kernel runs; 404 for a kernel the workspace does not have. A
    resting kernel is 404 here unless ``wake``, which resumes its workspace."""
    try:
        where = await asyncio.to_thread(placement, platform, principal, workspace_id)
    except Conflict as exc:
        if not wake:
            raise NotFound(f"kernel {kernel_id} is not running: {exc.detail}") from exc
        await asyncio.to_thread(resting_kernels.resting_model, platform, principal,
                                workspace_id, kernel_id)  # 404 unless it is one of its own
        await resting_kernels.wake(platform, principal, workspace_id)
        where = await asyncio.to_thread(placement, platform, principal, workspace_id)
    if kernel_id not in where.kernel_ids:
        raise NotFound(f"kernel {kernel_id} not found")
    return where


async def running_or_resting(platform: Platform, principal: Principal, workspace_id: str,
                             kernel_id: str) -> Placement | dict[str, Any]:
    """Where the kernel runs, or its resting model while its workspace does not run."""
    try:
        where = await asyncio.to_thread(placement, platform, principal, workspace_id)
    except Conflict:
        return await asyncio.to_thread(resting_kernels.resting_model, platform, principal,
                                       workspace_id, kernel_id)
    if kernel_id not in where.kernel_ids:
        raise NotFound(f"kernel {kernel_id} not found")
    return where


async def shut_down_kernel(platform: Platform, principal: Principal, workspace_id: str,
                           kernel_id: str) -> None:
    """Stop the kernel if it runs, and forget it (404 for a kernel not the caller's)."""
    where = await running_or_resting(platform, principal, workspace_id, kernel_id)
    if not isinstance(where, dict):
        with contextlib.suppress(NotFound):
            await platform.agents.delete_kernel(where.host_url, kernel_id)
    await asyncio.to_thread(_delete_kernel_row, platform, kernel_id)


