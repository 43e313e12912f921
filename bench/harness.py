"""What every benchmark needs: a throwaway ``nbfleet up``, a user, a kernel, percentiles.

Each benchmark starts the platform itself, on a free port with its own temporary
home, and stops it on the way out, even when interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager
from rich.console import Console

from nbfleet.db.engine import Database
from nbfleet.db.migrate import upgrade
from nbfleet.sdk.kernel_socket import KernelSocket

START_TIMEOUT_S = 120.0

stderr = Console(stderr=True)

#: The process of each running :func:`nbfleet_up`, by its URL.
SERVER_PIDS: dict[str, int] = {}


def emit(bench: str, figure: str, value: float) -> None:
    """One figure as one JSON line on stdout."""
    print(json.dumps({"bench": bench, "figure": figure, "value": round(value, 3)},
                     separators=(",", ":")), flush=True)


def measured(bench: str, run: Callable[[Path], Coroutine[Any, Any, dict[str, float]]]
             ) -> dict[str, float] | None:
    """Run a benchmark in a temporary directory and emit its figures; None when it
    was interrupted (everything it started is stopped on the way out)."""
    with tempfile.TemporaryDirectory(prefix="nbfleet-bench-") as tmp:
        try:
            results: dict[str, float] = asyncio.run(run(Path(tmp)))
        except KeyboardInterrupt:
            stderr.print("interrupted; cleaned up")
            return None
    for name, value in results.items():
        emit(bench, name, value)
    return results


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile (1..99), interpolated between the samples."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def p95(values: list[float]) -> float:
    return percentile(values, 95)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def nbfleet_up(home: Path, *args: str) -> Iterator[str]:
    """A whole platform in one subprocess (its own home and port); yields its URL.

    Stopped with SIGTERM, which shuts its kernels down too (they run in sessions of
    their own, so killing the process group would orphan them).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "nbfleet-up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_HOME"] = str(home)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbfleet.cli.main", "up", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        try:
            wait_for(lambda: healthy(url), proc, f"nbfleet up on {url}")
        except BaseException:
            stderr.print(f"nbfleet up log ({log}):\n{tail(log)}", markup=False)
            raise
        SERVER_PIDS[url] = proc.pid
        yield url
    finally:
        SERVER_PIDS.pop(url, None)
        stop(proc)


def process_cpu_s(pid: int) -> float:
    """User + system CPU so far of process ``pid`` alone, all its threads (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    """Until ``ready()``; fails at once if ``proc`` exits, or after START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up")
        time.sleep(0.1)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def throwaway_db(kind: str, pg_url: str, directory: Path, name: str) -> Iterator[Database]:
    """A migrated, empty database of ``kind`` (``directory/name.db``, or a fresh
    PostgreSQL database), removed afterwards."""
    if kind == "sqlite":
        directory.mkdir(parents=True, exist_ok=True)
        sqlite = Database(f"sqlite:///{directory / f'{name}.db'}")
        try:
            upgrade(sqlite.engine)
            yield sqlite
        finally:
            sqlite.dispose()
        return
    import psycopg

    database = f"nbf_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    db: Database | None = None
    try:
        db = Database(f"{pg_url.rsplit('/', 1)[0]}/{database}")
        upgrade(db.engine)
        yield db
    finally:
        if db is not None:
            db.dispose()
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(empty)"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then the process group's SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def gateway_kernel(url: str, home: Path) -> tuple[KernelSocket, str]:
    """A user, a running workspace and a kernel in it; returns its socket and kernel id."""
    sock, kernel_id, _, _ = await workspace_kernel(url, home)
    return sock, kernel_id


def admin_headers(home: Path) -> dict[str, str]:
    """The ``Authorization`` header of the platform's admin (its token is in the home)."""
    return {"Authorization": f"Bearer {(home / 'admin-token').read_text().strip()}"}


async def workspace_kernel(url: str, home: Path, name: str = "bench",
                           resources: dict[str, Any] | None = None
                           ) -> tuple[KernelSocket, str, str, str]:
    """Like :func:`gateway_kernel`, also returning the workspace id and the user's token;
    ``name`` names the user (a tenant of its own: org ``name``, project ``bench``) and
    the workspace; ``resources`` is what the workspace asks for (e.g. GPUs)."""
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as http:
        user = await http.post("/v1/admin/users", headers=admin_headers(home),
                               json={"name": name, "org": name, "project": "bench"})
        user.raise_for_status()
        token: str = user.json()["token"]
        http.headers["Authorization"] = f"Bearer {token}"
        body: dict[str, Any] = {"name": name}
        if resources is not None:
            body["resources"] = resources
        created = await http.post("/v1/workspaces", json=body)
        created.raise_for_status()
        workspace = created.json()["id"]
        deadline = time.monotonic() + START_TIMEOUT_S
        while (state := (await http.get(f"/v1/workspaces/{workspace}")).json()["state"]) \
                != "running":
            if time.monotonic() > deadline:
                raise TimeoutError(f"workspace {workspace} stuck in {state}")
            await asyncio.sleep(0.1)
        started = await http.post(f"/v1/workspaces/{workspace}/api/kernels",
                                  json={"name": "python3"})
        started.raise_for_status()
        kernel_id: str = started.json()["id"]
    return (await KernelSocket.connect(channels_url(url, workspace, kernel_id), token),
            kernel_id, workspace, token)


def channels_url(url: str, workspace: str, kernel_id: str) -> str:
    """The WebSocket address of a workspace kernel's channels on ``url``."""
    return (url.replace("http", "ws", 1)
            + f"/v1/workspaces/{workspace}/api/kernels/{kernel_id}/channels")


async def grant_credits(url: str, home: Path, org: str, micro_credits: int,
                        project: str = "bench") -> None:
    """Credit for the org's project (GPU cells and jobs are paid for), as an admin."""
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as http:
        granted = await http.post(
            "/v1/credits/grants",
            headers={**admin_headers(home), "Idempotency-Key": str(uuid.uuid4())},
            json={"org": org, "project": project, "kind": "purchase", "amount": micro_credits})
        granted.raise_for_status()


@contextlib.asynccontextmanager
async def direct_kernel(workdir: Path, extra_arguments: tuple[str, ...] = (),
                        env: dict[str, str] | None = None) -> AsyncIterator[AsyncKernelClient]:
    """The baseline: ipykernel over IPC sockets, as nbfleet's agent runs its kernels."""
    manager = AsyncKernelManager(kernel_name="python3", transport="ipc",
                                 ip=str(workdir / "k"),
                                 connection_file=str(workdir / "kernel.json"))
    await manager.start_kernel(cwd=str(workdir), extra_arguments=list(extra_arguments),
                               env={**os.environ, **(env or {})})
    client = manager.client()
    try:
        client.start_channels()
        await client.wait_for_ready(timeout=START_TIMEOUT_S)
        yield client
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)
