"""GPU jobs, pure: states, how an attempt's end is classified, what happens next.

The control plane and the tests share these rules; nothing here does I/O or reads
a clock (times and random draws are arguments).

Attribution matters twice: an attempt that ended through a fault of the *binary or
its input* (crash, out of memory, hang, no output) counts towards ``max_attempts``,
the poison-input quarantine and a canary's failure rate; an attempt that ended
through a fault of the *infrastructure* (a lost host, a launch failure) is retried
on another host without charging the job or the binary for it, up to a separate
cap, so killing an agent never dead-letters a healthy job.

A third party can be at fault: the rollout. A binary failure of an unpinned job
on a canary (the platform chose that version for it) is not charged to the job
while the canary is live, and never once the canary is rolled back; the job is
retried at once on the stable version. It becomes the job's only if the canary
is promoted (``charge``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import signal as signals
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from nbfleet.model.errors import InvalidInput


class JobState(StrEnum):
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    DEAD_LETTERED = "dead_lettered"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.TIMED_OUT,
                      JobState.CANCELLED, JobState.DEAD_LETTERED})
#: States in which an attempt holds GPUs on a host.
PLACED = frozenset({JobState.SCHEDULED, JobState.RUNNING})


class Outcome(StrEnum):
    """How one attempt ended."""

    SUCCEEDED = "succeeded"
    CRASH = "crash"            # non-zero exit, or killed by a signal nbfleet did not send
    OOM = "oom"                # out of host or GPU memory
    HANG = "hang"              # no output or progress for idle_timeout_s
    NO_OUTPUT = "no_output"    # exit 0 without writing a result file
    TIMED_OUT = "timed_out"    # ran past timeout_s
    LOST = "lost"              # the host stopped reporting it (missed heartbeats, restart)
    LAUNCH_FAILED = "launch_failed"  # the agent could not start it
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"


class Blame(StrEnum):
    BINARY = "binary"
    INFRA = "infra"
    NONE = "none"


BLAME: Mapping[Outcome, Blame] = {
    Outcome.SUCCEEDED: Blame.NONE, Outcome.CANCELLED: Blame.NONE,
    Outcome.PREEMPTED: Blame.NONE, Outcome.TIMED_OUT: Blame.BINARY,
    Outcome.CRASH: Blame.BINARY, Outcome.OOM: Blame.BINARY, Outcome.HANG: Blame.BINARY,
    Outcome.NO_OUTPUT: Blame.BINARY, Outcome.LOST: Blame.INFRA,
    Outcome.LAUNCH_FAILED: Blame.INFRA,
}

#: Why the agent itself stopped a process, which decides its outcome whatever
#: the exit status says.
KILL_REASONS = ("timeout", "idle", "memory", "cancel", "preempt")
_KILLED_AS = {"timeout": Outcome.TIMED_OUT, "idle": Outcome.HANG, "memory": Outcome.OOM,
              "cancel": Outcome.CANCELLED, "preempt": Outcome.PREEMPTED}

#: Lines a binary prints when it runs out of memory (CUDA, PyTorch, Python, C++).
_OOM_TEXT = re.compile(
    r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|MemoryError|std::bad_alloc|OutOfMemoryError",
    re.IGNORECASE)


def classify(exit_code: int | None, signal: int | None, killed_for: str | None,
             has_output: bool, output_tail: str = "") -> Outcome:
    """An attempt's outcome from how its process ended.

    ``exit_code`` is the status of a normal exit, ``signal`` the signal that
    ended it (one of them is None). ``killed_for`` is the agent's reason when it
    sent the kill itself. A SIGKILL nobody on our side sent is the kernel's OOM
    killer's signature; so are the out-of-memory messages binaries print.
    """
    if killed_for is not None:
        if killed_for not in _KILLED_AS:
            raise InvalidInput(f"unknown kill reason {killed_for!r}")
        return _KILLED_AS[killed_for]
    if signal is not None:
        return Outcome.OOM if signal == signals.SIGKILL else Outcome.CRASH
    if exit_code == 0:
        return Outcome.SUCCEEDED if has_output else Outcome.NO_OUTPUT
    if exit_code == 137 or _OOM_TEXT.search(output_tail):
        return Outcome.OOM
    return Outcome.CRASH


class VersionState(StrEnum):
    """A binary version's place in its rollout."""

    STABLE = "stable"
    CANARY = "canary"
    ROLLED_BACK = "rolled_back"
    RETIRED = "retired"


class Charge(StrEnum):
    """Whose an ended attempt is, as ``max_attempts`` and the quarantine count it."""

    JOB = "job"
    #: A binary failure on a live canary the job was routed to: not counted unless
    #: the canary is promoted.
    CANARY = "canary"
    #: A binary failure on a canary that was rolled back: never counted.
    ROLLED_BACK = "rolled_back"


def charge(outcome: Outcome, pinned: bool, version: VersionState | str | None,
           has_stable: bool) -> Charge:
    """Who pays for an ended attempt with the attempts budget, given the state its
    version is in *now* (so a promotion or a rollback decides it after the fact).

    Only binary failures of unpinned jobs are ever taken off the job: a pinned job
    chose its version, and infrastructure failures have their own cap. A version
    is a canary or rolled back only if it was a canary when the attempt ran (a
    stable version is never made a canary), so the state now says where it ran.
    With no stable version to fall back to, the failure is the job's: a retry
    would run the same version again.
    """
    if pinned or not has_stable or BLAME[outcome] != Blame.BINARY:
        return Charge.JOB
    if version == VersionState.CANARY:
        return Charge.CANARY
    if version == VersionState.ROLLED_BACK:
        return Charge.ROLLED_BACK
    return Charge.JOB


@dataclass(frozen=True, slots=True)
class AttemptEnd:
    """One finished attempt, as the next-step rule sees it."""

    outcome: Outcome
    host_id: str | None
    charge: Charge = Charge.JOB


@dataclass(frozen=True, slots=True)
class RetryRules:
    backoff_base_s: float = 2.0
    backoff_cap_s: float = 300.0
    #: Infrastructure failures retried before the job gives up, apart from max_attempts.
    max_infra_retries: int = 5
    #: Binary failures on this many distinct hosts quarantine the input.
    poison_hosts: int = 2

    def __post_init__(self) -> None:
        if not (0 <= self.backoff_base_s <= self.backoff_cap_s
                and math.isfinite(self.backoff_cap_s)):
            raise InvalidInput("backoff must satisfy 0 <= base <= cap")
        if self.max_infra_retries < 0 or self.poison_hosts < 1:
            raise InvalidInput("max_infra_retries must be >= 0 and poison_hosts >= 1")


class Next(StrEnum):
    DONE = "done"           # terminal; the state says which
    RETRY = "retry"         # back to the queue after a backoff
    REQUEUE = "requeue"     # back to the queue now (preempted)
    FALL_BACK = "fall_back"  # back to the queue now, on the stable version (a canary failed)


@dataclass(frozen=True, slots=True)
class Verdict:
    next: Next
    state: JobState
    reason: str
    #: Seconds to wait before the retry may be dispatched (RETRY only).
    delay_s: float = 0.0
    quarantined: bool = False


def retry_delay_s(failures: int, rules: RetryRules, jitter: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^(n-1))].

    ``jitter`` is a draw from [0, 1) that the caller supplies. Full jitter spreads
    the retries of jobs that failed together (a lost host) instead of stampeding.
    """
    if not 0.0 <= jitter < 1.0:
        raise InvalidInput("jitter must be in [0, 1)")
    doublings = min(max(0, failures - 1), 64)  # past 2^64 the cap has long applied
    ceiling = min(rules.backoff_cap_s, rules.backoff_base_s * 2.0 ** doublings)
    return ceiling * jitter


def counts(history: Iterable[AttemptEnd]) -> tuple[int, int]:
    """(binary failures, infrastructure failures) in an attempt history. Failures
    the rollout is charged with are neither."""
    binary = infra = 0
    for end in history:
        blame = BLAME[end.outcome]
        binary += blame == Blame.BINARY and end.charge == Charge.JOB
        infra += blame == Blame.INFRA
    return binary, infra


def poison_hosts(history: Iterable[AttemptEnd]) -> set[str]:
    """The distinct hosts on which the binary failed this input (on a version the
    job is charged for: a crashing canary says nothing about the input)."""
    return {end.host_id for end in history
            if BLAME[end.outcome] == Blame.BINARY and end.charge == Charge.JOB
            and end.host_id is not None}


def after_attempt(history: Sequence[AttemptEnd], max_attempts: int, *,
                  cancel_requested: bool, rules: RetryRules, jitter: float) -> Verdict:
    """What the job does once the last attempt in ``history`` has ended."""
    last = history[-1]
    outcome = last.outcome
    if outcome == Outcome.SUCCEEDED:
        # A cancel that arrives as the work completes loses the race: the result
        # exists and was paid for, so it is kept.
        return Verdict(Next.DONE, JobState.SUCCEEDED, "succeeded")
    if cancel_requested or outcome == Outcome.CANCELLED:
        return Verdict(Next.DONE, JobState.CANCELLED, "cancelled")
    if outcome == Outcome.PREEMPTED:
        return Verdict(Next.REQUEUE, JobState.QUEUED, "preempted")
    if last.charge != Charge.JOB:
        # Checked before the timeout: a canary that runs slower is the canary's fault.
        where = "a canary" if last.charge == Charge.CANARY else "a rolled-back canary"
        return Verdict(Next.FALL_BACK, JobState.QUEUED,
                       f"{outcome} on {where}, not counted: retried on the stable version")
    if outcome == Outcome.TIMED_OUT:
        return Verdict(Next.DONE, JobState.TIMED_OUT, f"ran past its timeout (attempt "
                       f"{len(history)})")
    binary, infra = counts(history)
    if BLAME[outcome] == Blame.INFRA:
        if infra > rules.max_infra_retries:
            return Verdict(Next.DONE, JobState.DEAD_LETTERED,
                           f"{infra} infrastructure failures (last: {outcome})")
        return Verdict(Next.RETRY, JobState.QUEUED, str(outcome),
                       retry_delay_s(infra, rules, jitter))
    hosts = poison_hosts(history)
    if len(hosts) >= rules.poison_hosts and binary < max_attempts:
        return Verdict(Next.DONE, JobState.DEAD_LETTERED,
                       f"quarantined: the input failed on {len(hosts)} hosts "
                       f"(last: {outcome})", quarantined=True)
    if binary >= max_attempts:
        return Verdict(Next.DONE, JobState.DEAD_LETTERED,
                       f"{binary} of {max_attempts} attempts failed (last: {outcome})")
    return Verdict(Next.RETRY, JobState.QUEUED, str(outcome),
                   retry_delay_s(binary, rules, jitter))


# ------------------------------------------------------------------ arguments

_ARG_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
MAX_ARGS_BYTES = 16384
Scalar = str | int | float | bool


def check_args(args: Mapping[str, object]) -> dict[str, Scalar]:
    """Arguments become ``--name=value`` flags: names are plain, values scalar."""
    clean: dict[str, Scalar] = {}
    for name, value in args.items():
        if not _ARG_NAME.fullmatch(name):
            raise InvalidInput(f"argument name {name!r} must be lower-case letters, digits, "
                               "'-' or '_', starting with a letter", field="args")
        if name in ("output-dir", "output_dir"):
            raise InvalidInput("argument 'output-dir' is set by nbfleet", field="args")
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput(f"argument {name!r} must be finite", field="args")
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidInput(f"argument {name!r} must be a string, number or boolean",
                               field="args")
        if isinstance(value, str) and "\x00" in value:
            raise InvalidInput(f"argument {name!r} contains NUL", field="args")
        clean[name] = value
    if len(json.dumps(clean)) > MAX_ARGS_BYTES:
        raise InvalidInput(f"arguments exceed {MAX_ARGS_BYTES} bytes", field="args")
    return clean


def argv(command: Sequence[str], args: Mapping[str, Scalar], output_dir: str) -> list[str]:
    """The command line: the binary's command, then ``--name=value`` per argument
    in name order, then ``--output-dir=DIR``. Booleans are bare flags when true.

    One word per flag, with ``=``: a value is then never taken for an option of
    its own (a prompt of ``--output-dir=/etc`` stays the prompt's text), as both
    getopt and argparse read ``--name=value`` whole.
    """
    line = list(command)
    for name in sorted(args):
        value = args[name]
        if value is True:
            line.append(f"--{name}")
        elif value is not False:
            line.append(f"--{name}={value}")
    return [*line, f"--output-dir={output_dir}"]


def input_fingerprint(project_id: str, binary: str, version: str,
                      args: Mapping[str, Scalar]) -> str:
    """The identity of an input, for the poison quarantine. The project is part of
    it, so one tenant's quarantine never tells another what it submitted."""
    blob = json.dumps([project_id, binary, version, dict(sorted(args.items()))],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# --------------------------------------------------------------------- rollout

def canary_bucket(job_id: str) -> int:
    """A stable number in [0, 100) per job, so routing is reproducible."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:4], "big") % 100


def routes_to_canary(job_id: str, canary_percent: int) -> bool:
    return canary_bucket(job_id) < canary_percent


@dataclass(frozen=True, slots=True)
class CanaryRule:
    #: Roll back once binary-attributable failures exceed this share of attempts...
    failure_threshold: float = 0.5
    #: ...counted over at least this many attempts that were not infrastructure failures.
    min_samples: int = 5

    def __post_init__(self) -> None:
        if not 0.0 <= self.failure_threshold <= 1.0:
            raise InvalidInput("failure_threshold must be between 0 and 1")
        if self.min_samples < 1:
            raise InvalidInput("min_samples must be at least 1")


def should_roll_back(rule: CanaryRule, attempts: int, binary_failures: int) -> bool:
    """``attempts`` excludes infrastructure failures: a flaky host must not roll
    back a good version."""
    return attempts >= rule.min_samples and binary_failures / attempts > rule.failure_threshold


# ---------------------------------------------------------------------- tiers

def parse_tiers(spec: str) -> dict[str, int]:
    """``"free=0,paid=10"``: tier name to priority (higher goes first)."""
    tiers: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, raw = part.partition("=")
        if not sep or not _ARG_NAME.fullmatch(name.strip()):
            raise InvalidInput(f"invalid tier {part!r}: expected NAME=PRIORITY, e.g. paid=10")
        if name.strip() in tiers:
            raise InvalidInput(f"tier {name.strip()!r} is named twice")
        try:
            tiers[name.strip()] = int(raw)
        except ValueError as exc:
            raise InvalidInput(f"invalid tier {part!r}: priority must be an integer") from exc
    if not tiers:
        raise InvalidInput("at least one tier is needed")
    return tiers
