"""The agent's job runner with real processes and the real fake generator.

A fake reporter stands in for the control plane; the blob store is a local
directory. The outcomes are checked the way the control plane will read the
facts: through ``model.jobs.classify``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nbfleet.agent.app import create_agent_app
from nbfleet.agent.job_process import parse_progress
from nbfleet.agent.jobs import JobRunner, JobSpec
from nbfleet.agent.service import AgentConfig, AgentService
from nbfleet.model.errors import Conflict
from nbfleet.model.jobs import Outcome, Scalar, classify
from nbfleet.protocol.agent import JobDirective
from nbfleet.storage.blobs import BlobStore

#: Runs no DB: the PostgreSQL pass of `make test` skips it.
pytestmark = pytest.mark.no_db

FAKEGEN = str(Path(__file__).resolve().parents[1] / "support" / "nbfleet-fakegen")
FAKEGEN_CMD = [sys.executable, FAKEGEN]


class FakeReporter:
    """Records what the runner reports; hands out directives and failures on demand."""

    def __init__(self) -> None:
        self.heartbeats: list[list[dict[str, Any]]] = []
        self.finished: dict[tuple[str, int], dict[str, Any]] = {}
        self.directives: list[dict[str, Any]] = []
        self.failures = 0
        self.accept = True
        self.calls = 0

    async def heartbeat(self, attempts: list[dict[str, Any]]) -> list[JobDirective]:
        self.heartbeats.append(attempts)
        directives, self.directives = self.directives, []
        return [JobDirective.model_validate(d) for d in directives]

    async def finish(self, job_id: str, attempt: int, facts: dict[str, Any]) -> bool:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise ConnectionError("control plane down")
        self.finished[(job_id, attempt)] = facts
        return self.accept

    async def wait_finished(self, job_id: str, attempt: int = 1,
                            timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (job_id, attempt) not in self.finished:
            assert time.monotonic() < deadline, f"no finish report for {job_id}/{attempt}"
            await asyncio.sleep(0.05)
        return self.finished[(job_id, attempt)]

    def seqs(self, job_id: str) -> list[int]:
        return [a["seq"] for beat in self.heartbeats for a in beat if a["job_id"] == job_id]


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.state_dir = tmp_path / "agent"
        self.blobs = BlobStore(str(tmp_path / "blobs"))
        self.reporter = FakeReporter()
        self.runner = JobRunner(str(self.state_dir), self.blobs, self.reporter, heartbeat_s=0.1)

    async def wait_idle(self, timeout: float = 15.0) -> None:
        """Until no attempt is running or reporting."""
        deadline = time.monotonic() + timeout
        while self.runner.attempts():
            assert time.monotonic() < deadline, self.runner.attempts()
            await asyncio.sleep(0.05)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(tmp_path)
    await h.runner.open()
    try:
        yield h
    finally:
        await h.runner.close()


def spec(job_id: str = "job_1", attempt: int = 1, *, command: list[str] | None = None,
         gpus: tuple[int, ...] = (0, 1), timeout_s: float = 20, idle_timeout_s: float = 10,
         memory_mb: int = 4096, kill_grace_s: float = 0.5,
         **args: Scalar) -> JobSpec:
    return JobSpec(job_id=job_id, attempt=attempt, command=command or FAKEGEN_CMD,
                   args={k.replace("_", "-"): v for k, v in args.items()},
                   gpu_indices=list(gpus), gpu_type="A100-80GB", timeout_s=timeout_s,
                   idle_timeout_s=idle_timeout_s, memory_mb=memory_mb,
                   kill_grace_s=kill_grace_s, blob_prefix=f"jobs/{job_id}/{attempt}")


def outcome(facts: dict[str, Any]) -> Outcome:
    return classify(facts["exit_code"], facts["signal"], facts["killed_for"],
                    bool(facts["result"]), facts["output_tail"])


async def test_success_uploads_output_and_logs(harness: Harness) -> None:
    started = await harness.runner.start(spec(prompt="a cat", seed=7, duration=0.6,
                                              progress_interval=0.1))
    assert started["state"] == "running" and started["pid"] > 0
    facts = await harness.reporter.wait_finished("job_1")

    assert (facts["exit_code"], facts["signal"], facts["killed_for"]) == (0, None, None)
    assert outcome(facts) == Outcome.SUCCEEDED
    [video] = facts["result"]
    data = harness.blobs.get("jobs/job_1/1/output/video.mp4")
    assert video == {"name": "video.mp4", "key": "jobs/job_1/1/output/video.mp4",
                     "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    chunks = [b.key for b in harness.blobs.list("jobs/job_1/1/log")]
    assert chunks == [f"{n:08d}" for n in range(facts["log_chunks"])]
    assert len(chunks) >= 2  # heartbeats uploaded some while it ran
    log = b"".join(harness.blobs.get(f"jobs/job_1/1/log/{c}") for c in chunks).decode()
    assert "progress: 6/6" in log and log.endswith("done\n")
    assert facts["output_tail"] == log[-2000:]

    seqs = harness.reporter.seqs("job_1")
    assert seqs == list(range(1, len(seqs) + 1)) and facts["seq"] == len(seqs) + 1
    beats = [a for beat in harness.reporter.heartbeats for a in beat]
    assert all(a["gpu_ms"] % 2 == 0 for a in beats)  # two GPUs
    assert [a["gpu_ms"] for a in beats] == sorted(a["gpu_ms"] for a in beats)
    assert facts["gpu_ms"] >= beats[-1]["gpu_ms"] and facts["gpu_ms"] >= 2 * 500
    assert any(a["progress"] is not None and 0 < a["progress"] <= 1 for a in beats)
    await harness.wait_idle()
    assert not (harness.state_dir / "jobs" / "job_1-1").exists()


async def test_same_input_gives_same_video(harness: Harness) -> None:
    for job in ("job_a", "job_b"):
        await harness.runner.start(spec(job, prompt="x", seed=3, duration=0.1))
    a, b = [(await harness.reporter.wait_finished(j))["result"][0]["sha256"]
            for j in ("job_a", "job_b")]
    assert a == b


async def test_cuda_visible_devices_reaches_the_process(harness: Harness) -> None:
    await harness.runner.start(spec(gpus=(3, 5), duration=0.1))
    facts = await harness.reporter.wait_finished("job_1")
    assert "CUDA_VISIBLE_DEVICES=3,5\n" in facts["output_tail"]


async def test_environment_is_fresh(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBFLEET_CLUSTER_SECRET", "s3cret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    dump = "import json, os; print(json.dumps(dict(os.environ)))"
    await harness.runner.start(spec(command=[sys.executable, "-c", dump], gpus=(2,)))
    facts = await harness.reporter.wait_finished("job_1")
    env = json.loads(facts["output_tail"])
    workdir = str(harness.state_dir / "jobs" / "job_1-1")
    assert "s3cret" not in facts["output_tail"]
    assert {k for k in env if k.startswith("NBFLEET_")} == {
        "NBFLEET_JOB_ID", "NBFLEET_ATTEMPT", "NBFLEET_OUTPUT_DIR"}
    assert env["NBFLEET_JOB_ID"] == "job_1" and env["NBFLEET_ATTEMPT"] == "1"
    assert env["NBFLEET_OUTPUT_DIR"] == f"{workdir}/output"
    assert env["HOME"] == workdir and env["CUDA_VISIBLE_DEVICES"] == "2"
    assert set(env) <= {"PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_VISIBLE_DEVICES",
                        "NBFLEET_JOB_ID", "NBFLEET_ATTEMPT", "NBFLEET_OUTPUT_DIR"}


async def test_crash_reports_the_exit_code(harness: Harness) -> None:
    await harness.runner.start(spec(behavior="crash", exit_code=7, duration=0.4))
    facts = await harness.reporter.wait_finished("job_1")
    assert (facts["exit_code"], facts["signal"], facts["killed_for"]) == (7, None, None)
    assert facts["result"] == [] and "Segmentation fault" in facts["output_tail"]
    assert outcome(facts) == Outcome.CRASH


async def test_cuda_oom_and_no_output_are_facts_the_control_plane_classifies(
        harness: Harness) -> None:
    await harness.runner.start(spec("job_cuda", behavior="cuda-oom"))
    await harness.runner.start(spec("job_empty", behavior="no-output", duration=0.2))
    cuda = await harness.reporter.wait_finished("job_cuda")
    empty = await harness.reporter.wait_finished("job_empty")
    assert cuda["exit_code"] == 1 and outcome(cuda) == Outcome.OOM
    assert (empty["exit_code"], empty["result"]) == (0, [])
    assert outcome(empty) == Outcome.NO_OUTPUT


async def test_hang_is_killed_for_idleness(harness: Harness) -> None:
    await harness.runner.start(spec(behavior="hang", idle_timeout_s=0.6))
    facts = await harness.reporter.wait_finished("job_1")
    assert facts["killed_for"] == "idle" and facts["signal"] == signal.SIGTERM
    assert outcome(facts) == Outcome.HANG


async def test_slow_start_writing_output_is_not_idle(harness: Harness) -> None:
    """Output files growing count as activity, like printed output."""
    grow = ("import os, sys, time\nout = sys.argv[-1].split('=', 1)[1]\n"
            "for i in range(8):\n    open(os.path.join(out, 'part'), 'ab').write(b'x' * 100)\n"
            "    time.sleep(0.15)\n")
    await harness.runner.start(spec(command=[sys.executable, "-c", grow], idle_timeout_s=0.5))
    facts = await harness.reporter.wait_finished("job_1")
    assert facts["killed_for"] is None and facts["exit_code"] == 0
    assert facts["result"][0]["size"] == 800


async def test_timeout_escalates_to_sigkill_when_sigterm_is_ignored(harness: Harness) -> None:
    begun = time.monotonic()
    await harness.runner.start(spec(behavior="ignore-sigterm", progress_interval=0.05,
                                    timeout_s=1.0, kill_grace_s=0.4))
    facts = await harness.reporter.wait_finished("job_1")
    assert facts["killed_for"] == "timeout" and facts["signal"] == signal.SIGKILL
    assert outcome(facts) == Outcome.TIMED_OUT
    assert 1.3 <= time.monotonic() - begun < 5


async def test_memory_hog_is_killed_at_once(harness: Harness) -> None:
    await harness.runner.start(spec(behavior="oom", memory_mb=160, memory_step_mb=32,
                                    kill_grace_s=30))
    facts = await harness.reporter.wait_finished("job_1")
    assert facts["killed_for"] == "memory" and facts["signal"] == signal.SIGKILL
    assert outcome(facts) == Outcome.OOM


async def test_cancel_through_stop(harness: Harness) -> None:
    await harness.runner.start(spec(duration=30))
    assert harness.runner.stop("job_1", 1, "cancel", 2.0)
    facts = await harness.reporter.wait_finished("job_1")
    assert facts["killed_for"] == "cancel" and facts["signal"] == signal.SIGTERM
    assert outcome(facts) == Outcome.CANCELLED
    assert not harness.runner.stop("job_1", 1, "cancel", 2.0)  # gone: nothing to stop
    assert not harness.runner.stop("job_nope", 1, "cancel", 2.0)


async def test_preempt_through_a_heartbeat_directive(harness: Harness) -> None:
    harness.reporter.directives = [{"job_id": "job_1", "attempt": 1, "action": "stop",
                                    "reason": "preempt", "grace_s": 1.0}]
    await harness.runner.start(spec(duration=30))
    facts = await harness.reporter.wait_finished("job_1")
    assert facts["killed_for"] == "preempt" and outcome(facts) == Outcome.PREEMPTED


async def test_stale_stop_drops_the_finish_report(harness: Harness) -> None:
    started = await harness.runner.start(spec(behavior="ignore-sigterm", kill_grace_s=5))
    assert harness.runner.stop("job_1", 1, "stale", 0.2)
    await harness.wait_idle()
    await asyncio.sleep(0.3)
    assert harness.reporter.finished == {} and harness.reporter.calls == 0
    with pytest.raises(ProcessLookupError):
        os.kill(started["pid"], 0)


async def test_start_is_idempotent(harness: Harness) -> None:
    first = await harness.runner.start(spec(duration=0.5))
    again = await harness.runner.start(spec(duration=0.5))
    assert again == first and len(harness.runner.attempts()) == 1
    facts = await harness.reporter.wait_finished("job_1")
    ended = await harness.runner.start(spec(duration=0.5))
    assert ended["state"] == "ended" and ended["outcome_facts"] == facts
    await harness.wait_idle()
    assert harness.reporter.calls == 1


async def test_a_lower_attempt_is_refused_and_a_higher_one_supersedes(
        harness: Harness) -> None:
    await harness.runner.start(spec(attempt=1, duration=30))
    await harness.runner.start(spec(attempt=2, duration=0.2))
    with pytest.raises(Conflict):
        await harness.runner.start(spec(attempt=1, duration=0.2))
    facts = await harness.reporter.wait_finished("job_1", 2)
    await harness.wait_idle()
    assert facts["exit_code"] == 0 and list(harness.reporter.finished) == [("job_1", 2)]


async def test_launch_errors_are_reported(harness: Harness, tmp_path: Path) -> None:
    not_executable = tmp_path / "tool"
    not_executable.write_text("#!/bin/sh\n")
    missing = await harness.runner.start(spec("job_missing", command=[str(tmp_path / "no")]))
    denied = await harness.runner.start(spec("job_denied", command=[str(not_executable)]))
    for status in (missing, denied):
        assert status["state"] == "ended" and status["pid"] is None
        assert status["outcome_facts"]["launch_error"]
    facts = await harness.reporter.wait_finished("job_missing")
    assert "No such file" in facts["launch_error"]
    assert (facts["exit_code"], facts["signal"], facts["killed_for"]) == (None, None, None)
    assert "Permission denied" in (await harness.reporter.wait_finished("job_denied"))[
        "launch_error"]


async def test_finish_is_retried_then_dropped_when_stale(harness: Harness) -> None:
    harness.reporter.failures = 1
    await harness.runner.start(spec(duration=0.1))
    assert (await harness.reporter.wait_finished("job_1"))["exit_code"] == 0
    assert harness.reporter.calls == 2
    harness.reporter.accept = False  # 409: the control plane moved on
    await harness.runner.start(spec("job_2", duration=0.1))
    await harness.reporter.wait_finished("job_2")
    await harness.wait_idle()


async def test_symlinks_in_the_output_are_not_uploaded(harness: Harness) -> None:
    make = ("import os, sys\nout = sys.argv[-1].split('=', 1)[1]\n"
            "open(os.path.join(out, 'b.txt'), 'w').write('b')\n"
            "os.symlink('/etc/passwd', os.path.join(out, 'a.txt'))\n"
            "os.mkdir(os.path.join(out, 'sub'))\n")
    await harness.runner.start(spec(command=[sys.executable, "-c", make]))
    facts = await harness.reporter.wait_finished("job_1")
    assert [r["name"] for r in facts["result"]] == ["b.txt"]
    assert [b.key for b in harness.blobs.list("jobs/job_1/1/output")] == ["b.txt"]


async def test_shutdown_stops_running_jobs(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    await h.runner.open()
    started = await h.runner.start(spec(behavior="hang", kill_grace_s=0.2))
    await h.runner.close()
    with pytest.raises(ProcessLookupError):
        os.kill(started["pid"], 0)
    assert h.reporter.finished == {}


def test_orphans_of_a_previous_boot_are_reaped(tmp_path: Path) -> None:
    jobs = tmp_path / "agent" / "jobs"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    env = {"PATH": os.environ["PATH"], "NBFLEET_JOB_ID": "job_old", "NBFLEET_ATTEMPT": "2"}
    orphan = subprocess.Popen(sleeper, env=env, start_new_session=True)
    stranger = subprocess.Popen(sleeper, start_new_session=True)  # reused a recorded pgid
    try:
        for name, process in (("job_old-2", orphan), ("job_x-1", stranger)):
            (jobs / name).mkdir(parents=True)
            (jobs / name / "pgid").write_text(f"{process.pid}\n")
        asyncio.run(open_and_close(Harness(tmp_path).runner))
        assert orphan.wait(timeout=5) == -signal.SIGKILL
        assert stranger.poll() is None
        assert not jobs.exists()
    finally:
        for process in (orphan, stranger):
            process.kill()
            process.wait()


async def test_agent_http_contract(harness: Harness, tmp_path: Path) -> None:
    """The control plane's calls, through the agent's app (its lifespan is not run:
    the runner is the harness's)."""
    service = AgentService(AgentConfig(control_url="http://127.0.0.1:9", secret="s",
                                       state_dir=str(tmp_path / "svc"), sandbox="none"))
    service.jobs = harness.runner
    app = create_agent_app(service)
    body = {"job_id": "job_h", "attempt": 2, "command": FAKEGEN_CMD,
            "args": {"duration": 30, "prompt": "p"}, "gpu_indices": [0], "gpu_type": "A100",
            "timeout_s": 20, "idle_timeout_s": 10, "memory_mb": 4096, "kill_grace_s": 1.0,
            "blob_prefix": "jobs/job_h/2"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://agent",
                                 headers={"Authorization": "Bearer s"}) as client:
        started = await client.post("/agent/v1/jobs", json=body)
        assert started.status_code == 200 and started.json()["state"] == "running"
        assert (await client.post("/agent/v1/jobs", json=body)).json() == started.json()
        older = await client.post("/agent/v1/jobs", json={**body, "attempt": 1})
        assert older.status_code == 409
        assert older.headers["content-type"].startswith("application/problem+json")
        bad = await client.post("/agent/v1/jobs", json={**body, "job_id": "../x"})
        assert bad.status_code == 422
        [listed] = (await client.get("/agent/v1/jobs")).json()
        assert listed["job_id"] == "job_h" and listed["pid"] == started.json()["pid"]
        stop = {"attempt": 2, "reason": "cancel", "grace_s": 1.0}
        stopped = await client.post("/agent/v1/jobs/job_h/stop", json=stop)
        assert stopped.status_code == 202 and stopped.json() == {"stopping": True}
        unknown = await client.post("/agent/v1/jobs/job_z/stop", json=stop)
        assert unknown.status_code == 202 and unknown.json() == {"stopping": False}
        no_secret = await client.get("/agent/v1/jobs", headers={"Authorization": "Bearer x"})
        assert no_secret.status_code == 401
    facts = await harness.reporter.wait_finished("job_h", 2)
    assert facts["killed_for"] == "cancel"


AGENT = """
import asyncio, sys
from tests.integration.test_job_runner import Harness, spec
from pathlib import Path

async def main():
    h = Harness(Path(sys.argv[1]))
    await h.runner.open()
    print((await h.runner.start(spec(behavior="hang")))["pid"], flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_job_dies_with_an_agent_killed_by_sigkill(tmp_path: Path) -> None:
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path)],
                             stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    try:
        assert agent.stdout is not None
        job_pid = int(agent.stdout.readline())
        assert alive(job_pid)
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 5
        while alive(job_pid):
            assert time.monotonic() < deadline, "the job outlived its agent"
            time.sleep(0.05)
    finally:
        agent.kill()
        agent.wait()


async def open_and_close(runner: JobRunner) -> None:
    await runner.open()
    await runner.close()


def test_progress_lines() -> None:
    assert parse_progress(b"progress: 3/10") == 0.3
    assert parse_progress(b"PROGRESS=0.42 done") == 0.42
    assert parse_progress(b"Progress: 50%") == 0.5
    assert parse_progress(b"progress: 2/0") == 0.0
    assert parse_progress(b"progress: 7") == 1.0
    assert parse_progress(b"no news") is None


GRACEFUL = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[-1].split("=", 1)[1])
def stop(signum, frame):
    (out / "stopped.txt").write_text(f"got {signum}")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
async def test_in_the_sandbox_a_binary_gets_its_sigterm_grace_and_real_signals(
        tmp_path: Path) -> None:
    from nbfleet.agent.sandbox import open_isolation

    h = Harness(tmp_path)
    isolation = open_isolation("bwrap", [str(h.state_dir)], str(tmp_path / "sandbox"),
                               f"host_t{os.getpid()}")
    isolation.close()  # jobs get no cgroups yet
    h.runner.sandbox, h.runner.identities = isolation.sandbox, isolation.identities
    await h.runner.open()
    try:
        await h.runner.start(spec("job_term", command=[sys.executable, "-c", GRACEFUL]))
        await asyncio.sleep(1.0)
        assert h.runner.stop("job_term", 1, "cancel", 5.0)
        facts = await h.reporter.wait_finished("job_term")
        # bwrap ignored the SIGTERM; the binary handled it and wrote its file.
        assert (facts["killed_for"], facts["exit_code"]) == ("cancel", 0), facts
        await h.runner.start(spec("job_segv", command=[
            sys.executable, "-c", "import os; os.kill(os.getpid(), 11)"]))
        segv = await h.reporter.wait_finished("job_segv")
        assert (segv["exit_code"], segv["signal"]) == (None, 11)  # not bwrap's 139
        assert outcome(segv) == Outcome.CRASH
    finally:
        await h.runner.close()
