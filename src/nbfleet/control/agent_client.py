"""The control plane's client for agents (HTTP, plus the URL of the kernel socket)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from nbfleet.model.errors import (
    Conflict,
    DomainError,
    InvalidInput,
    NotFound,
    SuspendFailed,
    Unavailable,
)
from nbfleet.protocol.agent import (
    AddKernel,
    EnsureRuntime,
    JobStatus,
    JobStopping,
    KernelModel,
    ReleaseRuntime,
    ResizeWarmPool,
    RuntimePlaced,
    RuntimeReleased,
    RuntimeSuspended,
    StartJob,
    StopJob,
    SuspendRuntime,
    WarmPoolState,
)
from nbfleet.protocol.checkpoints import StageCheckpoint, StandbyState
from nbfleet.protocol.gpu import AgentBindings

M = TypeVar("M", bound=BaseModel)
_KERNELS = TypeAdapter(list[KernelModel])
#: Seconds for a read the agent answers from memory, asked while a loop waits.
QUICK_READ_TIMEOUT_S = 5.0


class BadAnswer(Unavailable, ValueError):
    """An agent answered a call with a body that is not the contract's (a 502-like
    agent error; a ValueError too, as a failed validation was before)."""


class AgentClient:
    """Orders go out as :mod:`nbfleet.protocol.agent` models; answers come back
    validated into them (:class:`BadAnswer` when an agent's answer does not fit)."""

    def __init__(self, secret: str, timeout_s: float = 60.0) -> None:
        self.secret = secret
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(timeout_s, connect=3.0),
        )

    async def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        try:
            response = await self.http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise Unavailable(f"agent unreachable: {exc!r}") from exc
        if response.status_code < 300:
            return response.json() if response.content else None
        detail = _detail(response)
        if _body(response).get("runtime") == "kept":
            raise SuspendFailed(detail)
        if response.status_code == 404:
            raise NotFound(detail)
        if response.status_code == 409:
            raise Conflict(detail)
        if response.status_code < 500:
            raise DomainError(detail)
        raise Unavailable(f"agent error {response.status_code}: {detail}")

    async def ensure_runtime(self, base: str, workspace_id: str, generation: int,
                             kernels: list[tuple[str, str]],
                             snapshot: dict[str, Any] | None = None,
                             limits: dict[str, Any] | None = None,
                             network: str | None = None, gpus: int = 0,
                             notices: dict[str, str] | None = None) -> RuntimePlaced:
        """``snapshot`` as the workspace keeps it (``kernels``: id -> its upload)."""
        order = _order(EnsureRuntime, generation=generation,
                       **_runtime_fields(kernels, snapshot, limits, network, gpus),
                       notices=notices or {})
        return _answer(RuntimePlaced, await self._call(
            "PUT", f"{base}/agent/v1/runtimes/{workspace_id}", json=order.model_dump(mode="json")))

    async def suspend_runtime(self, base: str, workspace_id: str, generation: int,
                              on_busy: str, busy_timeout_s: float) -> RuntimeSuspended:
        order = _order(SuspendRuntime, generation=generation, on_busy=on_busy,
                       busy_timeout_s=busy_timeout_s)
        return _answer(RuntimeSuspended, await self._call(
            "POST", f"{base}/agent/v1/runtimes/{workspace_id}/suspend",
            json=order.model_dump(mode="json")))

    async def release_runtime(self, base: str, workspace_id: str,
                              generation: int) -> RuntimeReleased:
        order = _order(ReleaseRuntime, generation=generation)
        return _answer(RuntimeReleased, await self._call(
            "DELETE", f"{base}/agent/v1/runtimes/{workspace_id}",
            params=order.model_dump(mode="json")))

    async def keep_standby(self, base: str, workspace_id: str, generation: int,
                           kernels: list[tuple[str, str]], snapshot: dict[str, Any] | None,
                           limits: dict[str, Any] | None = None, network: str | None = None,
                           gpus: int = 0) -> StandbyState:
        """Keep the workspace warm on that host (``agent/standbys.py``)."""
        order = _order(EnsureRuntime, generation=generation,
                       **_runtime_fields(kernels, snapshot, limits, network, gpus))
        return _answer(StandbyState, await self._call(
            "PUT", f"{base}/agent/v1/standbys/{workspace_id}",
            json=order.model_dump(mode="json")))

    async def stage(self, base: str, workspace_id: str, generation: int, kernel_id: str,
                    key: str, cell: int | None) -> StandbyState:
        order = _order(StageCheckpoint, generation=generation, kernel_id=kernel_id, key=key,
                       cell=cell)
        return _answer(StandbyState, await self._call(
            "POST", f"{base}/agent/v1/standbys/{workspace_id}/stage",
            json=order.model_dump(mode="json")))

    async def drop_standby(self, base: str, workspace_id: str) -> None:
        await self._call("DELETE", f"{base}/agent/v1/standbys/{workspace_id}")

    async def add_kernel(self, base: str, workspace_id: str, generation: int, kernel_id: str,
                         name: str, *, env: Mapping[str, str] | None = None) -> KernelModel:
        """``env``: the kernel's ``KERNEL_*`` variables, already filtered by
        ``protocol.kernel_env.allowed_kernel_env`` (the agent filters them again)."""
        order = _order(AddKernel, generation=generation, id=kernel_id, name=name,
                       env=dict(env or {}))
        return _answer(KernelModel, await self._call(
            "POST", f"{base}/agent/v1/runtimes/{workspace_id}/kernels",
            json=order.model_dump(mode="json")))

    async def bindings(self, base: str) -> AgentBindings:
        """The cells this agent has running with GPUs bound (its own report). Asked
        of every host when the scheduler rebuilds its model: a host that does not
        answer (stalled, cut off) must not hold that rebuild, nor the loop that waits
        for it, for the client's whole timeout (it did, for 60 s)."""
        return _answer(AgentBindings, await self._call(
            "GET", f"{base}/agent/v1/bindings", timeout=QUICK_READ_TIMEOUT_S))

    async def warm_pool(self, base: str, target: int | None = None) -> WarmPoolState:
        """The agent's warm pool; with ``target``, grown to hold at least that many."""
        if target is None:
            return _answer(WarmPoolState,
                           await self._call("GET", f"{base}/agent/v1/warm-pool"))
        order = _order(ResizeWarmPool, target=target)
        return _answer(WarmPoolState, await self._call(
            "PUT", f"{base}/agent/v1/warm-pool", json=order.model_dump(mode="json")))

    async def kernels(self, base: str) -> list[KernelModel]:
        body = await self._call("GET", f"{base}/agent/v1/kernels")
        try:
            return _KERNELS.validate_python(body)
        except ValidationError as exc:
            raise _bad("list of KernelModel", exc) from exc

    async def kernel(self, base: str, kernel_id: str) -> KernelModel:
        return _answer(KernelModel,
                       await self._call("GET", f"{base}/agent/v1/kernels/{kernel_id}"))

    async def delete_kernel(self, base: str, kernel_id: str) -> None:
        await self._call("DELETE", f"{base}/agent/v1/kernels/{kernel_id}")

    async def interrupt(self, base: str, kernel_id: str) -> None:
        await self._call("POST", f"{base}/agent/v1/kernels/{kernel_id}/interrupt")

    async def restart(self, base: str, kernel_id: str) -> KernelModel:
        return _answer(KernelModel,
                       await self._call("POST", f"{base}/agent/v1/kernels/{kernel_id}/restart"))

    async def put_file(self, base: str, workspace_id: str, path: str,
                       content: bytes | AsyncIterable[bytes], size: int | None = None) -> None:
        """``content`` may stream (then ``size``, when known, is sent as its length)."""
        headers = {"Content-Length": str(size)} if size is not None else {}
        await self._call("PUT", _file_url(base, workspace_id, path), content=content,
                         headers=headers)

    async def delete_file(self, base: str, workspace_id: str, path: str) -> None:
        await self._call("DELETE", _file_url(base, workspace_id, path))

    async def start_job(self, base: str, body: dict[str, Any]) -> JobStatus:
        """``body``: a :class:`StartJob`'s fields (``jobs.dispatch`` builds them)."""
        order = _order(StartJob, **body)
        return _answer(JobStatus, await self._call("POST", f"{base}/agent/v1/jobs",
                                                   json=order.model_dump(mode="json")))

    async def stop_job(self, base: str, job_id: str, attempt: int, reason: str,
                       grace_s: float) -> JobStopping:
        order = _order(StopJob, attempt=attempt, reason=reason, grace_s=grace_s)
        return _answer(JobStopping, await self._call(
            "POST", f"{base}/agent/v1/jobs/{job_id}/stop", json=order.model_dump(mode="json")))

    @staticmethod
    def channels_url(base: str, kernel_id: str) -> str:
        return base.replace("http", "ws", 1) + f"/agent/v1/kernels/{kernel_id}/channels"

    async def aclose(self) -> None:
        await self.http.aclose()


def _file_url(base: str, workspace_id: str, path: str) -> str:
    """Quoted: a file may be named ``a?b`` or ``100%``, which must reach the agent as
    that name, not as a query or an escape."""
    return f"{base}/agent/v1/runtimes/{workspace_id}/files/{quote(path, safe='/')}"


def _body(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _detail(response: httpx.Response) -> str:
    body = _body(response)
    return str(body.get("detail") or body) if body else response.text[:500]


def _order(model: type[M], **fields: Any) -> M:
    """An order as the contract's model. One that does not fit is refused here, as
    the agent would refuse it (its 422), before anything is sent."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise InvalidInput(f"invalid {model.__name__} order: {_problems(exc)}") from exc


def _answer(model: type[M], body: Any) -> M:
    """The agent's answer as the contract's model."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _bad(model.__name__, exc) from exc


def _bad(what: str, exc: ValidationError) -> BadAnswer:
    """An answer that does not fit is the agent's error, said once here rather than
    as a missing key further on."""
    return BadAnswer(f"the agent's answer is not a valid {what}: {_problems(exc)}")


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
                     for e in exc.errors()[:5])


def _runtime_fields(kernels: list[tuple[str, str]], snapshot: dict[str, Any] | None,
                    limits: dict[str, Any] | None, network: str | None,
                    gpus: int) -> dict[str, Any]:
    """A runtime's or a standby's order, from the workspace as the control plane keeps
    it (``snapshot["kernels"]``: id -> its upload)."""
    snapshot = snapshot or {}
    return {"kernels": [{"id": kid, "name": name} for kid, name in kernels],
            "snapshot": {kid: k["key"] for kid, k in (snapshot.get("kernels") or {}).items()},
            "packages": snapshot.get("packages"), "limits": limits or None,
            "network": network or "none", "gpus": gpus}
