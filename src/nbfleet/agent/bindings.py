"""Per-cell GPU bindings the agent has forwarded, and the reports that they ended.

The control plane commits GPUs to a cell when it sends the cell's
``execute_request`` (see :mod:`nbfleet.protocol.gpu`). The agent remembers each
binding until the cell's ``execute_reply``, or until the kernel dies, restarts or
is shut down, and then tells the control plane which tasks ended. Telling it is
off the kernel's hot path: ending a binding only puts task ids in a
:class:`ReleaseQueue`, which the service drains over HTTP with retries.

In a slot with GPU nodes a binding also opens its GPUs to the slot's device
cgroup, and its end closes them (``sandbox.gpus``). A cell whose slot still holds
one of its GPUs open is not reported released until it closes it: it stays listed
on ``GET /bindings`` (``held``), so the GPU stays committed, and billed, to it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from pydantic import ValidationError

from nbfleet.agent.sandbox.gpus import SlotGpus
from nbfleet.protocol.gpu import ActiveBinding, CellBinding

log = logging.getLogger(__name__)

#: At most this many GPUs per cell, each index below ``MAX_GPU_INDEX``: anything
#: larger is malformed, and is refused before it costs validation time.
MAX_GPUS = 256
MAX_GPU_INDEX = 4096
#: Bindings one kernel may hold (queued cells included); the oldest is released past it.
KERNEL_LIMIT = 10_000
#: Task ids kept for a control plane that does not answer; the oldest are dropped past it
#: (a restarted control plane asks ``GET /bindings`` for what is still busy anyway).
PENDING_LIMIT = 100_000
#: Task ids per report (``ReleasedCells`` accepts up to 10 000).
BATCH_LIMIT = 1000
#: How long a release waits for others to share its report (see ``drain_forever``).
GATHER_S = 0.005
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0


def parse_binding(raw: object) -> CellBinding | None:
    """The binding in an ``execute_request``'s metadata, or None if it is malformed.

    A malformed binding is logged and treated as no binding: the agent must not
    fail on what a client sent. Types are checked strictly (pydantic alone would
    take ``"1"`` or ``true`` as GPU 1), and sizes before anything is built.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        log.warning("ignoring a malformed GPU binding: not an object")
        return None
    indices = raw.get("gpu_indices", [])
    if not (isinstance(indices, list) and len(indices) <= MAX_GPUS
            and all(type(i) is int and 0 <= i < MAX_GPU_INDEX for i in indices)
            and len(set(indices)) == len(indices)):
        log.warning("ignoring a malformed GPU binding: bad gpu_indices")
        return None
    task_id, host_id = raw.get("task_id"), raw.get("host_id")
    gpu_type = raw.get("gpu_type", "")
    if not (isinstance(task_id, str) and isinstance(host_id, str)
            and isinstance(gpu_type, str) and len(gpu_type) <= 200):
        log.warning("ignoring a malformed GPU binding: bad task_id, host_id or gpu_type")
        return None
    try:
        return CellBinding(task_id=task_id, host_id=host_id, gpu_indices=tuple(indices),
                           gpu_type=gpu_type)
    except ValidationError as exc:
        log.warning("ignoring a malformed GPU binding: %s", exc.errors()[0].get("msg"))
        return None


@dataclass(frozen=True, slots=True)
class _Bound:
    binding: CellBinding
    started: float  # time.monotonic()


class KernelBindings:
    """The bindings of one kernel's cells that have not replied yet, by request msg_id.

    Every ending goes to ``on_release`` (task ids), which must not block: the
    kernel's message loop calls it.
    """

    def __init__(self) -> None:
        self._bound: OrderedDict[str, _Bound] = OrderedDict()
        #: Ended cells whose GPUs the slot still holds open, by task id (with msg_id).
        self._held: dict[str, tuple[str, _Bound]] = {}
        self.on_release: Callable[[list[str]], None] = lambda task_ids: None
        #: Told the cells that ended with a GPU still open in the slot (not released).
        self.on_held: Callable[[list[str]], None] = lambda task_ids: None
        #: The slot's GPUs (None: no GPU nodes in the slot, or no slot).
        self.gpus: SlotGpus | None = None

    def __len__(self) -> int:
        return len(self._bound)

    def start(self, msg_id: str, binding: CellBinding) -> None:
        ended: list[tuple[str, _Bound]] = []
        old = self._bound.pop(msg_id, None)
        if old is not None and old.binding.task_id == binding.task_id:
            binding = old.binding  # the same cell again: bound (and granted) already
        else:
            if old is not None:
                ended.append((msg_id, old))  # a reused msg_id: the first can never reply
            if self.gpus is not None:
                self.gpus.grant(binding.gpu_indices)
        self._bound[msg_id] = _Bound(binding, time.monotonic())
        while len(self._bound) > KERNEL_LIMIT:
            oldest_id, oldest = self._bound.popitem(last=False)
            log.warning("too many cells bound in one kernel; releasing task %s",
                        oldest.binding.task_id)
            ended.append((oldest_id, oldest))
        self._finish(ended)

    def end(self, msg_id: str | None) -> None:
        """The cell ``msg_id`` replied (or will never run)."""
        if msg_id is None:
            return
        bound = self._bound.pop(msg_id, None)
        if bound is not None:
            self._finish([(msg_id, bound)])

    def end_all(self, keep: Iterable[str] = ()) -> None:
        """The kernel died, restarts or stops: every cell in it ends, but ``keep``."""
        kept = {msg_id: self._bound[msg_id] for msg_id in keep if msg_id in self._bound}
        ended = [(msg_id, b) for msg_id, b in self._bound.items() if msg_id not in kept]
        self._bound = OrderedDict(kept)
        self._finish(ended)

    def active(self, kernel_id: str, now: float | None = None) -> list[ActiveBinding]:
        """Cells running, then cells ended whose GPUs are still held (``held``)."""
        moment = time.monotonic() if now is None else now
        running = [ActiveBinding(kernel_id=kernel_id, msg_id=msg_id, binding=b.binding,
                                 age_s=max(0.0, moment - b.started))
                   for msg_id, b in self._bound.items()]
        return running + [ActiveBinding(kernel_id=kernel_id, msg_id=msg_id, binding=b.binding,
                                        age_s=max(0.0, moment - b.started), held=True)
                          for msg_id, b in self._held.values()]

    def _finish(self, ended: list[tuple[str, _Bound]]) -> None:
        """Close the cells' GPUs; report each once its slot holds none of them."""
        now: list[str] = []
        for msg_id, bound in ended:
            task_id = bound.binding.task_id
            if self.gpus is None or not bound.binding.gpu_indices:
                now.append(task_id)
                continue
            self._held[task_id] = (msg_id, bound)
            self.gpus.release(task_id, bound.binding.gpu_indices,
                              functools.partial(self._closed, task_id),
                              functools.partial(self._still_held, task_id))
        if now:
            self._release(now)

    def _closed(self, task_id: str) -> None:
        if self._held.pop(task_id, None) is not None:
            self._release([task_id])

    def _still_held(self, task_id: str) -> None:
        if task_id in self._held:
            try:
                self.on_held([task_id])
            except Exception:  # a reporting fault must never break the kernel's relay
                log.exception("could not queue the hold of %s", task_id)

    def _release(self, task_ids: list[str]) -> None:
        try:
            self.on_release(task_ids)
        except Exception:  # a reporting fault must never break the kernel's relay
            log.exception("could not queue the release of %s", task_ids)


#: Sends one report: the cells released, and those that ended with a GPU still
#: held; returns once the control plane took it, raises to have it retried.
Send = Callable[[list[str], list[str]], Awaitable[None]]


class ReleaseQueue:
    """Task ids whose bindings ended, waiting to be told to the control plane.

    :meth:`put` (released) and :meth:`hold` (ended, a GPU still open) never block
    and never fail, so kernels call them directly; :meth:`drain_forever` sends what
    accumulated, a batch at a time, retrying with backoff. ``send`` returns
    normally when the control plane took the batch (or had nothing to do with it,
    e.g. 404) and raises to have it retried.
    """

    def __init__(self) -> None:
        #: task id -> only held (True) or released (False); ordered and deduplicated.
        self._pending: dict[str, bool] = {}
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, task_ids: Iterable[str]) -> None:
        for task_id in task_ids:
            self._pending[task_id] = False  # a release says all a hold said
        self._trim()

    def hold(self, task_ids: Iterable[str]) -> None:
        for task_id in task_ids:
            self._pending.setdefault(task_id, True)
        self._trim()

    def _trim(self) -> None:
        overflow = len(self._pending) - PENDING_LIMIT
        if overflow > 0:
            log.warning("dropping %d unreported GPU releases", overflow)
            for task_id in list(self._pending)[:overflow]:
                del self._pending[task_id]
        if self._pending:
            self._wake.set()

    def pending(self) -> list[str]:
        return list(self._pending)

    async def send_once(self, send: Send) -> None:
        """Send the oldest batch; it leaves the queue only once ``send`` returns (an
        entry that changed meanwhile, a hold become a release, stays for the next)."""
        batch = dict(itertools.islice(self._pending.items(), BATCH_LIMIT))
        if batch:
            await send([t for t, held in batch.items() if not held],
                       [t for t, held in batch.items() if held])
            for task_id, held in batch.items():
                if self._pending.get(task_id) is held:
                    del self._pending[task_id]

    async def drain_forever(self, send: Send, gather_s: float = GATHER_S) -> None:
        """``gather_s``: how long the first release waits for others to share its
        call. The report is what gives a cell's GPUs back (the gateway only sees
        its reply), and the kernel's next cell waits for it, so the wait is short:
        releases that come while a report is on its way share the next one."""
        delay = BACKOFF_START_S
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                await asyncio.sleep(gather_s)
            try:
                await self.send_once(send)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("could not report %d GPU releases (%s); retrying in %.1fs",
                            len(self._pending), exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
            else:
                delay = BACKOFF_START_S
