"""One ipykernel process, its ZMQ sockets, and the WebSocket clients attached to it.

The agent keeps a single set of sockets per kernel for its whole life, so output
keeps flowing while no client is connected: it is buffered and handed to the next
client that attaches. iopub is broadcast; replies go to the client whose request
they answer (matched by the parent ``msg_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.manager import AsyncKernelManager

from nbfleet.agent.bindings import KernelBindings
from nbfleet.agent.output import (
    DEFAULT_OUTPUT_BUFFER_BYTES,
    Backlog,
    Client,
    agent_header,
    agent_message,
    jupyter_time,
)
from nbfleet.agent.sandbox import Sandbox
from nbfleet.agent.sandbox.cgroups import Cgroup
from nbfleet.agent.sandbox.identity import Identity, hand_over
from nbfleet.agent.wire import ClientMessage, KernelMessage, WireCodec, WireError
from nbfleet.protocol.agent import KernelModel
from nbfleet.protocol.kernel_env import allowed_kernel_env

log = logging.getLogger(__name__)

CHANNELS = ("shell", "control", "stdin", "iopub")
REQUESTER_LIMIT = 10_000
#: The largest message the agent takes from a kernel (at least; see max_message_bytes).
MAX_MESSAGE_BYTES = 64 << 20
INTERNAL_LIMIT = 1_000
_REPLY_SEEN, _IDLE_SEEN = 1, 2
READY_TIMEOUT_S = 60.0
HELD_LIMIT = 1000
#: A connection that stays open this long (or sends a request) has "stayed": what it
#: was handed from the buffer is then its own. jupyter_server opens and at once
#: closes a first socket each time JupyterLab connects; that one must not take
#: the buffered output with it.
CONFIRM_AFTER_S = 1.0
#: What every client sends as it connects, even one about to leave (JupyterLab asks
#: for kernel info on each socket it opens): these do not show that it stayed.
PROBES = frozenset({"kernel_info_request", "comm_info_request"})


class SandboxedKernelManager(AsyncKernelManager):
    """Runs the kernelspec's command inside the sandbox, when there is one."""

    sandbox: Sandbox | None = None
    visible: list[str] = []
    readonly: list[str] = []
    tmp: str | None = None
    identity: Identity | None = None
    cgroup: Cgroup | None = None
    netns: str | None = None
    devices: list[str] = []
    #: (host path, path inside) pairs: a workspace's directories at fixed paths.
    moved: list[tuple[str, str]] = []
    #: The working directory as the kernel sees it.
    workdir_inside: str = "/"

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        argv: list[str] = super().format_kernel_cmd(extra_arguments)
        if self.sandbox is None:
            return argv
        return self.sandbox.wrap(argv, self.visible, self.workdir_inside, tmp=self.tmp,
                                 identity=self.identity, cgroup=self.cgroup,
                                 readonly=self.readonly, netns=self.netns,
                                 devices=self.devices, moved=self.moved)

    def write_connection_file(self, **kwargs: Any) -> None:
        """The file (0600, with the kernel's key) must be readable by the sandbox's uid."""
        super().write_connection_file(**kwargs)
        if self.identity is not None and self.connection_file:
            os.chown(self.connection_file, self.identity.uid, self.identity.gid,
                     follow_symlinks=False)


class KernelProcess:
    def __init__(
        self,
        kernel_id: str,
        workspace_id: str,
        name: str,
        workdir: str,
        env: dict[str, str],
        connection_dir: str,
        sandbox: Sandbox | None = None,
        visible: tuple[str, ...] = (),
        readonly: tuple[str, ...] = (),
        ipc_dir: str | None = None,
        extra_arguments: tuple[str, ...] = (),
        tmp: str | None = None,
        identity: Identity | None = None,
        cgroup: Cgroup | None = None,
        netns: str | None = None,
        devices: tuple[str, ...] = (),
        output_buffer_bytes: int = DEFAULT_OUTPUT_BUFFER_BYTES,
        moved: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """``connection_dir`` holds the kernel's IPC sockets: keep its path short
        (a socket path must fit in 107 bytes). ``visible`` lists the directories,
        besides the working directory and ``connection_dir``, the sandbox exposes.
        ``output_buffer_bytes``: the output kept for a client (``agent.output``).
        ``moved``: directories the sandbox binds at paths of its own (host path,
        path inside), the working directory among them."""
        self.id = kernel_id
        self.workspace_id = workspace_id
        self.name = name
        self.workdir = workdir
        self.env = env
        self.execution_state = "starting"
        self.last_activity = datetime.now(UTC)
        self.clients: set[Client] = set()
        self.output_buffer_bytes = output_buffer_bytes
        #: The largest message accepted from the kernel.
        self.max_message_bytes = max(MAX_MESSAGE_BYTES, 4 * output_buffer_bytes)
        #: What no connection that stayed has seen yet: output while no client was
        #: connected, or while only connections that have not stayed yet were (each
        #: new connection is handed all of it; one that stays takes it for good).
        self._backlog = Backlog(output_buffer_bytes)
        #: The raw header of the last cell a client sent (``warn_in_cell``).
        self._cell_header = b"{}"
        #: msg_id -> the client awaiting its reply. Bounded: comm messages get no reply.
        self._requesters: OrderedDict[str, Client] = OrderedDict()
        #: The agent's own requests, kept until both their shell reply and their
        #: iopub idle status arrived (the two sockets deliver in either order):
        #: none of their messages reaches a client. The value: what arrived so far.
        self._internal: dict[str, int] = {}
        #: msg_id -> the future its execute_reply resolves (the agent's own requests).
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._idle = asyncio.Event()
        self.extra_arguments = list(extra_arguments)
        #: Where the state-capture extension writes (None: this kernel captures nothing).
        self.state_dir: str | None = None
        #: A directory of the agent's beside it, where a snapshot is downloaded before
        #: it is renamed into ``state_dir`` (the kernel cannot reach it).
        self.staging_root: str | None = None
        self._ready = asyncio.Event()
        #: Client messages that arrived while the kernel was (re)starting.
        self._held: list[tuple[Client, ClientMessage]] = []
        self._shell_seen = asyncio.Event()
        self._iopub_seen = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._stopping = False
        #: Serializes restart and shutdown; the death watcher stands aside while held.
        self._lifecycle = asyncio.Lock()
        os.makedirs(connection_dir, mode=0o700, exist_ok=True)
        # IPC sockets in a private directory: no other local user can reach the kernel,
        # which TCP on loopback would allow.
        self.manager = SandboxedKernelManager(
            kernel_name=name,
            transport="ipc",
            ip=os.path.join(ipc_dir or connection_dir, f"k-{kernel_id[:8]}"),
            connection_file=os.path.join(connection_dir, f"kernel-{kernel_id}.json"),
        )
        self.manager.sandbox = sandbox
        # The connection file is read-only to the sandbox (its directory is bound
        # read-only); the sockets are made in ``ipc_dir``.
        inside = dict(moved)
        self.manager.moved = list(moved)
        self.manager.workdir_inside = inside.get(workdir, workdir)
        self.manager.visible = [*([] if workdir in inside else [workdir]),
                                ipc_dir or connection_dir, *visible]
        self.manager.readonly = [*readonly, connection_dir] if ipc_dir else [*readonly]
        self.manager.tmp, self.manager.identity, self.manager.cgroup = tmp, identity, cgroup
        self.manager.netns = netns
        #: Device nodes the sandbox binds (a GPU workspace's: the host's GPUs).
        self.manager.devices = list(devices)
        #: Asked when the kernel dies by itself: why, when the platform knows (e.g.
        #: its memory limit). The answer is told to the notebook and the agent.
        self.death_reason: Callable[[], str | None] = lambda: None
        #: The last such reason, until the next one (the kernel model carries it).
        self.last_death: str | None = None
        #: Called with (kernel, reason) after a death with a known reason.
        self.on_death: Callable[[KernelProcess, str], None] = lambda kernel, reason: None
        self.codec: WireCodec | None = None
        self._identity = uuid.uuid4().hex.encode()
        #: GPU bindings of cells sent and not replied to; their endings are reported
        #: through ``bindings.on_release``.
        self.bindings = KernelBindings()
        #: Clients' execute requests sent to the kernel and not replied to yet.
        self.cells_pending: set[str] = set()
        #: How many times the process was restarted (a checkpoint waiting on the old
        #: process gives up when it changes).
        self.restarts = 0
        #: Called after each client cell's execute_reply (``agent/checkpoints``).
        self.on_cell_done: Callable[[KernelProcess], None] = lambda kernel: None
        #: Called as the process is replaced (a restart asked for, or after a death),
        #: once ``restarts`` moved on: the state saved of the old one must not be
        #: brought back (``agent/checkpoints``).
        self.on_restart: Callable[[KernelProcess], None] = lambda kernel: None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        # A sandboxed kernel's output must not reach the agent's own log or
        # terminal (unbounded, and escape sequences): its notebook gets it anyway.
        quiet = ({"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
                 if self.manager.sandbox is not None else {})
        await self.manager.start_kernel(cwd=self.workdir, env=self.env,
                                        extra_arguments=self.extra_arguments, **quiet)
        info: dict[str, Any] = dict(self.manager.get_connection_info())
        key = info["key"]
        self.codec = WireCodec(key if isinstance(key, bytes) else key.encode())
        context = zmq.asyncio.Context.instance()
        for channel in CHANNELS:
            kind = zmq.SUB if channel == "iopub" else zmq.DEALER
            sock = context.socket(kind)
            sock.linger = 0
            # A kernel is user code: one giant message would sit whole in the
            # agent's memory. Past this ZeroMQ drops the connection (and reconnects)
            # instead; nbfleet.kernel.streams keeps printed output well below it.
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            if channel in ("shell", "stdin"):
                sock.setsockopt(zmq.IDENTITY, self._identity)
            if channel == "iopub":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            port = info[f"{channel}_port"]
            separator = "-" if info["transport"] == "ipc" else ":"
            sock.connect(f"{info['transport']}://{info['ip']}{separator}{port}")
            self._sockets[channel] = sock
            self._tasks.append(asyncio.create_task(self._read(channel, sock)))
        self._tasks.append(asyncio.create_task(self._watch_process()))
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        """Nudge with kernel_info until shell answers and iopub delivers (late-joiner safe).

        One nudge at a time: the next is sent only after the shell reply to the last
        (or a timeout), so a slow kernel is never flooded with requests.
        """
        self._ready.clear()
        self._iopub_seen.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while True:
            if loop.time() > deadline:
                raise TimeoutError(f"kernel {self.id} did not become ready")
            if not await self.manager.is_alive():
                raise RuntimeError(f"kernel {self.id} exited during start-up")
            self._shell_seen.clear()
            self._send_internal("kernel_info_request")
            try:
                async with asyncio.timeout(1.0):
                    await self._shell_seen.wait()
                # The reply's iopub status follows it; give the subscription a moment.
                async with asyncio.timeout(0.2):
                    await self._iopub_seen.wait()
                break
            except TimeoutError:
                continue
        self._set_state("idle")
        self._ready.set()
        held, self._held = self._held, []
        for client, message in held:
            if client in self.clients:
                self._forward(client, message)
            else:
                self.bindings.end(message.msg_id)  # dropped: it will never run

    def _send_internal(self, msg_type: str, content: dict[str, Any] | None = None) -> str:
        assert self.codec is not None
        header = agent_header(msg_type)
        self._internal[header["msg_id"]] = 0
        while len(self._internal) > INTERNAL_LIMIT:  # idles that never came
            del self._internal[next(iter(self._internal))]
        self._sockets["shell"].send_multipart(self.codec.internal(header, content or {}),
                                              copy=True)
        return header["msg_id"]

    async def execute_internal(self, code: str, timeout_s: float,
                               expressions: dict[str, str] | None = None) -> dict[str, Any]:
        """Run the agent's own code in the kernel, unseen by clients and by history.

        The request is silent, so IPython fires no cell events (state capture does
        not see it) and the kernel's status changes are not relayed to clients.
        Returns the execute_reply's content (with ``expressions`` evaluated after
        the code, under ``user_expressions``).
        """
        async with asyncio.timeout(timeout_s):
            await self._ready.wait()
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        msg_id = self._send_internal("execute_request", {
            "code": code, "silent": True, "store_history": False,
            "user_expressions": expressions or {},
            "allow_stdin": False, "stop_on_error": False,
        })
        self._waiters[msg_id] = future
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._waiters.pop(msg_id, None)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no cell runs; False if one still runs after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def _set_state(self, state: str) -> None:
        self.execution_state = state
        if state == "idle":
            self._idle.set()
        else:
            self._idle.clear()

    def own(self, path: str) -> None:
        """Give what the agent wrote for the kernel (a snapshot) to its sandbox uid."""
        hand_over(path, self.manager.identity)

    def rename(self, kernel_id: str, workspace_id: str) -> None:
        """A warm kernel takes the identity of the workspace kernel it becomes; it
        was started for the user now (its pool start time would make it look older
        than its workspace, and idle since before the user asked for it)."""
        self.id = kernel_id
        self.workspace_id = workspace_id
        self._touch()

    async def set_env(self, env: dict[str, str], timeout_s: float = 10.0) -> None:
        """Give a started kernel (a warm one, claimed) more environment variables:
        set in its process now and kept for its restarts. Raises if the kernel did
        not take them. Only for IPython kernels (the warm pool's)."""
        env = allowed_kernel_env(env)  # whatever the caller checked: only KERNEL_*
        if not env:
            return
        self.env.update(env)
        self.manager.update_env(env=env)
        # ``repr`` of a dict of str is a Python literal, whatever the strings hold.
        reply = await self.execute_internal(
            f"__import__('os').environ.update({env!r})", timeout_s)
        if reply.get("status") != "ok":
            raise RuntimeError(f"kernel {self.id} did not take its environment: "
                               f"{reply.get('ename')}: {reply.get('evalue')}")

    async def interrupt(self) -> None:
        await self.manager.interrupt_kernel()

    async def restart(self) -> None:
        """A restart someone asked for (REST ``POST .../restart``).

        No ``restarting`` status goes out: jupyter_server sends one only from its
        auto-restarter, after a death, and JupyterLab reads it as a crash ("the
        kernel appears to have died"). The client that asked knows, and reconnects.
        """
        await self._restart(announce=False)

    async def _restart(self, announce: bool) -> None:
        async with self._lifecycle:
            if self._stopping:
                return
            self._ready.clear()
            if announce:
                self._broadcast_status("restarting")
            self._requesters.clear()
            self.cells_pending.clear()
            self.restarts += 1
            self._fail_waiters("the kernel restarted")
            # Before the new process starts: its variables are gone whatever follows
            # (a restart that fails leaves a dead kernel, not the old namespace).
            self.on_restart(self)
            # Every cell the old process had ends; those held for the new one stay.
            self.bindings.end_all(keep=[message.msg_id for _, message in self._held])
            await self.manager.restart_kernel(now=True)
            await self._wait_ready()

    async def shutdown(self) -> None:
        self._stopping = True
        async with self._lifecycle:
            await self._shutdown()

    def _fail_waiters(self, why: str) -> None:
        """The agent's own requests to a process that is gone end now, not at their
        timeouts (a checkpoint or a flush waiting on a restarted kernel)."""
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(TimeoutError(why))

    async def _shutdown(self) -> None:
        self._fail_waiters("the kernel was shut down")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sock in self._sockets.values():
            sock.close(linger=0)
        self.bindings.end_all()
        with contextlib.suppress(Exception):
            await self.manager.shutdown_kernel(now=True)
        # No "dead" status: most shutdowns are a suspend or a move, after which the
        # kernel lives on (its id rests, and clients reconnect); jupyter_server sends
        # none on a shutdown either. JupyterLab takes "dead" as final.
        for client in list(self.clients):
            client.close()
        self.clients.clear()
        self._set_state("dead")

    async def _watch_process(self) -> None:
        """Restart a kernel that died by itself (e.g. the user called os._exit)."""
        while True:
            await asyncio.sleep(1.0)
            if self._stopping or not self._ready.is_set() or self._lifecycle.locked():
                continue
            if not await self.manager.is_alive() and not self._lifecycle.locked():
                reason = self.death_reason()
                log.warning("kernel %s died (%s); restarting it", self.id, reason or "exited")
                if reason is not None:
                    self.last_death = reason
                    self._broadcast_own("stream", {"name": "stderr",
                                                   "text": f"{reason}; it is restarting.\n"})
                    self.on_death(self, reason)
                self._set_state("restarting")
                try:
                    await self._restart(announce=True)  # as jupyter_server's auto-restarter
                except Exception:
                    log.exception("kernel %s could not be restarted", self.id)
                    self._set_state("dead")
                    self._broadcast_status("dead")
                    return

    # ------------------------------------------------------------------ relaying
    def attach(self, protocol: str | None = None) -> Client:
        """A new connection gets what no connection that stayed has seen yet: the
        buffer, and what connections that have not stayed yet were handed. It
        counts as having seen them once it stays (see :meth:`confirm`)."""
        # Room for the backlog it is handed (the bound, and the notice) and as much
        # again of what comes after, before a client that does not read is dropped.
        client = Client(protocol, 2 * self.output_buffer_bytes)
        notice = self._backlog.notice()
        if notice is not None:
            client.offer(notice)
        for message in self._backlog:  # no await in here: nothing can interleave
            client.offer(message)
        self.clients.add(client)
        with contextlib.suppress(RuntimeError):  # no running loop: confirmed by a frame
            client.confirm_timer = asyncio.get_running_loop().call_later(
                CONFIRM_AFTER_S, self.confirm, client)
        return client

    def confirm(self, client: Client) -> None:
        """The connection stayed: what it was handed is delivered for good."""
        if client.confirm_timer is not None:
            client.confirm_timer.cancel()
            client.confirm_timer = None
        if client.confirmed or client not in self.clients:
            return
        client.confirmed = True
        self._backlog.clear()  # it was handed every one of them

    def detach(self, client: Client) -> None:
        # One that leaves without staying leaves the backlog to the next.
        self.clients.discard(client)
        client.close()

    def send_from_client(self, client: Client, message: ClientMessage) -> None:
        if not client.confirmed and message.msg_type not in PROBES:
            self.confirm(client)  # it asks for work: what it was handed is its own
        if message.binding is not None and message.channel == "shell" and not self._stopping:
            if message.binding.task_id == f"{self.id}/{message.msg_id}":
                # Bound from the moment the agent accepts the cell: the control plane
                # committed its GPUs when it sent it.
                self.bindings.start(message.msg_id, message.binding)
            else:
                # Not the control plane's (its cells are ``{kernel id}/{msg_id}``): a
                # binding a client wrote itself, which must never end another's cell.
                log.warning("kernel %s: ignoring a binding for another cell (%s)", self.id,
                            message.binding.task_id[:80])
        if not self._ready.is_set() and not self._stopping:
            # (Re)starting: held until the new process's iopub is subscribed, or the
            # cell's output would be published before anyone listens, and lost.
            self._held.append((client, message))
            for _, dropped in self._held[:-HELD_LIMIT]:
                self.bindings.end(dropped.msg_id)
            del self._held[:-HELD_LIMIT]
            return
        self._forward(client, message)

    def _forward(self, client: Client, message: ClientMessage) -> None:
        assert self.codec is not None
        if message.channel == "shell" and message.msg_type == "execute_request" \
                and _changes_state(message):
            self._cell_header = message.parts[0]  # a cell a user ran, not an inspector's
            if len(self.cells_pending) >= REQUESTER_LIMIT:  # a kernel that never replies
                self.cells_pending.clear()
            self.cells_pending.add(message.msg_id)
        if message.channel != "stdin":
            self._requesters[message.msg_id] = client
            if len(self._requesters) > REQUESTER_LIMIT:
                self._requesters.popitem(last=False)
        self._touch()
        self._sockets[message.channel].send_multipart(self.codec.to_kernel(message), copy=True)

    async def _read(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        assert self.codec is not None
        while True:
            frames = await sock.recv_multipart()
            try:
                message = self.codec.from_kernel(channel, frames)
            except (WireError, ValueError) as exc:
                log.warning("dropping a bad %s message from kernel %s: %s", channel, self.id, exc)
                continue
            self._route(channel, message)

    def _route(self, channel: str, message: KernelMessage) -> None:
        parent = message.parent_msg_id
        if channel == "iopub":
            self._iopub_seen.set()
            if parent in self._internal:  # the agent's own request: not for clients
                if message.msg_type == "status" and b'"idle"' in message.content_raw:
                    self._internal_done(parent, _IDLE_SEEN)
                return
            if message.msg_type == "status" and self._ready.is_set():
                state = json.loads(message.content_raw).get("execution_state")
                # A "starting" that arrives once the kernel answered is its start-up
                # announcement, late: it says nothing about a cell running.
                if isinstance(state, str) and state != "starting":
                    self._set_state(state)
            self._touch()
            self._broadcast(message)
            return
        if parent in self._internal:
            self._shell_seen.set()
            waiter = self._waiters.get(parent)
            if waiter is not None and not waiter.done() and message.msg_type == "execute_reply":
                waiter.set_result(json.loads(message.content_raw))
            if channel == "shell":
                self._internal_done(parent, _REPLY_SEEN)
            return
        self._touch()
        if channel == "shell" and message.msg_type == "execute_reply":
            if self.bindings:
                self.bindings.end(parent)
            # Only a reply to a cell a client sent (not to a silent request, nor one
            # the kernel made up) counts as a cell done.
            if parent is not None and parent in self.cells_pending:
                self.cells_pending.discard(parent)
                self.on_cell_done(self)
        target = self._requesters.get(parent) if parent else None
        if channel in ("shell", "control") and parent is not None:
            self._requesters.pop(parent, None)
        if target is not None and target in self.clients:
            target.offer(message)
        else:
            self._broadcast(message)

    def _internal_done(self, msg_id: str, seen: int) -> None:
        """Forget an agent request once its reply and its idle status both came."""
        state = self._internal.get(msg_id, 0) | seen
        if state == _REPLY_SEEN | _IDLE_SEEN:
            self._internal.pop(msg_id, None)
        else:
            self._internal[msg_id] = state

    def _broadcast(self, message: KernelMessage) -> None:
        # A client dropped for not reading (closed) is still attached until its
        # connection ends: it takes nothing, so it must not stand for "delivered".
        if not any(client.confirmed and not client.closed for client in self.clients):
            self._backlog.append(message)
        for client in list(self.clients):
            client.offer(message)

    def _broadcast_status(self, state: str) -> None:
        """A status message of the agent's own, as jupyter_server sends on restart."""
        self._broadcast_own("status", {"execution_state": state})

    def announce(self, text: str) -> None:
        """Tell whoever attaches (now or later) something on the iopub stream."""
        self._broadcast_own("stream", {"name": "stdout", "text": text})

    def warn_in_cell(self, text: str) -> None:
        """A warning in the output of the last cell a client sent, where a notebook
        shows it (JupyterLab shows no output that belongs to no cell)."""
        self._broadcast(agent_message("stream", {"name": "stderr", "text": text},
                                      self._cell_header))

    def _broadcast_own(self, msg_type: str, content: dict[str, Any]) -> None:
        self._broadcast(agent_message(msg_type, content))

    def _touch(self) -> None:
        self.last_activity = datetime.now(UTC)

    def model(self) -> KernelModel:
        return KernelModel(
            id=self.id,
            name=self.name,
            workspace_id=self.workspace_id,
            last_activity=jupyter_time(self.last_activity),
            # On this host's clock, so the control plane need not trust ours to match.
            idle_s=(datetime.now(UTC) - self.last_activity).total_seconds(),
            execution_state=self.execution_state,
            connections=len(self.clients),
            last_death=self.last_death,
        )


def _changes_state(message: ClientMessage) -> bool:
    """Whether a client's execute_request is a cell that may change the kernel's
    state (a silent one, as variable inspectors send, is not checkpointed)."""
    try:
        content = json.loads(message.parts[3]) if len(message.parts) > 3 else {}
    except (ValueError, UnicodeDecodeError):
        return True
    return not (isinstance(content, dict) and content.get("silent") is True)
