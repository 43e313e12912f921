"""nbfleet's own session trace format, in JSONL or CSV (chosen by file extension).

JSONL holds one session per line::

    {"id": "s1", "start_s": 0, "end_s": 3600, "gpus": 2, "vram_gb": 40,
     "gpu_types": ["H100-80GB"], "tasks": [{"submit_s": 60, "duration_s": 120, "gpus": 1}]}

``vram_gb`` (a floor per GPU, default 0), ``gpu_types`` (ordered preferences, default
any) and a task's ``gpus`` (default: the session's) are optional. Blank lines are
skipped.

CSV holds one row per task; the session columns repeat on each of its rows and must
agree::

    session_id,session_start_s,session_end_s,session_gpus,task_submit_s,task_duration_s,task_gpus

Optional columns ``session_vram_gb`` and ``session_gpu_types`` (types separated by
``;``) may follow. A row with empty task fields declares a session without tasks; an
empty ``task_gpus`` means the session's GPU count. Tasks may come in any order; the
readers sort them by submit time. Every error names the file and line.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from nbfleet.sim.traces._fields import (
    Where,
    csv_rows,
    open_text,
    parse_float,
    parse_int,
    require,
)
from nbfleet.sim.traces.model import Session, Task, Trace, TraceError, task_problem

CSV_COLUMNS = (
    "session_id", "session_start_s", "session_end_s", "session_gpus",
    "task_submit_s", "task_duration_s", "task_gpus",
)
_CSV_OPTIONAL = ("session_vram_gb", "session_gpu_types")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def read_native(path: str | Path) -> Trace:
    """Read a native trace; ``.jsonl``/``.ndjson`` or ``.csv`` decides the format."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return read_jsonl(path)
    if suffix == ".csv":
        return read_csv(path)
    raise TraceError("unknown native trace format: expected a .jsonl, .ndjson or .csv file",
                     path)


def _gpu_types(where: Where, raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(t, str) and t for t in raw):
        raise where.error(f"gpu_types: expected a list of type names, got {raw!r}")
    return tuple(raw)


def _session_from_json(where: Where, record: dict[str, Any]) -> Session:
    raw_id = require(where, record, "id")
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        raise where.error(f"id: expected a string, got {raw_id!r}")
    start = parse_float(where, "start_s", require(where, record, "start_s"))
    end = parse_float(where, "end_s", require(where, record, "end_s"))
    gpus = parse_int(where, "gpus", require(where, record, "gpus"))
    vram = parse_float(where, "vram_gb", record.get("vram_gb", 0.0))
    types = _gpu_types(where, record.get("gpu_types"))
    raw_tasks = record.get("tasks", [])
    if not isinstance(raw_tasks, list):
        raise where.error(f"tasks: expected a list, got {raw_tasks!r}")
    tasks: list[Task] = []
    for index, raw in enumerate(raw_tasks):
        label = f"tasks[{index}]"
        if not isinstance(raw, dict):
            raise where.error(f"{label}: expected an object, got {raw!r}")
        submit = parse_float(where, f"{label}.submit_s", require(where, raw, "submit_s"))
        duration = parse_float(where, f"{label}.duration_s",
                               require(where, raw, "duration_s"))
        task_gpus = parse_int(where, f"{label}.gpus", raw.get("gpus", gpus))
        task = where.guard(partial(Task, submit, duration, task_gpus), label)
        problem = task_problem(task, start, end, gpus)
        if problem is not None:
            raise where.error(f"{label}: {problem}")
        tasks.append(task)
    tasks.sort(key=lambda t: t.submit_s)
    return where.guard(partial(Session, str(raw_id), start, end, gpus, vram, types,
                               tuple(tasks)))


def read_jsonl(path: str | Path) -> Trace:
    """Read one session per line; see the module docstring for the fields."""
    path = Path(path)
    sessions: list[Session] = []
    seen: dict[str, int] = {}
    with open_text(path) as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            where = Where(path, number)
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise where.error(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(record, dict):
                raise where.error("expected a JSON object describing one session")
            session = _session_from_json(where, record)
            if session.id in seen:
                raise where.error(f"duplicate session id {session.id!r} "
                                  f"(first on line {seen[session.id]})")
            seen[session.id] = number
            sessions.append(session)
    return Trace.of(sessions, path.stem)


@dataclass
class _CsvSession:
    line: int
    start_s: float
    end_s: float
    gpus: int
    vram_gb: float
    gpu_types: tuple[str, ...]
    tasks: list[Task] = field(default_factory=list)


def read_csv(path: str | Path) -> Trace:
    """Read one task per row; see the module docstring for the columns."""
    path = Path(path)
    sessions: dict[str, _CsvSession] = {}
    for where, row in csv_rows(path, CSV_COLUMNS):
        sid = str(require(where, row, "session_id"))
        start = parse_float(where, "session_start_s", require(where, row, "session_start_s"))
        end = parse_float(where, "session_end_s", require(where, row, "session_end_s"))
        gpus = parse_int(where, "session_gpus", require(where, row, "session_gpus"))
        vram = parse_float(where, "session_vram_gb", row.get("session_vram_gb") or 0.0)
        types_raw = row.get("session_gpu_types") or ""
        types = tuple(t.strip() for t in types_raw.split(";") if t.strip())
        known = sessions.get(sid)
        if known is None:
            known = _CsvSession(where.line, start, end, gpus, vram, types)
            sessions[sid] = known
        elif (known.start_s, known.end_s, known.gpus, known.vram_gb, known.gpu_types) != (
                start, end, gpus, vram, types):
            raise where.error(f"session {sid!r}: its columns differ from line {known.line}")
        task = _csv_task(where, row, known)
        if task is not None:
            known.tasks.append(task)
    built: list[Session] = []
    for sid, known in sessions.items():
        known.tasks.sort(key=lambda t: t.submit_s)
        where = Where(path, known.line)
        built.append(where.guard(partial(
            Session, sid, known.start_s, known.end_s, known.gpus, known.vram_gb,
            known.gpu_types, tuple(known.tasks))))
    return Trace.of(built, path.stem)


def _csv_task(where: Where, row: dict[str, str], session: _CsvSession) -> Task | None:
    submit_raw, duration_raw = row.get("task_submit_s"), row.get("task_duration_s")
    if not submit_raw and not duration_raw:
        return None
    submit = parse_float(where, "task_submit_s", require(where, row, "task_submit_s"))
    duration = parse_float(where, "task_duration_s", require(where, row, "task_duration_s"))
    gpus_raw = row.get("task_gpus")
    gpus = parse_int(where, "task_gpus", gpus_raw) if gpus_raw else session.gpus
    task = where.guard(partial(Task, submit, duration, gpus))
    problem = task_problem(task, session.start_s, session.end_s, session.gpus)
    if problem is not None:
        raise where.error(problem)
    return task


def _session_json(session: Session) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": session.id, "start_s": session.start_s, "end_s": session.end_s,
        "gpus": session.gpus,
    }
    if session.vram_gb:
        record["vram_gb"] = session.vram_gb
    if session.gpu_types:
        record["gpu_types"] = list(session.gpu_types)
    record["tasks"] = [
        {"submit_s": t.submit_s, "duration_s": t.duration_s, "gpus": t.gpus}
        for t in session.tasks
    ]
    return record


def write_jsonl(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` so that ``read_jsonl`` gives it back exactly (floats keep repr)."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for session in trace.sessions:
            handle.write(json.dumps(_session_json(session), separators=(",", ":")) + "\n")


def write_csv(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` one task per row (a task-less session gets one row with empty tasks)."""
    with Path(path).open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS + _CSV_OPTIONAL)
        for s in trace.sessions:
            head = [s.id, repr(s.start_s), repr(s.end_s), s.gpus]
            tail = [repr(s.vram_gb), ";".join(s.gpu_types)]
            if not s.tasks:
                writer.writerow([*head, "", "", "", *tail])
            for t in s.tasks:
                writer.writerow([*head, repr(t.submit_s), repr(t.duration_s), t.gpus, *tail])
