"""Hosts on demand: the interface a cloud plugs into, and local agent processes.

The autoscaler (``policy/scheduling/autoscaler.py``) is a pure policy: it answers
``ScaleOut(count, reason)`` and ``ScaleIn(host_ids)``. A :class:`HostProvider` is
what carries those answers out. Its contract, which every implementation keeps:

* **Provisioning is asynchronous.** ``provision(count)`` asks for hosts and
  returns their handles at once (``starting``); it does not wait for them to
  boot. A host joins the fleet when its agent registers with the control plane
  (``POST /internal/agents``), exactly like a host an operator started by hand.
* **Hosts identify themselves by agent id.** Each handle carries the agent id its
  host will register under, fixed by the provider before the host boots, so the
  control plane can match a registration to the request that caused it and count
  hosts that are asked for but not registered yet (and not ask twice).
* **Release is idempotent.** ``release(agent_id)`` stops the host and forgets it;
  releasing an unknown, already released or dead host does nothing. Two
  concurrent releases of one host wait for the same stop.
* **The control plane never releases a host with work on it.** On ``ScaleIn`` it
  first stops placing work there and waits until the host holds no runtimes,
  kernels or job attempts, and only then calls ``release``. The provider does not
  check: it kills what is there.
* ``hosts()`` is the provider's own view: every host it started and has not
  released. One that died on its own stays listed as ``gone`` (with the reason)
  until it is released, so the control plane learns about it; ``gone`` hosts do
  not count against ``max_hosts``.

A cloud implements it with its own API, for example:

* **EC2**: ``provision`` calls ``RunInstances`` (a launch template whose user data
  runs ``nbfleet agent``) and writes the agent id it chose into the instance's
  user data or tags, where the agent reads it into its state directory's
  ``agent-id`` before starting; the handle is the instance id. ``release`` calls
  ``TerminateInstances`` (already terminated is fine). ``hosts`` maps
  ``pending/running/shutting-down/terminated`` onto the four states.
* **GCE**: the same with instance templates and metadata; **Kubernetes**: a pod
  (or a StatefulSet replica, whose ordinal gives the id) per host, deleted on
  release.

:class:`LocalAgentProvider` is the real implementation for one machine: each host
is an ``nbfleet agent`` child process with its own state directory and port
(``nbfleet up --max-hosts N``). See ``docs/fleet-provider.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, Protocol, runtime_checkable

import httpx

from nbfleet.model.resources import parse_gpu_spec

log = logging.getLogger(__name__)


class HostState(enum.StrEnum):
    STARTING = "starting"  #: asked for; not answering yet
    RUNNING = "running"  #: up (for local agents: registered and answering)
    STOPPING = "stopping"  #: being released
    GONE = "gone"  #: stopped, or died on its own (``detail`` says how)


#: States that hold a place under ``max_hosts``.
ACTIVE = frozenset({HostState.STARTING, HostState.RUNNING, HostState.STOPPING})


@dataclass(frozen=True, slots=True)
class ProvisionedHost:
    """A snapshot of one host a provider started."""

    #: The provider's own name for it (an instance id, a pod name, ``local-3``).
    handle: str
    #: The id its agent registers under; the control plane matches on it.
    agent_id: str
    state: HostState
    started_at: datetime
    #: Where its agent listens, when the provider knows before registration.
    url: str | None = None
    #: Why it is ``gone`` (an exit status), or empty.
    detail: str = ""


@runtime_checkable
class HostProvider(Protocol):
    """Starts and stops hosts for the control plane (see the module docstring)."""

    @property
    def max_hosts(self) -> int:
        """The most hosts it keeps at once (``starting``, ``running`` or ``stopping``)."""
        ...

    async def provision(self, count: int) -> list[ProvisionedHost]:
        """Ask for ``count`` more hosts; returns their handles without waiting for them.

        Returns fewer (and logs why) where ``max_hosts`` leaves less room.
        """
        ...

    async def release(self, host_id: str) -> None:
        """Stop the host whose agent id is ``host_id`` and forget it; idempotent.

        Called only once the control plane has emptied the host.
        """
        ...

    def hosts(self) -> list[ProvisionedHost]:
        """Every host started and not yet released, dead ones as ``gone``."""
        ...

    async def aclose(self) -> None:
        """Stop every host this provider started; it provisions nothing after."""
        ...


#: ``nbfleet agent`` options the provider sets itself; ``agent_args`` may not.
RESERVED_OPTIONS = frozenset({"--control", "--secret-file", "--home", "--state-dir",
                              "--gpus", "--host", "--port"})
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
        await _kill_stale(state_dir / PID_NAME, agent_id)
        _write_private(state_dir / "agent-id", agent_id)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [self.python, "-m", "nbfleet.cli.main", "agent",
                "--control", self.control_url, "--secret-file", str(self.secret_file),
                "--home", str(self.home), "--state-dir", str(state_dir), "--gpus", self.gpus,
                "--host", "127.0.0.1", "--port", str(port), *self.agent_args]
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
        identity = _identity(proc.pid)
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
        _forget_pid(host.state_dir / PID_NAME, host.proc.pid)
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
        family: set[_Proc] = set()
        if host.proc.returncode is None:
            host.state = HostState.STOPPING
            family = _family(pid)
            with contextlib.suppress(ProcessLookupError):
                host.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(host.proc.wait(), self.stop_grace_s)
            except TimeoutError:
                log.warning("agent %s (pid %d) still runs %.0f s after SIGTERM; killing it",
                            host.agent_id, pid, self.stop_grace_s)
                family |= _family(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)  # not reaped yet: the group is its own
                await host.proc.wait()
        # Whatever the agent started and left (a job in its own session, a kernel that
        # ignored it; after a crash, what is left of its process group), each known by
        # pid and start time so that no other process is mistaken for it.
        await _kill_all(family | _family(pid))
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
class _Proc(NamedTuple):
    pid: int
    start: int  # clock ticks after boot: with the pid, names one process for good


class _Stat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    start: int


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


def _forget_pid(pid_file: Path, pid: int) -> None:
    """Remove ``pid_file`` if it still names ``pid`` (a later agent may have rewritten it)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        if int(pid_file.read_text().split()[0]) == pid:
            pid_file.unlink()


def _stat(pid: int) -> _Stat | None:
    """Fields of ``/proc/PID/stat`` (None where there is no such process)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()  # the name may hold spaces and ')'
    try:
        return _Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _identity(pid: int) -> tuple[int, str] | None:
    """(start time, boot id): with the pid, what ``agent.pid`` records."""
    stat = _stat(pid)
    return (stat.start, _boot_id()) if stat is not None else None


def _alive(proc: _Proc) -> bool:
    stat = _stat(proc.pid)
    return stat is not None and stat.start == proc.start and stat.state != "Z"


def _family(root: int) -> set[_Proc]:
    """``root``, its descendants and its process group's members, as they are now."""
    stats: dict[int, _Stat] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (stat := _stat(int(entry))) is not None:
                stats[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        children.setdefault(stat.ppid, []).append(pid)
    found = {pid for pid, stat in stats.items() if stat.pgrp == root}
    seen: set[int] = set()
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            found.add(pid)
            stack.extend(children.get(pid, ()))
    return {_Proc(pid, stats[pid].start) for pid in found if pid in stats}


async def _kill_all(procs: set[_Proc], wait_s: float = 5.0) -> None:
    """SIGKILL each still-living process of ``procs``; wait (bounded) until they are gone."""
    living = {p for p in procs if _alive(p)}
    for proc in living:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGKILL)
    for _ in range(int(wait_s / 0.05)):
        living = {p for p in living if _alive(p)}
        if not living:
            return
        await asyncio.sleep(0.05)
    log.warning("processes %s outlived SIGKILL", sorted(p.pid for p in living))


def _stale_agent(pid_file: Path) -> _Proc | None:
    """The agent an earlier provider recorded in ``pid_file``, if it still runs."""
    try:
        pid_text, start_text, boot = pid_file.read_text().split()
        stale = _Proc(int(pid_text), int(start_text))
        cmdline = Path(f"/proc/{stale.pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if boot != _boot_id() or not _alive(stale):
        return None
    if b"nbfleet.cli.main" not in cmdline or b"agent" not in cmdline:
        return None
    return stale


async def _kill_stale(pid_file: Path, agent_id: str) -> None:
    """Kill the agent an earlier provider left under this id (and what it started)."""
    stale = _stale_agent(pid_file)
    if stale is not None:
        log.warning("killing agent %s (pid %d) left by an earlier run", agent_id, stale.pid)
        await _kill_all(_family(stale.pid))
