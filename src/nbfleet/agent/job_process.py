"""One job attempt's record, and the runner's low-level helpers: spawning, /proc
probes, progress, outputs.

A job runs in its own session, so its process group is the unit the agent
watches and kills: everything the binary forks stays in it unless it calls setsid
itself. Memory is the group's total resident set, read from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbfleet.model.errors import InvalidInput
from nbfleet.model.jobs import Scalar, check_args

log = logging.getLogger(__name__)

TAIL_CHARS = 2000
_TAIL_BYTES = 4 * TAIL_CHARS  # enough for 2000 characters of UTF-8
_LINE_BYTES = 4096
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_PREFIX = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$")

_PR_SET_PDEATHSIG = 1
#: Resolved before any fork: the child must not load libraries between fork and exec.
#: Linux only; elsewhere a job does not die with its agent (the next boot reaps it).
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PROGRESS = re.compile(
    rb"progress\s*[:=]\s*(\d+(?:\.\d+)?)\s*(%|/\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class JobSpec:
    job_id: str
    attempt: int
    command: Sequence[str]
    args: Mapping[str, Scalar]
    gpu_indices: Sequence[int]
    gpu_type: str
    timeout_s: float
    idle_timeout_s: float
    memory_mb: int
    kill_grace_s: float
    blob_prefix: str

    def __post_init__(self) -> None:
        # The job id names a directory and the prefix names blobs: neither may escape.
        if not _JOB_ID.match(self.job_id):
            raise InvalidInput(f"invalid job id {self.job_id!r}", field="job_id")
        if not _PREFIX.match(self.blob_prefix):
            raise InvalidInput(f"invalid blob prefix {self.blob_prefix!r}", field="blob_prefix")
        if self.attempt < 1 or self.memory_mb < 1 or self.kill_grace_s < 0 or min(
                self.timeout_s, self.idle_timeout_s) <= 0:
            raise InvalidInput("attempt, memory and timeouts must be positive")
        check_args(self.args)  # names become flags: the control plane's rules, again


@dataclass(eq=False)
class Attempt:
    spec: JobSpec
    workdir: str
    started: float = field(default_factory=time.monotonic)
    process: asyncio.subprocess.Process | None = None
    pgid: int = 0
    ended: float | None = None
    returncode: int | None = None
    killed_for: str | None = None
    #: The control plane no longer wants this attempt: its finish report is dropped.
    stale: bool = False
    seq: int = 0
    progress: float | None = None
    log_chunks: int = 0
    log_sent: int = 0
    last_activity: float = field(default_factory=time.monotonic)
    out_size: int = 0
    tail: bytearray = field(default_factory=bytearray)
    partial_line: bytes = b""
    facts: dict[str, Any] | None = None
    kill_at: float | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    log_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.ended is None

    @property
    def output_dir(self) -> str:
        return os.path.join(self.workdir, "output")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "log")

    def saw_output(self, chunk: bytes) -> None:
        """Note output: it proves the job alive, feeds the tail and the progress."""
        self.last_activity = time.monotonic()
        self.tail += chunk
        del self.tail[:-_TAIL_BYTES]
        *lines, partial = (self.partial_line + chunk).replace(b"\r", b"\n").split(b"\n")
        self.partial_line = partial[-_LINE_BYTES:]
        for line in lines:
            if (progress := parse_progress(line)) is not None:
                self.progress = progress

    def gpu_ms(self) -> int:
        end = time.monotonic() if self.ended is None else self.ended
        return int((end - self.started) * 1000) * len(self.spec.gpu_indices)

    def status(self) -> dict[str, Any]:
        return {"job_id": self.spec.job_id, "attempt": self.spec.attempt,
                "state": "running" if self.running else "ended",
                "pid": self.process.pid if self.process else None, "outcome_facts": self.facts}

    def report(self) -> dict[str, Any]:
        return {"job_id": self.spec.job_id, "attempt": self.spec.attempt, "seq": self.seq,
                "gpu_ms": self.gpu_ms(), "progress": self.progress,
                "log_chunks": self.log_chunks}

    def end_facts(self, results: list[dict[str, Any]],
                  launch_error: str | None = None) -> dict[str, Any]:
        code = self.returncode
        return {"seq": self.seq + 1, "gpu_ms": self.gpu_ms(),
                "exit_code": code if code is not None and code >= 0 else None,
                "signal": -code if code is not None and code < 0 else None,
                "killed_for": self.killed_for, "launch_error": launch_error,
                "output_tail": self.tail.decode(errors="replace")[-TAIL_CHARS:],
                "result": results, "log_chunks": self.log_chunks}


def job_env(workdir: str, output_dir: str, job_id: str, attempt: int,
            gpu_indices: Sequence[int]) -> dict[str, str]:
    """A fresh environment: a job must never inherit the agent's secrets or config."""
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": workdir,
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_indices)),
           "NBFLEET_JOB_ID": job_id, "NBFLEET_ATTEMPT": str(attempt),
           "NBFLEET_OUTPUT_DIR": output_dir}
    for name in ("LANG", "LC_ALL"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def make_preexec(parent_pid: int) -> Callable[[], None]:
    """Run in the child between fork and exec: die with the agent.

    PDEATHSIG fires when the forking *thread* exits; the agent forks from its
    event-loop thread, which lives as long as the agent. If the agent died before
    prctl took effect, the child kills itself rather than run unsupervised.
    """

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False when it is gone. Never group 0 or 1."""
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _pgrp(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[2])  # state, ppid, pgrp: the comm before ")" may hold spaces


def group_members(pgids: Iterable[int]) -> dict[int, list[int]]:
    """pgid -> its member pids, in one pass over /proc."""
    wanted = set(pgids)
    members: dict[int, list[int]] = {pgid: [] for pgid in wanted}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (pgrp := _pgrp(pid)) in wanted:
            members[pgrp].append(int(pid))
    return members


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def dir_size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


@dataclass(frozen=True, slots=True)
class Probe:
    rss: dict[int, int]      # pgid -> resident bytes of the whole group
    sizes: dict[str, int]    # output dir -> total bytes


def probe(pgids: Iterable[int], output_dirs: Iterable[str]) -> Probe:
    """What the watchdog needs for every running job: blocking, so run it in a thread."""
    members = group_members(pgids)
    rss = {pgid: sum(_rss_bytes(pid) for pid in pids) for pgid, pids in members.items()}
    return Probe(rss, {path: dir_size(path) for path in output_dirs})


def parse_progress(line: bytes) -> float | None:
    """``progress: 0.42``, ``progress: 42%`` or ``progress: 3/10``, clamped to 0..1."""
    match = _PROGRESS.search(line)
    if match is None:
        return None
    value = float(match[1])
    if match[2] == b"%":
        value /= 100
    elif match[3] is not None:
        total = float(match[3])
        value = value / total if total > 0 else 0.0
    return min(1.0, max(0.0, value))


@dataclass(frozen=True, slots=True)
class OutputFile:
    name: str
    path: str
    size: int
    sha256: str


def output_files(output_dir: str) -> list[OutputFile]:
    """Regular files directly in the output dir, by name. A symlink could point at
    anything on the host, so it is never followed. A file the job made unreadable is
    skipped, or the agent would retry its report for ever."""
    try:
        names = sorted(os.listdir(output_dir))
    except OSError:
        return []
    found: list[OutputFile] = []
    for name in names:
        path = os.path.join(output_dir, name)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            found.append(_hashed(name, path))
        except OSError as exc:
            log.warning("skipping output %s: %s", path, exc)
    return found


def _hashed(name: str, path: str) -> OutputFile:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return OutputFile(name, path, size, digest.hexdigest())


def read_from(path: str, offset: int, limit: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read(limit)
    except FileNotFoundError:
        return b""


def record_pgid(workdir: str, pgid: int) -> None:
    with open(os.path.join(workdir, "pgid"), "w") as handle:
        handle.write(f"{pgid}\n")


def _ours(pid: int, job_id: str, attempt: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            env = set(handle.read().split(b"\0"))
    except OSError:
        return False
    return (f"NBFLEET_JOB_ID={job_id}".encode() in env
            and f"NBFLEET_ATTEMPT={attempt}".encode() in env)


def reap_orphans(jobs_dir: str) -> int:
    """Kill the process groups a previous boot of the agent left, then forget them.

    A recorded pgid may have been reused by an unrelated program since, so a group
    is killed only when one of its members carries the job's own environment.
    """
    killed = 0
    if os.path.isdir(jobs_dir):
        for entry in os.listdir(jobs_dir):
            job_id, _, attempt = entry.rpartition("-")
            try:
                with open(os.path.join(jobs_dir, entry, "pgid")) as handle:
                    pgid = int(handle.read().strip())
            except (OSError, ValueError):
                continue
            members = group_members([pgid])[pgid]
            if any(_ours(pid, job_id, attempt) for pid in members) and killpg(
                    pgid, signal.SIGKILL):
                log.warning("killed job %s attempt %s left by a previous boot (pgid %d)",
                            job_id, attempt, pgid)
                killed += 1
    shutil.rmtree(jobs_dir, ignore_errors=True)
    return killed
