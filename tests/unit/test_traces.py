"""Trace model, native JSONL/CSV and Tiresias readers: round trips, sessions, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbfleet.sim.traces import (
    Session,
    Task,
    Trace,
    TraceError,
    load_trace,
    read_csv,
    read_jsonl,
    read_native,
    read_tiresias,
    sensei,
    write_csv,
    write_jsonl,
)

DATA = Path(__file__).parent / "data" / "traces"
TIRESIAS_HEADER = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
NATIVE_HEADER = ("session_id,session_start_s,session_end_s,session_gpus,"
                 "task_submit_s,task_duration_s,task_gpus\n")


# --- model -------------------------------------------------------------------------


def test_session_helpers() -> None:
    s = Session("s", 100.0, 1100.0, 2, tasks=(Task(100.0, 50.0, 2), Task(400.0, 50.0, 1)))
    assert s.duration_s == 1000.0
    assert s.busy_share == pytest.approx(0.1)
    assert s.think_times() == [250.0]
    assert s.inter_arrivals() == [300.0]
    trace = Trace.of([Session("b", 50.0, 60.0, 1), s], "t")
    assert [x.id for x in trace.sessions] == ["b", "s"]
    assert trace.task_count == 2
    assert trace.duration_s == 1050.0
    assert trace.reserved_gpu_hours() == pytest.approx((10 + 2000) / 3600)
    assert trace.busy_gpu_hours() == pytest.approx(150 / 3600)


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: Task(0.0, -1.0, 1), "duration_s must not be negative"),
        (lambda: Task(float("nan"), 1.0, 1), "finite"),
        (lambda: Session("s", 10.0, 5.0, 1), "before it starts"),
        (lambda: Session("s", 0.0, 5.0, 1, tasks=(Task(4.0, 2.0, 1),)), "after its session"),
        (lambda: Session("s", 1.0, 5.0, 1, tasks=(Task(0.5, 1.0, 1),)), "before its session"),
        (lambda: Session("s", 0.0, 9.0, 1, tasks=(Task(0.0, 1.0, 2),)), "asks for 2 GPUs"),
        (lambda: Session("s", 0.0, 9.0, 1, tasks=(Task(5.0, 1.0, 1), Task(1.0, 1.0, 1))),
         "sorted"),
        (lambda: Trace((Session("a", 0.0, 1.0, 1), Session("a", 2.0, 3.0, 1))), "duplicate"),
        (lambda: Trace((Session("b", 5.0, 6.0, 1), Session("a", 0.0, 1.0, 1))), "sorted"),
    ],
)
def test_model_rejects_broken_invariants(build: object, fragment: str) -> None:
    with pytest.raises(TraceError, match=fragment):
        build()  # type: ignore[operator]


# --- native ------------------------------------------------------------------------


def test_jsonl_fixture_reads_with_defaults() -> None:
    trace = read_jsonl(DATA / "native_small.jsonl")
    assert trace.name == "native_small"
    alice, carol, bob = trace.sessions  # sorted by start: 0, 30, 120.5
    assert (alice.id, carol.id, bob.id) == ("alice", "carol", "bob")
    assert alice.vram_gb == 40.0 and alice.gpu_types == ("H100-80GB", "A100-80GB")
    # tasks sorted by submit; a task without gpus takes the session's count
    assert alice.tasks == (Task(60.0, 30.0, 2), Task(600.0, 120.0, 1))
    assert bob.tasks == () and bob.start_s == 120.5
    assert trace.task_count == 3


def test_csv_fixture_matches_jsonl_fixture() -> None:
    from_csv = read_native(DATA / "native_small.csv")
    from_jsonl = read_native(DATA / "native_small.jsonl")
    assert from_csv.sessions == from_jsonl.sessions


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trace = sensei(3.0, seed=11, sessions_per_hour=40)
    assert trace.task_count > 0
    write_jsonl(trace, tmp_path / "t.jsonl")
    again = read_jsonl(tmp_path / "t.jsonl")
    assert again.sessions == trace.sessions


def test_csv_round_trip_keeps_taskless_sessions(tmp_path: Path) -> None:
    trace = read_jsonl(DATA / "native_small.jsonl")
    write_csv(trace, tmp_path / "t.csv")
    assert read_csv(tmp_path / "t.csv").sessions == trace.sessions
    synthetic = sensei(2.0, seed=5, sessions_per_hour=30)
    write_csv(synthetic, tmp_path / "s.csv")
    assert read_csv(tmp_path / "s.csv").sessions == synthetic.sessions


def test_unknown_extension_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.txt"
    path.write_text("{}\n")
    with pytest.raises(TraceError, match=r"trace\.txt: unknown native trace format"):
        read_native(path)


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.jsonl: cannot read"):
        read_native(tmp_path / "nope.jsonl")


GOOD = '{"id": "ok", "start_s": 0, "end_s": 100, "gpus": 1, "tasks": []}'


@pytest.mark.parametrize(
    ("lines", "line", "fragment"),
    [
        ([GOOD, '{"id": "x", "start_s": "abc", "end_s": 9, "gpus": 1}'], 2,
         "start_s: expected a number"),
        ([GOOD, GOOD.replace('"ok"', '"b"'), '{"id": "x", '], 3, "invalid JSON"),
        (['{"id": "x", "start_s": 0, "gpus": 1}'], 1, "missing end_s"),
        ([GOOD, '{"id": "x", "start_s": 0, "end_s": 9, "gpus": 1,'
                ' "tasks": [{"submit_s": 1, "duration_s": -3}]}'], 2,
         r"tasks\[0\]: task duration_s must not be negative"),
        (['{"id": "x", "start_s": 0, "end_s": 9, "gpus": 1,'
          ' "tasks": [{"submit_s": 1, "duration_s": 2}, {"submit_s": 5, "duration_s": 7}]}'], 1,
         r"tasks\[1\]: task ends at 12.0 s, after its session ends"),
        (['{"id": "x", "start_s": 0, "end_s": 9, "gpus": 1,'
          ' "tasks": [{"submit_s": 1, "duration_s": 2, "gpus": 4}]}'], 1, "asks for 4 GPUs"),
        (['{"id": "x", "start_s": 0, "end_s": 9, "gpus": 1.5}'], 1, "gpus: expected a whole"),
        (['{"id": "x", "start_s": 5, "end_s": 1, "gpus": 1}'], 1, "before it starts"),
        ([GOOD, "", GOOD], 3, "duplicate session id 'ok' \\(first on line 1\\)"),
        (["[1, 2]"], 1, "expected a JSON object"),
        (['{"id": "x", "start_s": 0, "end_s": 9, "gpus": 1, "gpu_types": "A100"}'], 1,
         "gpu_types: expected a list"),
    ],
)
def test_malformed_jsonl_names_its_line(tmp_path: Path, lines: list[str], line: int,
                                        fragment: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=rf"bad\.jsonl:{line}: .*{fragment}") as info:
        read_native(path)
    assert info.value.line == line and info.value.path == str(path)


@pytest.mark.parametrize(
    ("body", "line", "fragment"),
    [
        ("s,0,100,1,10,5,1\ns,0,100,1,1O,5,1\n", 3, "task_submit_s: expected a number"),
        ("s,0,100,1,10,-5,1\n", 2, "duration_s must not be negative, got -5.0"),
        ("s,0,100,1,10,5,1\ns,0,100,1,90,20,1\n", 3, "after its session ends"),
        ("s,0,100,1,10,5,1\ns,0,200,1,90,20,1\n", 3, "its columns differ from line 2"),
        ("s,0,100,1,10,5,1,extra\n", 2, "more fields than the header"),
        ("s,,100,1,10,5,1\n", 2, "missing session_start_s"),
        ("s,0,100,1,10,,1\n", 2, "missing task_duration_s"),
        ("s,0,100,1,10,5,3\n", 2, "asks for 3 GPUs"),
    ],
)
def test_malformed_native_csv_names_its_line(tmp_path: Path, body: str, line: int,
                                             fragment: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(NATIVE_HEADER + body)
    with pytest.raises(TraceError, match=rf"bad\.csv:{line}: .*{fragment}"):
        read_csv(path)


def test_native_csv_header_problems_name_line_one(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("session_id,session_start_s\ns,0\n")
    with pytest.raises(TraceError, match=r"bad\.csv:1: header lacks column.*session_end_s"):
        read_csv(path)
    path.write_text("")
    with pytest.raises(TraceError, match=r"bad\.csv:1: empty file"):
        read_csv(path)


# --- Tiresias ----------------------------------------------------------------------


def test_tiresias_infers_sessions_where_submit_time_decreases() -> None:
    trace = read_tiresias(DATA / "tiresias_small.csv")
    # job order 1..6, submits (min) 0,5,9 | 1,3 | 2: boundaries before jobs 4 and 6.
    # Within-session submit gaps 5,4,2 min: median 4 min = 240 s idle tail.
    assert [s.id for s in trace.sessions] == ["session-1", "session-4", "session-6"]
    first, second, third = trace.sessions
    assert first.tasks == (Task(0.0, 120.0, 1), Task(300.0, 180.0, 2), Task(540.0, 60.0, 1))
    assert (first.start_s, first.end_s, first.gpus) == (0.0, 600.0 + 240.0, 2)
    assert second.tasks == (Task(60.0, 600.0, 4), Task(180.0, 120.0, 1))
    assert (second.start_s, second.end_s, second.gpus) == (60.0, 660.0 + 240.0, 4)
    assert third.tasks == (Task(120.0, 90.0, 1),)
    assert (third.start_s, third.end_s) == (120.0, 210.0 + 240.0)


def test_tiresias_per_job_makes_one_session_per_job() -> None:
    trace = read_tiresias(DATA / "tiresias_small.csv", sessions="per-job")
    assert len(trace.sessions) == trace.task_count == 6
    job4 = next(s for s in trace.sessions if s.id == "job-4")
    # no within-session gaps: the documented 300 s default tail
    assert (job4.start_s, job4.end_s, job4.gpus) == (60.0, 660.0 + 300.0, 4)


def test_tiresias_explicit_tail_and_numeric_job_order(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    # numerically 9 < 10 < 11 (as strings "10" < "11" < "9" would merge differently)
    path.write_text(TIRESIAS_HEADER + "10,1,4,1,m,1,0\n9,1,2,1,m,1,0\n11,1,3,1,m,1,0\n")
    trace = read_tiresias(path, idle_tail_s=0.0)
    assert [s.id for s in trace.sessions] == ["session-9", "session-11"]
    assert trace.sessions[0].end_s == 5 * 60.0


@pytest.mark.parametrize(
    ("body", "line", "fragment"),
    [
        ("1,1,0,1,m,2,0\n2,two,1,1,m,2,0\n", 3, "num_gpu: expected a number"),
        ("1,1,0,1,m,-2,0\n", 2, "duration must not be negative"),
        ("1,1.5,0,1,m,2,0\n", 2, "num_gpu: expected a whole number"),
        ("1,1,,1,m,2,0\n", 2, "missing submit_time"),
        ("1,1,0,1,m,2,0\n1,1,3,1,m,2,0\n", 3, "duplicate job_id '1' \\(first on line 2\\)"),
        ("1,1,0,1,m,2,0\n2,1,-1,1,m,2,0\n", 3, "submit_time must not be negative"),
        ("1,1,0,x,m,2,0\n", 2, "iterations: expected a number"),
        ("1,1,inf,1,m,2,0\n", 2, "submit_time: expected a finite number"),
    ],
)
def test_malformed_tiresias_names_its_line(tmp_path: Path, body: str, line: int,
                                           fragment: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(TIRESIAS_HEADER + body)
    with pytest.raises(TraceError, match=rf"bad\.csv:{line}: .*{fragment}"):
        read_tiresias(path)


def test_tiresias_header_and_mode_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("job_id,num_gpu,submit_time\n1,1,0\n")
    with pytest.raises(TraceError, match=r"bad\.csv:1: header lacks column.*duration"):
        read_tiresias(path)
    with pytest.raises(TraceError, match="sessions must be"):
        read_tiresias(DATA / "tiresias_small.csv", sessions="weekly")  # type: ignore[arg-type]


# --- load_trace --------------------------------------------------------------------


def test_load_trace_resolves_every_format() -> None:
    assert load_trace(str(DATA / "tiresias_small.csv")).task_count == 6  # sniffed header
    assert len(load_trace(f"tiresias:{DATA / 'tiresias_small.csv'}",
                          tiresias_sessions="per-job").sessions) == 6
    assert load_trace(str(DATA / "native_small.csv")).task_count == 3
    assert load_trace(f"native:{DATA / 'native_small.jsonl'}").task_count == 3
    assert load_trace("synthetic:sensei", hours=2.0, seed=1) == sensei(2.0, 1)
    with pytest.raises(TraceError, match="unknown synthetic trace"):
        load_trace("synthetic:philly")
