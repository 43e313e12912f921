"""The cell gate: a GPU workspace's cells get their GPUs here, one at a time.

The gateway hands the gate every frame of a GPU workspace's kernel connection.
An ``execute_request`` is held until the scheduler binds GPUs to it; the binding
is written into its metadata and it goes on to the kernel. Its GPUs are released
when the agent reports them closed, not at its ``execute_reply``: a thread or a
child process the cell started may still hold one open, and until it closes it
the GPU stays committed (and billed) to the cell, so no other tenant is bound to
it (``agent/sandbox/gpus.py``). Only on hosts where nothing can hold a GPU past
its cell (``LiveScheduler.free_at_reply``) are they released at the reply.

Jupyter runs a kernel's cells one after the other, so the gate asks GPUs for the
next cell only once the previous one's have settled (back, or still held open by
the kernel, which the next cell then takes over): a queued cell holds no GPU
while it waits behind its own kernel. Everything else passes at once.

While a cell waits, the notebook shows why and for how long, updated as it
changes (one display, rewritten with ``update_display_data``). Interrupting a
waiting cell withdraws it, as an interrupt stops a running one, and the cells
queued behind it are aborted as a kernel aborts them after an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import Histogram

from nbfleet.control.fleet.frames import (
    ClientRequest,
    Frame,
    execute_reply_parent,
    open_client_frame,
    reply_frame,
)
from nbfleet.control.fleet.scheduler import Binding, CellRefused, LiveScheduler
from nbfleet.protocol.gpu import CellBinding

log = logging.getLogger(__name__)

CELL_WAIT = Histogram(
    "nbfleet_cell_gpu_wait_seconds",
    "Time a GPU cell waited for its GPUs (0 when they were free)",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800, 7200),
)

KERNEL_MOVES = Histogram(
    "nbfleet_kernel_move_seconds",
    "Time to move a kernel to the host of its cell's GPUs (state saved and restored)",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 180),
)

#: A cell bound within this long shows no waiting notice at all.
QUIET_S = 0.25
#: How often a waiting notice is rewritten (its elapsed time moves on).
NOTICE_EVERY_S = 1.0

Send = Callable[[Frame], Awaitable[None]]


@dataclass(slots=True)
class _Waiting:
    request: ClientRequest
    task: asyncio.Task[Binding]
    interrupted: bool = False


@dataclass(eq=False)
class CellGate:
    """One client connection's gate onto one kernel of a GPU workspace."""

    scheduler: Callable[[], LiveScheduler | None]
    workspace_id: str
    kernel_id: str
    gpus: int
    protocol: str | None
    to_client: Send
    to_kernel: Send
    #: The host the kernel runs on now, and how to move it to another one.
    current_host: Callable[[], str]
    move_to: Callable[[str], Awaitable[None]]
    #: Meter a bound cell (its refusal reason, or None), and stop a running one.
    admit: Callable[[Binding, Callable[[str], None]], Awaitable[str | None]]
    interrupt_kernel: Callable[[], Awaitable[None]]
    _queue: asyncio.Queue[ClientRequest] = field(default_factory=asyncio.Queue)
    _waiting: _Waiting | None = None
    _replies: dict[str, asyncio.Event] = field(default_factory=dict)
    _worker: asyncio.Task[None] | None = None
    _stops: set[asyncio.Task[None]] = field(default_factory=set)
    #: Cells the kernel's host was lost with (by msg_id): the cells queued behind
    #: such a cell are aborted (it ended in an error), not sent to the next host.
    _lost: set[str] = field(default_factory=set)
    #: The last cell that replied, until the agent reports its GPUs closed.
    _previous: tuple[LiveScheduler, str] | None = None

    def start(self) -> None:
        self._worker = asyncio.create_task(self._serve())

    async def close(self) -> None:
        """The connection ended: waiting cells are withdrawn; a cell already on
        the kernel keeps its GPUs until the agent reports its end."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    # ---------------------------------------------------------------- frames
    async def from_client(self, frame: Frame) -> None:
        request = open_client_frame(frame, self.protocol)
        if request is None:
            await self.to_kernel(frame)
            return
        if request.channel == "shell" and request.msg_type == "execute_request":
            self._queue.put_nowait(request)
            return
        if request.channel == "control" and request.msg_type == "interrupt_request":
            self.interrupt()
        await self.to_kernel(frame)

    def from_kernel(self, frame: Frame) -> None:
        parent = execute_reply_parent(frame, self.protocol)
        if parent is not None:
            event = self._replies.get(parent)
            if event is not None:
                event.set()

    def host_lost(self, msg_ids: set[str]) -> None:
        """Called before the relay answers the cells the lost host never answered.
        Per cell: a host lost after its cell had ended (the scheduler released it
        first) must not abort the cells behind the next one."""
        self._lost |= msg_ids

    def interrupt(self) -> None:
        """Withdraw the cell waiting for GPUs, if any (a running one is the
        kernel's to interrupt)."""
        waiting = self._waiting
        if waiting is not None and not waiting.task.done():
            waiting.interrupted = True
            waiting.task.cancel()

    # ---------------------------------------------------------------- worker
    async def _serve(self) -> None:
        while True:
            request = await self._queue.get()
            if not await self._run(request):
                await self._abort_queued()

    async def _run(self, request: ClientRequest) -> bool:
        """Carry one cell through; False if it did not run (the ones behind it abort)."""
        scheduler = self.scheduler()
        if scheduler is None:
            await self._fail(request, "GPUSchedulerUnavailable",
                             "GPU cells are scheduled by the one control-plane replica "
                             "that holds the scheduler's lease, and it is not the one this "
                             "connection reached (or it is starting); the cell did not run. "
                             "Reconnect the kernel, then run the cell again")
            return False
        task_id = f"{self.kernel_id}/{request.msg_id}"
        acquiring = asyncio.create_task(self._acquire(scheduler, task_id))
        self._waiting = waiting = _Waiting(request, acquiring)
        notice: str | None = None
        try:
            done, _ = await asyncio.wait({acquiring}, timeout=QUIET_S)
            while not done:
                text = self._wait_text(scheduler, task_id)
                await self._notice(request, text, first=notice is None)
                notice = text
                done, _ = await asyncio.wait({acquiring}, timeout=NOTICE_EVERY_S)
        except BaseException:
            acquiring.cancel()  # the connection closed: the cell leaves the queue
            raise
        finally:
            self._waiting = None
        try:
            binding = acquiring.result()
        except CellRefused as refused:
            await self._fail(request, "GPUUnavailable", refused.reason, notice)
            return False
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            reason = ("interrupted while waiting for GPUs; the cell did not run"
                      if waiting.interrupted else
                      "the GPU scheduler restarted while the cell waited; run it again")
            await self._fail(request, "KeyboardInterrupt", reason, notice)
            return False
        CELL_WAIT.observe(binding.waited_s)
        got = f"got {len(binding.gpu_indices)}x {binding.gpu_type}"
        if notice is not None:
            notice = f"{got} after waiting {binding.waited_s:.1f} s"
            await self._notice(request, notice, first=False)
        try:
            moved_ok = binding.host_id == self.current_host() or await self._move(
                request, scheduler, binding, got, notice is None)
            if not moved_ok:
                return False
            refusal = await self.admit(binding,
                                       lambda reason: self._spawn_stop(request, reason))
        except asyncio.CancelledError:
            # The connection closed during the move or the metering: the cell was
            # never delivered, so no agent will report its end. Its GPUs go back now.
            scheduler.release(task_id)
            raise
        if refusal is not None:
            scheduler.release(task_id)
            await self._fail(request, "InsufficientCredit", f"{refusal}; the cell did not run",
                             notice)
            return False
        replied = self._replies[request.msg_id] = asyncio.Event()
        try:
            cell = CellBinding(task_id=task_id, host_id=binding.host_id,
                               gpu_indices=binding.gpu_indices, gpu_type=binding.gpu_type)
            await self.to_kernel(request.with_binding(cell))
            scheduler.delivered(task_id)
            await self._until_replied(replied, scheduler, task_id)
        except asyncio.CancelledError:
            raise  # the connection closed: the agent reports the cell's end
        except Exception:
            scheduler.release(task_id)
            raise
        finally:
            self._replies.pop(request.msg_id, None)
        scheduler.replied(task_id)  # its GPUs go back when the agent reports them closed
        self._previous = (scheduler, task_id)
        lost = request.msg_id in self._lost
        self._lost.clear()  # cells run one at a time: older entries no longer matter
        return not lost

    async def _move(self, request: ClientRequest, scheduler: LiveScheduler, binding: Binding,
                    got: str, first: bool) -> bool:
        """Carry the kernel to the host of its GPUs; False (cell failed) if it cannot."""
        started = time.monotonic()
        await self._notice(request, f"{got} on host {binding.host_id}: moving the kernel "
                           "there with its state", first=first)
        try:
            await self.move_to(binding.host_id)
        except Exception as exc:
            scheduler.release(binding.task_id)
            log.warning("moving %s to %s failed: %s", self.workspace_id, binding.host_id, exc)
            await self._fail(request, "KernelMoveFailed",
                             f"the kernel could not move to host {binding.host_id}, where "
                             f"its GPUs are: {exc}; the cell did not run")
            return False
        KERNEL_MOVES.observe(time.monotonic() - started)
        await self._notice(request, f"{got} on host {binding.host_id}: the kernel moved there "
                           f"in {time.monotonic() - started:.1f} s", first=False)
        return True

    async def _acquire(self, scheduler: LiveScheduler, task_id: str) -> Binding:
        """The kernel's previous cell settles first (the agent's report, usually
        milliseconds after its reply): its GPUs are back, or still open in the slot
        (a CUDA context), and then this cell takes them over; otherwise it asks."""
        previous = self._previous_cell(scheduler)
        if previous is not None:
            cell = scheduler.running.get(previous)
            while (cell is not None and not cell.settled.is_set()
                   and self.scheduler() is scheduler):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(NOTICE_EVERY_S):
                        await cell.settled.wait()
            taken = scheduler.hand_over(previous, task_id, self.workspace_id, self.gpus)
            if taken is not None:
                self._previous = None
                return taken
        self._previous = None
        return await scheduler.acquire(task_id, self.workspace_id, self.gpus)

    def _previous_cell(self, scheduler: LiveScheduler) -> str | None:
        """This gate's last cell; or, on a new connection, a cell of the kernel that
        an earlier one left holding a GPU open."""
        if self._previous is not None:
            return self._previous[1] if self._previous[0] is scheduler else None
        prefix = f"{self.kernel_id}/"
        return next((task_id for task_id, cell in scheduler.running.items()
                     if cell.held and task_id.startswith(prefix)), None)

    def _held_text(self, scheduler: LiveScheduler) -> str | None:
        """Why the cell waits, while its kernel's previous cell has not settled."""
        previous = self._previous_cell(scheduler)
        cell = scheduler.running.get(previous) if previous is not None else None
        if cell is None or cell.settled.is_set():
            return None
        since = cell.replied_at if cell.replied_at is not None else scheduler.now()
        return (f"waiting for host {cell.binding.host_id} to report the previous cell's "
                f"GPUs closed ({scheduler.now() - since:.0f} s since it ended; interrupt "
                "the kernel to cancel)")

    async def _until_replied(self, replied: asyncio.Event, scheduler: LiveScheduler,
                             task_id: str) -> None:
        """Until the cell's reply, or until the cell ended without one reaching us
        (its kernel died, its host was lost: the scheduler released it already)."""
        while not replied.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await replied.wait()
            if task_id not in scheduler.running and self.scheduler() is scheduler:
                return

    def _spawn_stop(self, request: ClientRequest, reason: str) -> None:
        """The credit for a cell already let through was refused: stop it, and say why."""
        async def stop() -> None:
            await self.to_client(reply_frame(request, "iopub", "stream", {
                "name": "stderr", "text": f"nbfleet: {reason}; stopping the cell\n"}))
            await self.interrupt_kernel()
        task = asyncio.get_running_loop().create_task(stop())
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    def _wait_text(self, scheduler: LiveScheduler, task_id: str) -> str:
        held = self._held_text(scheduler)
        if held is not None:
            return held
        reason = scheduler.wait_reason(task_id) or "waiting for GPUs"
        waited = scheduler.waiting_since(task_id) or 0.0
        return f"{reason} ({waited:.0f} s so far; interrupt the kernel to cancel)"

    async def _notice(self, request: ClientRequest, text: str, first: bool) -> None:
        display_id = f"nbfleet-gpu-wait-{request.msg_id}"
        await self.to_client(reply_frame(
            request, "iopub", "display_data" if first else "update_display_data",
            {"data": {"text/plain": f"nbfleet: {text}"}, "metadata": {},
             "transient": {"display_id": display_id}}))

    async def _fail(self, request: ClientRequest, ename: str, evalue: str,
                    notice: str | None = None) -> None:
        """Answer the cell as the kernel answers one that raised, without running it."""
        if notice is not None:
            await self._notice(request, evalue, first=False)
        error = {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}
        await self.to_client(reply_frame(request, "iopub", "status",
                                         {"execution_state": "busy"}))
        await self.to_client(reply_frame(request, "iopub", "error", error))
        await self.to_client(reply_frame(request, "shell", "execute_reply",
                                         {"status": "error", "execution_count": None, **error}))
        await self.to_client(reply_frame(request, "iopub", "status",
                                         {"execution_state": "idle"}))

    async def _abort_queued(self) -> None:
        """Cells queued behind one that did not run are aborted, unless they asked
        to run regardless (``stop_on_error: false``), as ipykernel does."""
        kept: list[ClientRequest] = []
        while not self._queue.empty():
            request = self._queue.get_nowait()
            if request.content.get("stop_on_error", True) is False:
                kept.append(request)
                continue
            await self.to_client(reply_frame(request, "shell", "execute_reply",
                                             {"status": "aborted", "execution_count": None}))
        for request in kept:
            self._queue.put_nowait(request)


class GateRegistry:
    """This process's open gates by kernel, so a REST interrupt reaches them."""

    def __init__(self) -> None:
        self._gates: dict[str, set[CellGate]] = {}

    def add(self, gate: CellGate) -> None:
        self._gates.setdefault(gate.kernel_id, set()).add(gate)

    def remove(self, gate: CellGate) -> None:
        gates = self._gates.get(gate.kernel_id)
        if gates is not None:
            gates.discard(gate)
            if not gates:
                del self._gates[gate.kernel_id]

    def interrupt(self, kernel_id: str) -> None:
        for gate in list(self._gates.get(kernel_id, ())):
            gate.interrupt()
