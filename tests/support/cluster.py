"""Real nbfleet processes on loopback for integration and e2e tests.

``Cluster`` runs ``nbfleet control`` and any number of ``nbfleet agent`` processes
as subprocesses, so tests can kill -9 them and restart them like an operator would.
They get the cluster secret as an operator should give it: ``--secret-file``
naming a 0600 file, never the secret itself on a command line.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from nbfleet.sdk.kernel_socket import CellResult, KernelSocket
from tests.support.netns import NetHost

NBFLEET = [sys.executable, "-m", "nbfleet.cli.main"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1,
               what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}; last value: {last!r}")


#: Every cluster's log folder, so a failing test's report can show what its
#: processes said (CI keeps nothing else of them).
LOG_FOLDERS: list[Path] = []


def log_tails(since: float, lines: int = 80) -> list[tuple[str, str]]:
    """(name, last lines) of each cluster log written to after ``since``."""
    tails = []
    for folder in LOG_FOLDERS:
        for path in sorted(folder.glob("*.log")):
            try:
                if path.stat().st_mtime < since:
                    continue
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            tails.append((f"{folder.parent.name}/{path.name}", "\n".join(text)))
    return tails


class Cluster:
    def __init__(self, root: Path, db_url: str, gpus: str = "2xA100-80GB",
                 run_as: tuple[int, int] | None = None) -> None:
        """``run_as`` (uid, gid) runs every process as that unprivileged user; its
        ``root`` must be a directory that user can reach."""
        self.root = root
        self.run_as = run_as
        self.home = root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.db_url = db_url
        self.gpus = gpus
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.control: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = root / "logs"
        LOG_FOLDERS.append(self.logs)
        self.logs.mkdir(exist_ok=True)
        if run_as is not None:
            for path in (root, self.home, self.logs):
                os.chown(path, *run_as)

    # ------------------------------------------------------------- processes
    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment without its NBFLEET_* and AWS_* variables (a
        developer's own AWS credentials must not reach a test's processes), with
        ``extra``: the only AWS_* a test's processes get are those it passes."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NBFLEET_", "AWS_"))}
        env["NBFLEET_HOME"] = str(self.home)
        if self.run_as is not None:
            env["HOME"] = str(self.root)  # jupyter's own paths, for a user with none
        env.update(extra or {})
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str],
               host: NetHost | None = None) -> subprocess.Popen[bytes]:
        """``host``: run inside that network namespace (``tests/support/netns``)."""
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (lives with the process)
        argv = host.command(NBFLEET + args) if host is not None else NBFLEET + args
        if self.run_as is None:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        uid, gid = self.run_as
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, user=uid, group=gid, extra_groups=[],
                                cwd=self.root)

    @property
    def secret_file(self) -> Path:
        """The cluster secret's file (in the shared home, where tests read it)."""
        path = self.home / "cluster-secret"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(32) + "\n")
            if self.run_as is not None:
                os.chown(path, *self.run_as)
        return path

    @property
    def secret(self) -> str:
        return self.secret_file.read_text().strip()

    def start_control(self, env: dict[str, str] | None = None,
                      args: tuple[str, ...] = (), blobs: str | None = None) -> None:
        """The GPU scheduler keeps no warm kernels unless asked (``--prewarm``), as
        agents start without a warm pool: each warm kernel costs a kernel start.
        ``blobs``: the blob store's URL (default: a directory in the home)."""
        if "--prewarm" not in args:
            args = (*args, "--prewarm", "0")
        self.control = self._spawn("control", [
            "control", "--db", self.db_url, "--blobs", blobs or str(self.home / "blobs"),
            "--port", str(self.port), "--secret-file", str(self.secret_file),
            "--log-level", "info", *args], self._env(env))
        wait_until(lambda: httpx.get(f"{self.url}/healthz").status_code == 200, 60,
                   what="control plane health")

    def start_agent(self, name: str = "agent1", env: dict[str, str] | None = None,
                    warm_pool: int = 0, args: tuple[str, ...] = (),
                    gpus: str | None = None, host: NetHost | None = None) -> None:
        """Agents start without a warm pool unless asked: each warm kernel costs a
        kernel start, and most tests do not resume. ``host``: the agent runs in that
        network namespace, listening on its address and reaching the control plane
        at its gateway (start the control plane with ``--host 0.0.0.0``)."""
        before = self._boot_ids()
        if "--workspace-disk" not in args:
            # Each quota reserves its whole size on the host's disk: tests that do not
            # exercise quotas (tests/security and test_quotas do) turn them off.
            args = (*args, "--workspace-disk", "0")
        if "--drain-timeout" not in args:
            # A stopped agent would drain itself (moving or suspending every
            # workspace) in each test's teardown: only tests of the drain ask.
            args = (*args, "--drain-timeout", "0")
        control = self.url
        if host is not None:
            control = f"http://{host.gateway}:{self.port}"
            args = (*args, "--host", host.address)
        self.agents[name] = self._spawn(name, [
            "agent", "--control", control, "--state-dir", str(self.root / name),
            "--secret-file", str(self.secret_file), "--gpus", gpus or self.gpus,
            "--warm-pool", str(warm_pool), "--log-level", "info", *args],
            self._env(env), host)
        agent_id_file = self.root / name / "agent-id"

        def registered() -> bool:
            if not agent_id_file.exists():
                return False
            agent_id = agent_id_file.read_text().strip()
            boot = self._boot_ids().get(agent_id)
            return boot is not None and boot != before.get(agent_id)

        wait_until(registered, 60, what=f"agent {name} registration")

    def _boot_ids(self) -> dict[str, str]:
        if self.control is None or self.control.poll() is not None:
            return {}
        try:
            body = self.admin().get("/v1/admin/agents").json()
        except httpx.HTTPError:
            return {}
        return {a["id"]: a["boot_id"] for a in body.get("items", [])}

    def kill_control(self, sig: int = signal.SIGKILL) -> None:
        assert self.control is not None
        self.control.send_signal(sig)
        self.control.wait(30)
        self.control = None

    def agent_api(self, host_id: str, path: str) -> Any:
        """GET ``path`` (``/agent/v1/...``) from a host's agent, as the control plane
        calls it: what the agent itself says, not the control plane's view."""
        agents = self.admin().get("/v1/admin/agents").json()["items"]
        url = next(a["url"] for a in agents if a["id"] == host_id)
        response = httpx.get(f"{url}{path}", timeout=30,
                             headers={"Authorization": f"Bearer {self.secret}"})
        response.raise_for_status()
        return response.json()

    def kill_agent(self, name: str = "agent1", sig: int = signal.SIGKILL) -> None:
        proc = self.agents.pop(name)
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)  # the agent and its kernels, as if the host died
        else:
            proc.send_signal(sig)
        proc.wait(30)

    def stop(self) -> None:
        for name in list(self.agents):
            proc = self.agents.pop(name)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if self.control is not None:
            self.control.send_signal(signal.SIGTERM)
            try:
                self.control.wait(20)
            except subprocess.TimeoutExpired:
                self.control.kill()
            self.control = None
        self._reap_orphans()

    def _reap_orphans(self) -> None:
        """Kernels of agents a test killed with kill -9 outlive them (their sandboxes
        run in sessions of their own, as on a host whose agent crashed): stop every
        process still working under this cluster's directory, so a suite of such
        tests does not pile them up."""
        root = str(self.root).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if root in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

    # --------------------------------------------------------------- clients
    @property
    def admin_token(self) -> str:
        return (self.home / "admin-token").read_text().strip()

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                            timeout=60.0)

    def admin(self) -> httpx.Client:
        return self.client(self.admin_token)

    def new_user(self, org: str = "acme", project: str = "research",
                 name: str | None = None) -> httpx.Client:
        body = {"name": name or f"u{uuid.uuid4().hex[:8]}", "org": org, "project": project}
        response = self.admin().post("/v1/admin/users", json=body)
        response.raise_for_status()
        return self.client(response.json()["token"])

    def channels_url(self, workspace_id: str, kernel_id: str) -> str:
        return (f"ws://127.0.0.1:{self.port}/v1/workspaces/{workspace_id}"
                f"/api/kernels/{kernel_id}/channels")


def agent_names(cluster: Cluster) -> dict[str, str]:
    """agent (host) id -> the cluster's name for it."""
    return {(cluster.root / name / "agent-id").read_text().strip(): name
            for name in cluster.agents}


def kernel_then_second_host(cluster: Cluster, client: httpx.Client, name: str,
                            agent_args: tuple[str, ...] = ()) -> tuple[str, str, str, str]:
    """A running workspace with a kernel on the cluster's one agent, then a second
    agent started (where a failover or a move can go): the workspace, the kernel,
    the kernel's host and the other host."""
    ws = create_running(client, name)
    kernel = start_kernel(client, ws)
    here = client.get(f"/v1/workspaces/{ws}").json()["host_id"]
    cluster.start_agent("agent2", args=agent_args)
    there = next(h for h in agent_names(cluster) if h != here)
    return ws, kernel, here, there


def wait_state(client: httpx.Client, workspace_id: str, state: str,
               timeout: float = 60.0) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def settled() -> dict[str, Any] | None:
        body: dict[str, Any] = client.get(f"/v1/workspaces/{workspace_id}").json()
        seen.update(body)
        return body if body.get("state") == state else None

    try:
        result: dict[str, Any] = wait_until(settled, timeout, 0.1,
                                            f"{workspace_id} -> {state}")
    except TimeoutError as exc:
        # Where it stuck, and why (a retried step's error), not just "None".
        last = {k: seen.get(k) for k in ("state", "desired_state", "last_error", "host_id")}
        raise TimeoutError(f"{exc}; the workspace last read {last}") from None
    return result


def create_running(client: httpx.Client, name: str = "ws") -> str:
    response = client.post("/v1/workspaces", json={"name": name})
    response.raise_for_status()
    workspace_id: str = response.json()["id"]
    wait_state(client, workspace_id, "running")
    return workspace_id


def suspend(client: httpx.Client, ws: str) -> dict[str, Any]:
    response = client.post(f"/v1/workspaces/{ws}/suspend", params={"wait": 120})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def resume(client: httpx.Client, ws: str) -> dict[str, Any]:
    response = client.post(f"/v1/workspaces/{ws}/resume", params={"wait": 120})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["state"] == "running", body
    return body


def token_of(client: httpx.Client) -> str:
    return str(client.headers["Authorization"]).split()[1]


def start_kernel(client: httpx.Client, workspace_id: str) -> str:
    response = client.post(f"/v1/workspaces/{workspace_id}/api/kernels", json={})
    response.raise_for_status()
    return str(response.json()["id"])


def run_cell(cluster: Cluster, client: httpx.Client, workspace_id: str, kernel_id: str,
             code: str) -> CellResult:
    """Connect to the kernel through the gateway, run one cell, disconnect."""

    async def run() -> CellResult:
        sock = await KernelSocket.connect(cluster.channels_url(workspace_id, kernel_id),
                                          token_of(client))
        try:
            return await sock.execute(code)
        finally:
            await sock.close()

    return asyncio.run(run())


def outcome(result: CellResult) -> str:
    """stdout of a successful cell, else the name of its error."""
    return result.stdout if result.status == "ok" else str(result.error_name)


def events_of(client: httpx.Client, workspace_id: str) -> list[tuple[str | None, str]]:
    """The workspace's state changes, as (from, to) pairs."""
    items = client.get(f"/v1/workspaces/{workspace_id}/events").json()["items"]
    return [(e["from"], e["to"]) for e in items]
