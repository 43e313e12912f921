"""Tiresias-format job traces read as notebook sessions.

Format: a CSV with header ``job_id,num_gpu,submit_time,iterations,model_name,duration,
interval``; ``submit_time`` and ``duration`` are in MINUTES and become seconds here.
``iterations``, ``model_name`` and ``interval`` are batch-training details the
session simulator does not use; they are read for validation only where numeric.

Assumptions (Tiresias traces have jobs, not sessions):

* Jobs are taken in job-id order (numerically when every id is a number, else as
  strings); a job becomes one task asking for ``num_gpu`` GPUs.
* ``sessions="infer"``: a new session begins wherever ``submit_time`` DECREASES from
  one job to the next, i.e. each run of non-decreasing submit times is one user's
  session. ``sessions="per-job"``: every job is its own session.
* A session holds the largest ``num_gpu`` of its tasks. It starts at its first task's
  submit and ends at its last task's end plus an idle tail: ``idle_tail_s`` when given,
  else the median submit-to-submit gap between consecutive tasks of the same session
  over the whole trace, else 300 s (SenseiTrace's median IAT, paper section 2.3.2) when
  no session has two tasks (always so with ``per-job``). Notebook users leave a
  kernel open after their last cell; the tail stands for that.
* Times are taken as given; a trace whose times start above zero keeps its offset.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Literal

from nbfleet.sim.traces._fields import Where, csv_rows, parse_float, parse_int, require
from nbfleet.sim.traces.model import Session, Task, Trace, TraceError

COLUMNS = ("job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration",
           "interval")
SessionMode = Literal["infer", "per-job"]
DEFAULT_TAIL_S = 300.0


@dataclass(frozen=True, slots=True)
class _Job:
    job_id: str
    line: int
    gpus: int
    submit_s: float
    duration_s: float


def read_tiresias(path: str | Path, sessions: SessionMode = "infer",
                  idle_tail_s: float | None = None) -> Trace:
    """Read a Tiresias CSV into a trace; see the module docstring for the assumptions."""
    path = Path(path)
    if sessions not in ("infer", "per-job"):
        raise TraceError(f"sessions must be 'infer' or 'per-job', got {sessions!r}", path)
    if idle_tail_s is not None and not idle_tail_s >= 0:
        raise TraceError(f"idle_tail_s must not be negative, got {idle_tail_s}", path)
    jobs = _read_jobs(path)
    groups = _group(jobs, sessions)
    tail = idle_tail_s if idle_tail_s is not None else _median_gap(groups)
    built: list[Session] = []
    for group in groups:
        first = group[0]
        tasks = tuple(sorted((Task(j.submit_s, j.duration_s, j.gpus) for j in group),
                             key=lambda t: t.submit_s))
        end = max(t.end_s for t in tasks) + tail
        prefix = "job" if sessions == "per-job" else "session"
        where = Where(path, first.line)
        built.append(where.guard(partial(Session, f"{prefix}-{first.job_id}", tasks[0].submit_s,
                                         end, max(t.gpus for t in tasks), tasks=tasks)))
    return Trace.of(built, path.stem)


def _read_jobs(path: Path) -> list[_Job]:
    jobs: list[_Job] = []
    seen: dict[str, int] = {}
    for where, row in csv_rows(path, COLUMNS):
        job_id = str(require(where, row, "job_id")).strip()
        if job_id in seen:
            raise where.error(f"duplicate job_id {job_id!r} (first on line {seen[job_id]})")
        seen[job_id] = where.line
        gpus = parse_int(where, "num_gpu", require(where, row, "num_gpu"))
        submit = parse_float(where, "submit_time", require(where, row, "submit_time"))
        duration = parse_float(where, "duration", require(where, row, "duration"))
        for optional in ("iterations", "interval"):
            if row.get(optional):
                parse_float(where, optional, row[optional])
        if gpus < 0:
            raise where.error(f"num_gpu must not be negative, got {gpus}")
        if submit < 0:
            raise where.error(f"submit_time must not be negative, got {submit}")
        if duration < 0:
            raise where.error(f"duration must not be negative, got {duration}")
        jobs.append(_Job(job_id, where.line, gpus, submit * 60.0, duration * 60.0))
    if all(_is_number(j.job_id) for j in jobs):
        jobs.sort(key=lambda j: float(j.job_id))
    else:
        jobs.sort(key=lambda j: j.job_id)
    return jobs


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _group(jobs: list[_Job], mode: SessionMode) -> list[list[_Job]]:
    if mode == "per-job":
        return [[j] for j in jobs]
    groups: list[list[_Job]] = []
    for job in jobs:
        if groups and job.submit_s >= groups[-1][-1].submit_s:
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


def _median_gap(groups: list[list[_Job]]) -> float:
    gaps = [b.submit_s - a.submit_s for g in groups for a, b in pairwise(g)]
    return statistics.median(gaps) if gaps else DEFAULT_TAIL_S
