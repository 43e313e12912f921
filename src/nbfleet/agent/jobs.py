"""The job runner: runs opaque binaries for the control plane and reports facts.

The agent never decides how an attempt ended; it reports what it saw (exit status,
signal, why it killed the process, the output tail) and the control plane
classifies them with ``model.jobs.classify``. Every report carries the attempt
number and a per-attempt sequence number, and usage is cumulative, so a retried or
reordered report is harmless. Reporting goes through an injected ``Reporter``, so
the runner is tested without a control plane.

Cost: one watchdog pass over /proc per tick for all running jobs together, one
heartbeat request per tick for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import IO, Any, Protocol

from nbfleet.agent import job_process as proc
from nbfleet.agent.job_process import Attempt, JobSpec
from nbfleet.agent.sandbox import Sandbox, gpu_devices, unseen
from nbfleet.agent.sandbox.identity import Identities, Identity, hand_over
from nbfleet.model.errors import Conflict, InvalidInput
from nbfleet.model.jobs import argv
from nbfleet.protocol.agent import JobDirective
from nbfleet.storage.blobs import BlobStore

__all__ = ["JobRunner", "JobSpec", "Reporter"]

log = logging.getLogger(__name__)

STOP_REASONS = ("cancel", "preempt", "stale")
LOG_CHUNK_BYTES = 8 << 20
WATCHDOG_S = 0.2
RETRY_BASE_S, RETRY_CAP_S = 0.5, 10.0
SHUTDOWN_GRACE_S = 5.0
#: Ended attempts remembered per job, so a repeated start stays idempotent.
RECENT_JOBS = 4096


class Reporter(Protocol):
    """The control plane, as the runner sees it. A method raises on a transient
    failure (the runner retries); ``finish`` answers False when the control plane
    no longer wants the attempt (stale), which drops the report."""

    async def heartbeat(self, attempts: list[dict[str, Any]]) -> list[JobDirective]: ...

    async def finish(self, job_id: str, attempt: int, facts: dict[str, Any]) -> bool: ...


class JobRunner:
    def __init__(self, state_dir: str, blobs: BlobStore, reporter: Reporter, *,
                 heartbeat_s: float = 2.0, sandbox: Sandbox | None = None,
                 identities: Identities | None = None) -> None:
        self.jobs_dir = os.path.join(state_dir, "jobs")
        #: Binaries run inside it when there is one: they see their output and
        #: scratch directories and the read-only system, never the agent's files
        #: for the attempt (its log, its process group record), the agent's or
        #: control plane's state and secrets.
        self.sandbox = sandbox
        #: With a root agent, each attempt runs as its own unprivileged uid.
        self.identities = identities
        self._identities: dict[tuple[str, int], Identity] = {}
        self.blobs = blobs
        self.reporter = reporter
        self.heartbeat_s = heartbeat_s
        self._live: dict[tuple[str, int], Attempt] = {}
        self._recent: OrderedDict[str, Attempt] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------- lifecycle
    async def open(self) -> None:
        """Kill what a previous boot left running, then start the loops."""
        await asyncio.to_thread(proc.reap_orphans, self.jobs_dir)
        self._loops = [asyncio.create_task(self._every(self.heartbeat_s, self.heartbeat_once)),
                       asyncio.create_task(self._every(WATCHDOG_S, self.watch_once))]

    async def close(self) -> None:
        """Stop every job (nobody would supervise it) and report nothing more."""
        for loop in self._loops:
            loop.cancel()
        running = [a for a in self._live.values() if a.running]
        for att in running:
            self._kill(att, "stale", min(att.spec.kill_grace_s, SHUTDOWN_GRACE_S))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_GRACE_S + 1):
                await asyncio.gather(*(a.exited.wait() for a in running))
        for task in [*self._loops, *self._tasks]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --------------------------------------------------------------- commands
    async def start(self, spec: JobSpec) -> dict[str, Any]:
        """Start an attempt, or answer how it is doing when it is already known."""
        known = self._live.get((spec.job_id, spec.attempt)) or self._recent.get(spec.job_id)
        if known is not None:
            if known.spec.attempt > spec.attempt:
                raise Conflict(f"job {spec.job_id} is already at attempt {known.spec.attempt}",
                               current_attempt=known.spec.attempt)
            if known.spec.attempt == spec.attempt:
                return known.status()
            # A newer attempt means the control plane gave up on the older one.
            self.stop(spec.job_id, known.spec.attempt, "stale", spec.kill_grace_s)
        att = Attempt(spec, os.path.join(self.jobs_dir, f"{spec.job_id}-{spec.attempt}"))
        self._live[(spec.job_id, spec.attempt)] = att
        self._recent[spec.job_id] = att
        self._recent.move_to_end(spec.job_id)
        while len(self._recent) > RECENT_JOBS:
            self._recent.popitem(last=False)
        try:
            log_file = await self._spawn(att)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("job %s attempt %d did not launch: %s", spec.job_id, spec.attempt, exc)
            att.ended = att.started
            att.exited.set()
            att.facts = att.end_facts([], launch_error=str(exc))
            self._track(self._deliver(att))
            return att.status()
        if att.kill_at is not None:  # stopped while it was being spawned
            self._signal(att)
        self._track(self._supervise(att, log_file))
        return att.status()

    def stop(self, job_id: str, attempt: int, reason: str, grace_s: float) -> bool:
        """SIGTERM now, SIGKILL after ``grace_s``; True when a process is stopping."""
        if reason not in STOP_REASONS:
            raise InvalidInput(f"stop reason must be one of {', '.join(STOP_REASONS)}")
        att = self._live.get((job_id, attempt))
        return att is not None and self._kill(att, reason, grace_s)

    def attempts(self) -> list[dict[str, Any]]:
        """Every attempt still running or still reporting, for debugging."""
        return [{"job_id": a.spec.job_id, "attempt": a.spec.attempt,
                 "state": "running" if a.running else "ended",
                 "pid": a.process.pid if a.process else None, "gpu_ms": a.gpu_ms(),
                 "seq": a.seq} for a in self._live.values()]

    # ---------------------------------------------------------------- process
    async def _spawn(self, att: Attempt) -> IO[bytes]:
        spec = att.spec
        log_file = await asyncio.to_thread(_prepare, att)
        env = proc.job_env(att.workdir, att.output_dir, spec.job_id, spec.attempt,
                           spec.gpu_indices)
        if self.sandbox is not None:
            env["HOME"] = _scratch(att)
        try:
            att.process = await asyncio.create_subprocess_exec(
                *self._command_line(att), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=att.workdir,
                env=env,
                start_new_session=True,
                # bwrap's --die-with-parent ties the sandbox to the agent already;
                # with no preexec hook Python can vfork, which here is ~8 ms less
                # per start than forking the whole agent (bench/jobs.py latency).
                preexec_fn=None if self.sandbox else proc.make_preexec(os.getpid()))
        except BaseException:
            log_file.close()
            raise
        att.pgid = att.process.pid  # a session leader's group id is its pid
        att.started = att.last_activity = time.monotonic()
        await asyncio.to_thread(proc.record_pgid, att.workdir, att.pgid)
        return log_file

    def _command_line(self, att: Attempt) -> list[str]:
        line = argv(att.spec.command, att.spec.args, att.output_dir)
        if self.sandbox is None:
            return line
        # Inside bwrap an exec failure would look like the binary's own exit 1;
        # checked here, it is the launch failure it is.
        executable = shutil.which(line[0])
        if executable is None:
            raise FileNotFoundError(f"no executable {line[0]!r} on this host")
        # The command's own files (the binary, a script it runs) stay visible, read
        # only, even under a hidden path such as /tmp.
        files = unseen(self.sandbox, [part for part in [executable, *att.spec.command[1:]]
                                      if os.path.isabs(part) and os.path.isfile(part)])
        identity = None
        if self.identities is not None:
            identity = self._identities.setdefault((att.spec.job_id, att.spec.attempt),
                                                   self.identities.allocate())
        scratch = _scratch(att)
        for path in (att.output_dir, scratch):
            hand_over(path, identity)
        return self.sandbox.wrap([executable, *line[1:]], [att.output_dir, scratch], scratch,
                                 identity=identity, devices=gpu_devices(), job=True,
                                 readonly=files)

    def _status(self, returncode: int) -> int:
        """The binary's own status: under bwrap, 128 + N is death by signal N (as
        asyncio reports it unsandboxed: -N)."""
        if self.sandbox is not None and 128 < returncode <= 128 + 64:
            return 128 - returncode
        return returncode

    async def _supervise(self, att: Attempt, log_file: IO[bytes]) -> None:
        process = att.process
        assert process is not None and process.stdout is not None
        try:
            reader = asyncio.create_task(self._read(att, process.stdout, log_file))
            att.returncode = self._status(await process.wait())
            att.ended = time.monotonic()
            proc.killpg(att.pgid, signal.SIGKILL)  # whatever it left behind
            for timer in att.timers:
                timer.cancel()
            await reader
        finally:
            log_file.close()
            att.exited.set()
        await self._deliver(att)

    @staticmethod
    async def _read(att: Attempt, stream: asyncio.StreamReader, log_file: IO[bytes]) -> None:
        while chunk := await stream.read(65536):
            try:
                log_file.write(chunk)
            except OSError as exc:  # a full disk must not cost the job its report
                log.warning("job %s: cannot write its log: %s", att.spec.job_id, exc)
            att.saw_output(chunk)

    def _kill(self, att: Attempt, reason: str, grace_s: float) -> bool:
        """The first reason wins; a later, shorter grace still hastens the SIGKILL.
        A stale attempt's report is dropped, even when its process has ended."""
        if reason == "stale":
            att.stale = True
        if not att.running:
            return False
        if reason != "stale" and att.killed_for is None:
            att.killed_for = reason
        deadline = time.monotonic() + grace_s
        if att.kill_at is None or deadline < att.kill_at:
            att.kill_at = deadline
            self._signal(att)
        return True

    def _signal(self, att: Attempt) -> None:
        if not att.pgid or att.kill_at is None:
            return  # still spawning: start() signals once the group exists
        delay = att.kill_at - time.monotonic()
        if delay <= 0:
            proc.killpg(att.pgid, signal.SIGKILL)
            return
        proc.killpg(att.pgid, signal.SIGTERM)
        att.timers.append(asyncio.get_running_loop().call_later(
            delay, proc.killpg, att.pgid, signal.SIGKILL))

    async def watch_once(self) -> None:
        """Enforce the timeout, idle timeout and memory limit of every running job."""
        running = [a for a in self._live.values() if a.running and a.process]
        if not running:
            return
        seen = await asyncio.to_thread(proc.probe, [a.pgid for a in running],
                                       [a.output_dir for a in running])
        now = time.monotonic()
        for att in running:
            spec = att.spec
            if att.process is not None and att.process.returncode is not None:
                # The main process is gone but a child still holds the output pipe.
                proc.killpg(att.pgid, signal.SIGKILL)
                continue
            size = seen.sizes.get(att.output_dir, 0)
            if size != att.out_size:
                att.out_size, att.last_activity = size, now
            if seen.rss.get(att.pgid, 0) > spec.memory_mb << 20:
                self._kill(att, "memory", 0.0)
            elif now - att.started > spec.timeout_s:
                self._kill(att, "timeout", spec.kill_grace_s)
            elif now - att.last_activity > spec.idle_timeout_s:
                self._kill(att, "idle", spec.kill_grace_s)

    # -------------------------------------------------------------- reporting
    async def heartbeat_once(self) -> None:
        """Upload new log bytes, report every running attempt, obey the directives."""
        running = [a for a in self._live.values() if a.running and a.process and not a.stale]
        for att in running:
            try:
                await self._upload_log(att)
            except Exception as exc:
                log.warning("log upload for job %s failed: %s", att.spec.job_id, exc)
        reports = []
        for att in running:
            if att.running:  # once ended, the finish report carries the next seq
                att.seq += 1
                reports.append(att.report())
        if not reports:
            return
        try:
            directives = await self.reporter.heartbeat(reports)
        except Exception as exc:
            log.warning("job heartbeat failed: %s", exc)
            return
        for directive in directives:
            if directive.action != "stop":
                continue
            try:
                self.stop(directive.job_id, directive.attempt, directive.reason or "",
                          directive.grace_s)
            except InvalidInput as exc:
                log.warning("ignoring a bad job directive %r: %s", directive, exc)

    async def _upload_log(self, att: Attempt) -> bool:
        """Upload the log bytes not sent yet as the next chunk; False when none."""
        async with att.log_lock:
            data = await asyncio.to_thread(proc.read_from, att.log_path, att.log_sent,
                                           LOG_CHUNK_BYTES)
            if not data:
                return False
            key = f"{att.spec.blob_prefix}/log/{att.log_chunks:08d}"
            await asyncio.to_thread(self.blobs.put, key, data)
            att.log_sent += len(data)
            att.log_chunks += 1
            return True

    async def _finalize(self, att: Attempt) -> dict[str, Any]:
        while await self._upload_log(att):
            pass
        results: list[dict[str, Any]] = []
        if att.returncode == 0:
            for found in await asyncio.to_thread(proc.output_files, att.output_dir):
                key = f"{att.spec.blob_prefix}/output/{found.name}"
                await asyncio.to_thread(self.blobs.put_file, key, found.path)
                results.append({"name": found.name, "key": key, "size": found.size,
                                "sha256": found.sha256})
        return att.end_facts(results)

    async def _deliver(self, att: Attempt) -> None:
        """Upload, then report the end until the control plane accepts or refuses it.

        An ended attempt is no longer heartbeated, so its retried report is what
        keeps it from being declared lost: retries back off no further than the
        heartbeat interval, or a control plane back from an outage would hear of it
        only after its lost-worker grace (one heartbeat timeout) has run out.
        """
        spec, delay = att.spec, RETRY_BASE_S
        cap = min(RETRY_CAP_S, max(RETRY_BASE_S, self.heartbeat_s))
        while not att.stale:
            try:
                if att.facts is None:
                    att.facts = await self._finalize(att)
                accepted = await self.reporter.finish(spec.job_id, spec.attempt, att.facts)
            except Exception as exc:
                log.warning("finishing job %s attempt %d failed (%s); retrying in %.1fs",
                            spec.job_id, spec.attempt, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, cap)
                continue
            if not accepted:
                log.info("job %s attempt %d is stale; report dropped", spec.job_id, spec.attempt)
            break
        else:
            log.info("job %s attempt %d was stopped as stale; report dropped",
                     spec.job_id, spec.attempt)
        del self._live[(spec.job_id, spec.attempt)]
        await asyncio.to_thread(shutil.rmtree, att.workdir, True)
        identity = self._identities.pop((spec.job_id, spec.attempt), None)
        if identity is not None and self.identities is not None:
            self.identities.release(identity)

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(_forget(self._tasks))

    @staticmethod
    async def _every(interval: float, tick: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await tick()
            except Exception:
                log.exception("job runner tick failed")


def _forget(tasks: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("job task failed", exc_info=task.exception())

    return done


def _prepare(att: Attempt) -> IO[bytes]:
    """The work dir, its output dir and the log, opened unbuffered so heartbeats
    upload every byte the job printed."""
    os.makedirs(att.output_dir, exist_ok=True)
    os.makedirs(_scratch(att), exist_ok=True)
    return open(att.log_path, "ab", buffering=0)  # closed by _supervise


def _scratch(att: Attempt) -> str:
    """A sandboxed job's working directory and $HOME: writable, never uploaded."""
    return os.path.join(att.workdir, "scratch")
