"""Which GPUs each slot may open now, and which ones a slot still holds.

``CUDA_VISIBLE_DEVICES`` is a convention user code can change; the slot's device
cgroup is not. A cell's binding opens its GPUs to its slot (:meth:`SlotGpus.grant`,
called as the agent accepts the cell) and its end closes them again
(:meth:`SlotGpus.release`); the control nodes (``nvidiactl``, ``nvidia-uvm``...) are
open while any GPU is. The agent keeps one :class:`HostGpus` for the host, so that
a GPU is open to at most one slot at a time.

A release does not end at the cgroup: what was opened while bound stays open (and
a real GPU's CUDA context keeps its descriptors for the life of the process). So
after closing the cgroup to a GPU, the release looks for processes of the slot
that still hold it (``devices.held``, off the event loop). Until none does, the
cell is not reported released (``KernelBindings`` lists it as held, so the control
plane keeps the GPU committed and billed), the GPU stays the slot's, and no other
slot is let open it: a binding of it elsewhere waits, refused by that slot's
cgroup, until the holder closes it. A GPU the slot binds again meanwhile is
committed to the new cell, which ends the old one's hold.

Without a device cgroup (cgroup v2, an unprivileged agent) the bookkeeping and the
check at release still run, but nothing stops a kernel opening a GPU node that is
bound into its ``/dev``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from nbfleet.agent.sandbox.cgroups import Cgroup
from nbfleet.agent.sandbox.devices import GpuNode, cgroup_pids, held

log = logging.getLogger(__name__)

#: How often a GPU still held after its release is looked at again.
RECHECK_S = 1.0


class HostGpus:
    """This host's GPU nodes, and which slot each GPU is open to (or held by)."""

    def __init__(self, nodes: Sequence[GpuNode]) -> None:
        self.gpus = {node.index: node for node in nodes if node.index is not None}
        self.control = [node for node in nodes if node.index is None]
        self._owner: dict[int, SlotGpus] = {}
        #: GPU index -> slots with a cell bound to it that wait for its holder.
        self._waiting: dict[int, set[SlotGpus]] = {}

    def slot(self, cgroup: Cgroup | None) -> SlotGpus:
        return SlotGpus(self, cgroup)

    def owner(self, index: int) -> SlotGpus | None:
        return self._owner.get(index)

    def _claim(self, index: int, slot: SlotGpus) -> bool:
        owner = self._owner.setdefault(index, slot)
        waiting = self._waiting.setdefault(index, set())
        if owner is slot:
            waiting.discard(slot)
            return True
        waiting.add(slot)
        return False

    def _free(self, index: int, slot: SlotGpus) -> None:
        waiting = self._waiting.get(index, set())
        waiting.discard(slot)
        if self._owner.get(index) is slot:
            del self._owner[index]
            for other in list(waiting):
                other.sync()


@dataclass(slots=True)
class _Hold:
    """A cell that ended while its slot still held some of its GPUs open."""

    indices: set[int]
    done: Callable[[], None]
    #: Told once, when the first look finds a GPU still open.
    still_held: Callable[[], None]
    logged: bool = False


class SlotGpus:
    """One slot's GPUs: bound (cells running with them), open in its device cgroup,
    and held after their cells ended. Called on the event loop only."""

    def __init__(self, host: HostGpus, cgroup: Cgroup | None) -> None:
        self.host = host
        self.cgroup = cgroup
        #: GPU index -> cells bound to it now.
        self.bound: Counter[int] = Counter()
        #: GPUs the device cgroup lets the slot open.
        self.allowed: set[int] = set()
        self._control_open = False
        #: Bound here but held by another slot (logged once).
        self._refused: set[int] = set()
        #: task id -> what it still holds.
        self._holds: dict[str, _Hold] = {}
        self._check: asyncio.Task[None] | None = None

    @property
    def enforced(self) -> bool:
        """Whether a device cgroup stands behind the bookkeeping."""
        return self.cgroup is not None and self.cgroup.devices is not None

    def held_tasks(self) -> set[str]:
        return set(self._holds)

    def grant(self, indices: Iterable[int]) -> None:
        """A cell bound to ``indices`` is about to run: let the slot open them."""
        for index in indices:
            if index in self.host.gpus:
                self.bound[index] += 1
        self.sync()
        # A GPU bound again is the new cell's: the old cell's hold on it ends.
        for task_id, hold in list(self._holds.items()):
            hold.indices -= set(self.bound)
            if not hold.indices:
                self._end_hold(task_id)

    def release(self, task_id: str, indices: Iterable[int], done: Callable[[], None],
                still_held: Callable[[], None] = lambda: None) -> None:
        """The cell ``task_id`` ended: close its GPUs to the slot; ``done`` is called
        (at once, or once the slot no longer holds them) to report it released, and
        ``still_held`` first if a process of the slot still has one open."""
        closing: set[int] = set()
        for index in indices:
            if self.bound[index] > 0:
                self.bound[index] -= 1
                if self.bound[index] == 0:
                    del self.bound[index]
                    closing.add(index)
        if not closing or self.cgroup is None:
            # Without a cgroup there is no list of the slot's processes to look in.
            self.sync()
            done()
            return
        # Held until looked at: the GPU stays the slot's (closed to it) meanwhile.
        self._holds[task_id] = _Hold(closing, done, still_held)
        self.sync()
        if self._check is None or self._check.done():
            self._check = asyncio.get_running_loop().create_task(
                self._watch(), name=f"gpu-holds-{id(self):x}")

    def sync(self) -> None:
        """Make the device cgroup say what the bookkeeping says."""
        held_now = {i for hold in self._holds.values() for i in hold.indices}
        want = {i for i in self.bound if self.host._claim(i, self)}
        for index in sorted(want - self.allowed):
            self._write(True, [self.host.gpus[index].rule])
            self.allowed.add(index)
        for index in sorted(self.allowed - want):
            self._write(False, [self.host.gpus[index].rule])
            self.allowed.discard(index)
        for index in sorted(set(self.bound) - want - self._refused):
            log.warning("GPU %d is still held open by another slot: not opened to this "
                        "one until it is closed", index)
        self._refused = set(self.bound) - want
        control = bool(self.allowed)
        if control != self._control_open:
            self._write(control, [node.rule for node in self.host.control])
            self._control_open = control
        for index in list(self.host.gpus):
            if index not in self.bound and index not in held_now:
                self.host._free(index, self)

    def _write(self, allow: bool, rules: list[str]) -> None:
        if self.cgroup is None or not rules:
            return
        try:
            (self.cgroup.allow if allow else self.cgroup.deny)(rules)
        except OSError as exc:  # the slot is being removed
            log.warning("could not %s GPU devices: %s", "allow" if allow else "deny", exc)

    def _end_hold(self, task_id: str) -> None:
        hold = self._holds.pop(task_id, None)
        if hold is None:
            return
        self.sync()
        try:
            hold.done()
        except Exception:  # a reporting fault must not stop the others' checks
            log.exception("could not report the release of %s", task_id)

    async def _watch(self) -> None:
        """Look for holders until none of the released GPUs is held any more."""
        unseen = True
        while self._holds:
            if not unseen:
                await asyncio.sleep(RECHECK_S)
            scanned = {task_id: set(hold.indices) for task_id, hold in self._holds.items()}
            wanted = set().union(*scanned.values())
            nodes = [self.host.gpus[i] for i in sorted(wanted)]
            assert self.cgroup is not None
            found = await asyncio.to_thread(_held_in, self.cgroup.procs_files, nodes)
            still = {node.index for node in found}
            # Holds that began during the scan were not looked for: at once, next.
            unseen = any(task_id not in scanned for task_id in self._holds)
            for task_id, hold in list(self._holds.items()):
                if task_id not in scanned:
                    continue
                hold.indices -= scanned[task_id] - still
                if not hold.indices:
                    self._end_hold(task_id)
                elif not hold.logged:
                    hold.logged = True
                    log.info("cell %s ended with GPUs %s still open in its slot: they "
                             "stay committed to it until closed", task_id,
                             sorted(hold.indices))
                    try:
                        hold.still_held()
                    except Exception:  # a reporting fault must not stop the others' checks
                        log.exception("could not report the hold of %s", task_id)


def _held_in(procs_files: list[str], nodes: list[GpuNode]) -> set[GpuNode]:
    return held(cgroup_pids(procs_files), nodes)
