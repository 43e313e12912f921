"""The control plane's client for agents (HTTP, plus the URL of the kernel socket)."""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any
from urllib.parse import quote

import httpx

from nbfleet.model.errors import Conflict, DomainError, NotFound, SuspendFailed, Unavailable
from nbfleet.protocol.gpu import AgentBindings


class AgentClient:
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
                             kernels: list[dict[str, str]],
                             snapshot: dict[str, Any] | None = None,
                             limits: dict[str, Any] | None = None,
                             network: str | None = None) -> Any:
        body: dict[str, Any] = {"generation": generation, "kernels": kernels}
        if limits:
            body["limits"] = limits
        if network:
            body["network"] = network
        if snapshot:
            body["snapshot"] = {kid: k["key"] for kid, k in snapshot.get("kernels", {}).items()}
            body["packages"] = snapshot.get("packages")
        return await self._call("PUT", f"{base}/agent/v1/runtimes/{workspace_id}", json=body)

    async def suspend_runtime(self, base: str, workspace_id: str, generation: int,
                              on_busy: str, busy_timeout_s: float) -> Any:
        return await self._call("POST", f"{base}/agent/v1/runtimes/{workspace_id}/suspend",
                                json={"generation": generation, "on_busy": on_busy,
                                      "busy_timeout_s": busy_timeout_s})

    async def release_runtime(self, base: str, workspace_id: str, generation: int) -> Any:
        return await self._call("DELETE", f"{base}/agent/v1/runtimes/{workspace_id}",
                                params={"generation": generation})

    async def add_kernel(self, base: str, workspace_id: str, generation: int, kernel_id: str,
                         name: str) -> Any:
        return await self._call("POST", f"{base}/agent/v1/runtimes/{workspace_id}/kernels",
                                json={"generation": generation, "id": kernel_id, "name": name})

    async def bindings(self, base: str) -> AgentBindings:
        """The cells this agent has running with GPUs bound (its own report)."""
        return AgentBindings.model_validate(await self._call("GET", f"{base}/agent/v1/bindings"))

    async def kernels(self, base: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._call("GET", f"{base}/agent/v1/kernels")
        return result

    async def kernel(self, base: str, kernel_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"{base}/agent/v1/kernels/{kernel_id}")
        return result

    async def delete_kernel(self, base: str, kernel_id: str) -> None:
        await self._call("DELETE", f"{base}/agent/v1/kernels/{kernel_id}")

    async def interrupt(self, base: str, kernel_id: str) -> None:
        await self._call("POST", f"{base}/agent/v1/kernels/{kernel_id}/interrupt")

    async def restart(self, base: str, kernel_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST", f"{base}/agent/v1/kernels/{kernel_id}/restart"
        )
        return result

    async def put_file(self, base: str, workspace_id: str, path: str,
                       content: bytes | AsyncIterable[bytes], size: int | None = None) -> None:
        """``content`` may stream (then ``size``, when known, is sent as its length)."""
        headers = {"Content-Length": str(size)} if size is not None else {}
        await self._call("PUT", _file_url(base, workspace_id, path), content=content,
                         headers=headers)

    async def delete_file(self, base: str, workspace_id: str, path: str) -> None:
        await self._call("DELETE", _file_url(base, workspace_id, path))

    async def start_job(self, base: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", f"{base}/agent/v1/jobs", json=body)
        return result

    async def stop_job(self, base: str, job_id: str, attempt: int, reason: str,
                       grace_s: float) -> None:
        await self._call("POST", f"{base}/agent/v1/jobs/{job_id}/stop",
                         json={"attempt": attempt, "reason": reason, "grace_s": grace_s})

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
