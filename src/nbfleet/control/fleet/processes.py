"""Process trees of local agents: finding, recognising and killing them (Linux ``/proc``).

A pid alone does not name a process for good: once a process is reaped, the
kernel may hand its pid to an unrelated one. So every process here is known by
pid *and* start time (clock ticks after boot), and is signalled only while both
still match. Across a reboot start times repeat, so what is written to disk
(``agent.pid``) also records the boot id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)


class Proc(NamedTuple):
    """One process, for good: a reused pid has another start time."""

    pid: int
    start: int  # clock ticks after boot: with the pid, names one process for good


class _Stat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    start: int


def forget_pid(pid_file: Path, pid: int) -> None:
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


def identity(pid: int) -> tuple[int, str] | None:
    """(start time, boot id): with the pid, what ``agent.pid`` records.

    The start time tells the process from a later one given the same pid; the boot
    id tells a start time of this boot from the same number in an earlier one.
    """
    stat = _stat(pid)
    return (stat.start, _boot_id()) if stat is not None else None


def _alive(proc: Proc) -> bool:
    stat = _stat(proc.pid)
    return stat is not None and stat.start == proc.start and stat.state != "Z"


def family(root: int) -> set[Proc]:
    """``root``, its descendants and its process group's members, as they are now.

    Taken as a snapshot (each with its start time) so that they can be killed later
    without hitting a process that took one of their pids meanwhile.
    """
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
    return {Proc(pid, stats[pid].start) for pid in found if pid in stats}


async def kill_all(procs: set[Proc], wait_s: float = 5.0) -> None:
    """SIGKILL each still-living process of ``procs``; wait (bounded) until they are gone.

    Only those whose pid still has the recorded start time: the others are gone, and
    their pids may belong to someone else now.
    """
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


def _stale_agent(pid_file: Path) -> Proc | None:
    """The agent an earlier provider recorded in ``pid_file``, if it still runs."""
    try:
        pid_text, start_text, boot = pid_file.read_text().split()
        stale = Proc(int(pid_text), int(start_text))
        cmdline = Path(f"/proc/{stale.pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if boot != _boot_id() or not _alive(stale):
        return None
    if b"nbfleet.cli.main" not in cmdline or b"agent" not in cmdline:
        return None
    return stale


async def kill_stale(pid_file: Path, agent_id: str) -> None:
    """Kill the agent an earlier provider left under this id (and what it started).

    A provider killed with -9 could not stop its agents; the next one on the same
    directory reuses their ids, so it clears them out first. The pid file's start
    time, boot id and the command line make sure it is that agent, not a newcomer.
    """
    stale = _stale_agent(pid_file)
    if stale is not None:
        log.warning("killing agent %s (pid %d) left by an earlier run", agent_id, stale.pid)
        await kill_all(family(stale.pid))
