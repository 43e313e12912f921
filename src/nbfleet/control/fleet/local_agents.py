"""Hosts as local ``nbfleet agent`` processes: :class:`LocalAgentProvider`.

The one-machine implementation of
:class:`~nbfleet.control.fleet.provider.HostProvider` (whose docstring holds the
contract), and :func:`local_provider`, which builds one from a control plane's
settings. Killing what an agent leaves behind is in
:mod:`nbfleet.control.fleet.processes`. See ``docs/fleet-provider.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shlex
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import httpx

from nbfleet.control.fleet import processes
from nbfleet.control.fleet.provider import ACTIVE, HostProvider, HostState, ProvisionedHost
from nbfleet.model.resources import parse_gpu_spec

if TYPE_CHECKING:
    from nbfleet.control.platform import ControlConfig

log = logging.getLogger(__name__)


#: ``nbfleet agent`` options the provider sets itself; ``agent_args`` may not.
RESERVED_OPTIONS = frozenset({"--control", "--secret-file", "--home", "--state-dir",
                              "--gpus", "--host", "--port", "--drain-timeout"})
#: The provider releases a host only once the scale-in has emptied it, so its agent
#: does not drain itself on SIGTERM: that would mark the host draining in the
#: database, as an admin's drain does, while the scale-in's own path handles it.
NO_SELF_DRAIN = ("--drain-timeout", "0")
LOG_NAME = "agent.log"
PID_NAME = "agent.pid"


class LocalAgentProvider:
    """Hosts as ``nbfleet agent`` child processes on this machine.

    Host ``n`` (1, 2, ... in the order they are asked for, never reused by one
    provider) lives in ``base_dir/hosts/<n>``: its state directory, its
    ``agent.log`` (stdout and stderr) and ``agent.pid``. Its agent id is
    ``host_<tag>_<n>``, ``tag`` a hash of ``base_dir``: the provider writes it to
    the state directory's ``agent-id`` before the agent starts, which is where the
    agent reads its id from (``nbfleet.agent.service.load_agent_id``). So ids are
    deterministic, and two providers with different base directories never share
    one (an agent's IPC directory, ``/tmp/nbfleet-<id>``, is named after it). A
    provider restarted on the same ``base_dir`` hands out the same ids again, and
    first kills an agent that an earlier run left behind under that id (killed
    with -9, it could not stop its children).

    Each agent listens on its own free loopback port and advertises it. The
    cluster secret reaches it as ``--secret-file`` (a 0600 file), never on a
    command line or in its environment. ``home`` (default ``base_dir``) is passed
    as ``--home``: the agent hides it from kernels, so pass the control plane's
    home when ``base_dir`` is inside it.

    A host is ``running`` once its agent answers ``/agent/v1/health`` with its id,
    which it does only after it has registered with the control plane. ``release``
    sends SIGTERM (the agent stops its kernels and jobs), waits ``stop_grace_s``,
    then SIGKILLs the agent's process group and everything it started, and reaps it.
    Use it from one event loop.
    """

    def __init__(self, control_url: str, secret_file: str | os.PathLike[str],
                 base_dir: str | os.PathLike[str], gpus: str, max_hosts: int,
                 agent_args: Sequence[str] = (), python: str = sys.executable, *,
                 home: str | os.PathLike[str] | None = None, stop_grace_s: float = 15.0,
                 probe_interval_s: float = 0.25) -> None:
        if max_hosts < 0:
            raise ValueError(f"max_hosts must be 0 or more, not {max_hosts}")
        parse_gpu_spec(gpus)  # a bad spec fails here, not in every child
        for arg in agent_args:
            if arg.split("=", 1)[0] in RESERVED_OPTIONS:
                raise ValueError(f"agent_args may not set {arg.split('=', 1)[0]}: "
                                 "the provider sets it for each host")
        self.control_url = control_url.rstrip("/")
        self.secret_file = Path(secret_file).resolve()
        self.base_dir = Path(base_dir).resolve()
        self.home = Path(home).resolve() if home is not None else self.base_dir
        self.gpus = gpus
        self._max_hosts = max_hosts
        self.agent_args = list(agent_args)
        self.python = python
        self.stop_grace_s = stop_grace_s
        self.probe_interval_s = probe_interval_s
        self._tag = hashlib.sha256(str(self.base_dir).encode()).hexdigest()[:8]
        self._next_index = 1
        self._hosts: dict[str, _Host] = {}
        self._reserved = 0  # places taken by provision calls still starting hosts
        self._closed = False

    @property
    def max_hosts(self) -> int:
        return self._max_hosts

    # ------------------------------------------------------------ interface
    async def provision(self, count: int) -> list[ProvisionedHost]:
        if count < 0:
            raise ValueError(f"count must be 0 or more, not {count}")
        if self._closed:
            raise RuntimeError("the provider is closed")
        if count and not self.secret_file.is_file():
            raise FileNotFoundError(f"cluster secret file {self.secret_file} does not exist")
        active = self._reserved + sum(
            1 for h in self._hosts.values() if h.current_state() in ACTIVE)
        room = max(0, self._max_hosts - active)
        if count > room:
            log.warning("asked for %d host(s), starting %d: max_hosts is %d and %d are up",
                        count, room, self._max_hosts, active)
        # The places are taken before the first await, so concurrent calls never
        # start more than max_hosts between them.
        left = min(count, room)
        self._reserved += left
        started: list[ProvisionedHost] = []
        try:
            while left:
                host = await self._start()  # in self._hosts from here on
                self._reserved -= 1
                left -= 1
                if self._closed:  # aclose ran while it started
                    await self.release(host.agent_id)
                    raise RuntimeError("the provider was closed while hosts started")
                started.append(host.snapshot())
        finally:
            self._reserved -= left
        return started

    async def release(self, host_id: str) -> None:
        host = self._hosts.get(host_id)
        if host is None:
            return
        if host.stopper is None:
            host.stopper = asyncio.create_task(self._stop(host))
        await asyncio.shield(host.stopper)
        if self._hosts.get(host_id) is host:
            del self._hosts[host_id]

    def hosts(self) -> list[ProvisionedHost]:
        return [host.snapshot() for host in self._hosts.values()]

    async def aclose(self) -> None:
        self._closed = True
        while self._hosts:  # a provision under way may still add one
            await asyncio.gather(*(self.release(agent_id) for agent_id in list(self._hosts)))

    async def __aenter__(self) -> LocalAgentProvider:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # ------------------------------------------------- local-only inspection
    def pid_of(self, host_id: str) -> int | None:
        """The agent process's pid (also its process group), or None if unknown."""
        host = self._hosts.get(host_id)
        return host.proc.pid if host is not None else None

    def state_dir_of(self, host_id: str) -> Path | None:
        """The host's state directory (its ``agent.log`` is there), or None."""
        host = self._hosts.get(host_id)
        return host.state_dir if host is not None else None

    # ------------------------------------------------------------ internals
    async def _start(self) -> _Host:
        index = self._next_index
        self._next_index += 1
        agent_id = f"host_{self._tag}_{index}"
        state_dir = self.base_dir / "hosts" / str(index)
        for directory in (self.base_dir, self.base_dir / "hosts", state_dir):
            directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(state_dir, 0o700)  # one an older run left wider
        await processes.kill_stale(state_dir / PID_NAME, agent_id)
        _write_private(state_dir / "agent-id", agent_id)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [self.python, "-m", "nbfleet.cli.main", "agent",
                "--control", self.control_url, "--secret-file", str(self.secret_file),
                "--home", str(self.home), "--state-dir", str(state_dir), "--gpus", self.gpus,
                "--host", "127.0.0.1", "--port", str(port), *NO_SELF_DRAIN, *self.agent_args]
        env = {k: v for k, v in os.environ.items() if k != "NBFLEET_CLUSTER_SECRET"}
        env["PYTHONUNBUFFERED"] = "1"
        started_at = datetime.now(UTC)
        log_fd = os.open(state_dir / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(log_fd, f"--- {started_at.isoformat()} nbfleet fleet provider: starting "
                             f"{agent_id} on {url}\n".encode())
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_fd,
                stderr=asyncio.subprocess.STDOUT, env=env, cwd=state_dir,
                start_new_session=True,  # its own process group: kernels go with it
            )
        finally:
            os.close(log_fd)
        identity = processes.identity(proc.pid)
        if identity is not None:
            _write_private(state_dir / PID_NAME, f"{proc.pid} {identity[0]} {identity[1]}")
        host = _Host(index, agent_id, state_dir, url, started_at, proc)
        host.watcher = asyncio.create_task(self._watch(host))
        self._hosts[agent_id] = host
        log.info("started agent %s (pid %d) on %s", agent_id, proc.pid, url)
        return host

    async def _watch(self, host: _Host) -> None:
        """Marks the host running when it answers, and gone when its process exits."""
        probe = asyncio.create_task(self._until_ready(host))
        try:
            code = await host.proc.wait()
        finally:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
        host.mark_gone(code)
        processes.forget_pid(host.state_dir / PID_NAME, host.proc.pid)
        if host.stopper is None:
            log.warning("agent %s (pid %d) %s on its own; see %s", host.agent_id,
                        host.proc.pid, host.detail, host.state_dir / LOG_NAME)

    async def _until_ready(self, host: _Host) -> None:
        try:
            secret = self.secret_file.read_text().strip()
        except OSError as exc:
            log.warning("cannot read %s to probe agent %s: %s", self.secret_file,
                        host.agent_id, exc)
            return
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while host.state is HostState.STARTING:
                try:
                    response = await client.get(f"{host.url}/agent/v1/health", headers=headers)
                    if (response.status_code == 200
                            and response.json().get("agent_id") == host.agent_id):
                        host.state = HostState.RUNNING
                        log.info("agent %s is up", host.agent_id)
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(self.probe_interval_s)

    async def _stop(self, host: _Host) -> None:
        pid = host.proc.pid
        family: set[processes.Proc] = set()
        if host.proc.returncode is None:
            host.state = HostState.STOPPING
            family = processes.family(pid)
            with contextlib.suppress(ProcessLookupError):
                host.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(self.stop_grace_s):
                    await host.proc.wait()
            except TimeoutError:
                log.warning("agent %s (pid %d) still runs %.0f s after SIGTERM; killing it",
                            host.agent_id, pid, self.stop_grace_s)
                family |= processes.family(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # not reaped yet: the group is its own
                await host.proc.wait()
        # Whatever the agent started and left (a job in its own session, a kernel that
        # ignored it; after a crash, what is left of its process group), each known by
        # pid and start time so that no other process is mistaken for it.
        await processes.kill_all(family | processes.family(pid))
        if host.watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await host.watcher
        host.mark_gone(host.proc.returncode)
        log.info("released agent %s (%s)", host.agent_id, host.detail)


@dataclass(eq=False)
class _Host:
    index: int
    agent_id: str
    state_dir: Path
    url: str
    started_at: datetime
    proc: asyncio.subprocess.Process
    state: HostState = HostState.STARTING
    detail: str = ""
    watcher: asyncio.Task[None] | None = None
    stopper: asyncio.Task[None] | None = None

    def current_state(self) -> HostState:
        if self.state is not HostState.GONE and self.proc.returncode is not None:
            self.mark_gone(self.proc.returncode)  # before the watcher has run
        return self.state

    def mark_gone(self, code: int | None) -> None:
        if self.state is HostState.GONE:
            return
        self.state = HostState.GONE
        self.detail = _exit_text(code)

    def snapshot(self) -> ProvisionedHost:
        return ProvisionedHost(f"local-{self.index}", self.agent_id, self.current_state(),
                               self.started_at, self.url, self.detail)


# ------------------------------------------------------------------ helpers
def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def local_provider(config: ControlConfig) -> HostProvider | None:
    """Local agent processes when the autoscaler may add hosts (``--max-hosts`` with
    ``--host-gpus``); None otherwise. The agents read the cluster secret from a
    0600 file in the hosts' directory (never a command line), and their kernels
    see nothing of the control plane's home."""
    fleet = config.fleet
    if not (fleet.max_hosts and fleet.host_gpus and config.control_url and config.home_dir):
        return None
    hosts_dir = Path(config.home_dir) / "hosts"
    hosts_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    secret_file = hosts_dir / "cluster-secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(config.secret + "\n")
    return LocalAgentProvider(config.control_url, secret_file, hosts_dir, fleet.host_gpus,
                              fleet.max_hosts, home=config.home_dir,
                              agent_args=shlex.split(config.host_agent_args))
