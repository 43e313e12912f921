"""The kernel's restore report on its way to the API and the notebook: every kind of
outcome (restored, changed, recomputed, lost, settings) arrives, each where it
belongs, and a report that user code in the kernel wrote badly or on purpose can
neither fail the resume nor grow without bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbfleet.agent import restore_report, statesync
from nbfleet.protocol.agent import RestoreReport, RuntimePlaced
from tests.unit.test_statesync_restore import FakeKernel

pytestmark = pytest.mark.no_db

#: A report as ``nbfleet.kernel.restore`` writes it: ``d`` came back different
#: (listed in ``changed`` and, with its reason, in ``lost``), a setting failed.
KERNEL_REPORT: dict[str, Any] = {
    "restored": ["arr", "n"],
    "changed": ["d"],
    "recomputed": ["fh"],
    "lost": [
        {"name": "d", "type": "__main__.Drifts", "status": "changed",
         "reason": "it came back different from the value saved at suspend (its digest "
                   "differs); it is loaded as it came back"},
        {"name": "sock", "type": "socket.socket", "reason": "cannot be pickled"},
        {"name": "working directory", "type": "kernel setting",
         "reason": "cannot change to /gone: [Errno 2] No such file or directory"},
    ],
    "settings": ["environment variables", "In", "Out", "execution count"],
    "imports": ["import numpy as np"],
    "bytes": 1234,
    "seconds": 0.5,
}


def write(folder: Path, body: Any) -> str:
    (folder / "restore-report.json").write_text(json.dumps(body))
    return str(folder)


def as_agent(report: dict[str, Any]) -> dict[str, Any]:
    """A report as statesync.restore() ends up with it (a cold start, no error)."""
    return {"path": "cold", "files_only": False, "error": None, **report}


def test_changed_values_and_settings_are_forwarded_each_in_its_own_list(
        tmp_path: Path) -> None:
    report = statesync._read_report(write(tmp_path, KERNEL_REPORT))
    assert report["restored"] == ["arr", "n"] and report["recomputed"] == ["fh"]
    assert report["changed"] == [{"name": "d", "type": "__main__.Drifts",
                                  "reason": KERNEL_REPORT["lost"][0]["reason"]}]
    # ``lost``: only what is not defined after the resume.
    assert report["lost"] == [{"name": "sock", "type": "socket.socket",
                               "reason": "cannot be pickled"}]
    assert report["settings"] == [
        {"name": "environment variables", "status": "restored"},
        {"name": "In", "status": "restored"}, {"name": "Out", "status": "restored"},
        {"name": "execution count", "status": "restored"},
        {"name": "working directory", "status": "lost",
         "reason": "cannot change to /gone: [Errno 2] No such file or directory"}]
    assert report["imports"] == ["import numpy as np"]
    parsed = RestoreReport.model_validate(as_agent(report))
    assert [c.name for c in parsed.changed] == ["d"]
    assert [(s.name, s.status) for s in parsed.settings][-1] == ("working directory", "lost")


def test_the_new_fields_reach_the_control_plane_as_the_agent_sent_them(
        tmp_path: Path) -> None:
    """The agent answers with the fields set (``exclude_unset``), the control plane
    keeps them so: ``changed`` and ``settings`` are among them."""
    report = as_agent(statesync._read_report(write(tmp_path, KERNEL_REPORT)))
    wire = RuntimePlaced.model_validate({"kernels": [], "restore": {"k1": report}}).model_dump(
        mode="json", exclude_unset=True)
    kept = RuntimePlaced.model_validate(wire).restore["k1"].model_dump(
        mode="json", exclude_unset=True)
    assert kept["changed"][0]["name"] == "d" and kept["settings"][0]["status"] == "restored"
    assert kept["settings"][-1] == report["settings"][-1]
    assert "reason" not in kept["settings"][0]  # a restored setting has none


def test_a_report_from_an_older_agent_still_parses() -> None:
    old = {"path": "warm", "restored": ["a"], "recomputed": [], "files_only": False,
           "error": None, "lost": [{"name": "d", "type": "t", "reason": "r"}]}
    parsed = RestoreReport.model_validate(old)
    assert parsed.changed == [] and parsed.settings == []
    assert parsed.model_dump(mode="json", exclude_unset=True) == old


def test_a_name_never_counts_as_both_restored_and_changed(tmp_path: Path) -> None:
    body = {"restored": ["a", "b"], "changed": ["b", "c"], "lost": []}
    report = statesync._read_report(write(tmp_path, body))
    assert report["restored"] == ["a"]
    # Changed names without a reason in ``lost`` get the kernel's own words.
    assert report["changed"] == [
        {"name": n, "type": "?", "reason": restore_report.DIFFERS} for n in ("b", "c")]


@pytest.mark.parametrize("body", [[], "restored", 7, None, True])
def test_a_report_that_is_not_an_object_is_unusable_not_a_crash(
        tmp_path: Path, body: Any) -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        statesync._read_report(write(tmp_path, body))


def test_a_report_nested_past_the_parser_is_unusable_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "restore-report.json").write_text('{"lost": ' + "[" * 200_000 + "]" * 200_000
                                                  + "}")
    with pytest.raises(ValueError, match="nested too deeply"):
        statesync._read_report(str(tmp_path))


def test_a_report_over_the_limit_is_not_read(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statesync, "REPORT_LIMIT", 100)
    with pytest.raises(ValueError, match="too large"):
        statesync._read_report(write(tmp_path, {"restored": ["x" * 200]}))


def test_entries_of_the_wrong_type_are_dropped_or_coerced(tmp_path: Path) -> None:
    body = {
        "restored": ["ok", 5, None, ["nested"], {"name": "x"}, "", "also"],
        "changed": {"d": "not a list"},
        "recomputed": "fh",
        "lost": [
            "sock", 3, None, [], {"type": "t", "reason": "no name"},
            {"name": 42, "type": "t", "reason": "a number for a name"},
            {"name": ["x"], "type": "t", "reason": "a list for a name"},
            {"name": "g", "type": 7, "reason": {"why": 1}, "status": ["changed"]},
            {"name": "e"},
            {"name": "s", "type": "kernel setting", "reason": None},
        ],
        "settings": ["cwd", 1, None, {"name": "x"}],
        "imports": "import os",
    }
    report = statesync._read_report(write(tmp_path, body))
    assert report == {
        "restored": ["ok", "also"], "changed": [], "recomputed": [],
        "lost": [{"name": "g", "type": "?", "reason": "no reason was given"},
                 {"name": "e", "type": "?", "reason": "no reason was given"}],
        "settings": [{"name": "cwd", "status": "restored"},
                     {"name": "s", "status": "lost", "reason": "no reason was given"}],
        "imports": []}
    RestoreReport.model_validate(as_agent(report))
    assert "Not restored: g (?): no reason was given." in restore_report.describe(as_agent(report))


def test_lists_and_strings_are_cut_to_size(tmp_path: Path) -> None:
    many = restore_report.REPORT_ENTRIES * 3
    body = {
        "restored": [f"v{i}" for i in range(many)],
        "changed": [f"c{i}" for i in range(many)],
        "recomputed": ["r" * 100_000],
        "lost": [{"name": "l", "type": "t" * 100_000, "reason": "why " * 100_000},
                 *({"name": f"l{i}", "type": "t", "reason": "r"} for i in range(many))],
        "settings": [f"s{i}" for i in range(many)],
        "imports": ["import " + "m" * 100_000],
    }
    report = statesync._read_report(write(tmp_path, body))
    for key in ("restored", "changed", "lost", "settings"):
        assert len(report[key]) == restore_report.REPORT_ENTRIES, key
    assert len(report["recomputed"][0]) == restore_report.NAME_CHARS
    assert len(report["imports"][0]) == restore_report.TEXT_CHARS
    assert len(report["lost"][0]["type"]) == restore_report.NAME_CHARS
    assert len(report["lost"][0]["reason"]) == restore_report.TEXT_CHARS
    message = restore_report.describe(as_agent(report))
    assert len(message) < 60_000 and message.count("\n") < 4 * restore_report.DESCRIBE_ENTRIES
    assert f"{restore_report.REPORT_ENTRIES - restore_report.DESCRIBE_ENTRIES} more" in message


def test_control_characters_cannot_forge_lines_in_the_notebook(tmp_path: Path) -> None:
    body = {"lost": [{"name": "x\n[nbfleet] Resumed: restored 999 variables",
                      "type": "t\x1b[2J", "reason": "r\r\n"}]}
    report = statesync._read_report(write(tmp_path, body))
    [lost] = report["lost"]
    assert all(text.isprintable() for text in lost.values())
    message = restore_report.describe(as_agent(report))
    assert message.count("\n") == 2 and message.startswith("[nbfleet] Resumed: restored 0 ")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
ENTRY = st.dictionaries(st.sampled_from(["name", "type", "reason", "status"]),
                        JSON | st.sampled_from(["changed", "kernel setting", "x"]), max_size=4)
REPORT = st.dictionaries(
    st.sampled_from(["restored", "changed", "recomputed", "lost", "settings", "imports"]),
    JSON | st.lists(JSON | ENTRY, max_size=6))


@settings(max_examples=200, deadline=None)
@given(REPORT)
def test_any_json_object_gives_a_report_the_protocol_accepts(body: dict[str, Any]) -> None:
    report = as_agent(restore_report.clean_report(body))
    RuntimePlaced.model_validate({"kernels": [], "restore": {"k1": report}})
    restore_report.describe(report)
    assert not set(report["restored"]) & {item["name"] for item in report["changed"]}


def test_a_hostile_report_leaves_the_resume_going(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through restore() itself: the kernel's values are kept, the notebook is told."""
    monkeypatch.setattr(statesync, "_install", lambda *args: 10)  # no store: the report only
    write(tmp_path, {"restored": ["a", 1], "changed": [None, "b"],
                     "lost": [{"name": {"x": 1}}, {"name": "c", "type": "t", "reason": "r"}],
                     "settings": "all of them"})
    kernel = FakeKernel(tmp_path, stops=True, reply={"status": "ok"})
    report = asyncio.run(statesync.restore(None, "ws", kernel, "key",  # type: ignore[arg-type]
                                           "cold"))
    assert report["files_only"] is False and report["restored"] == ["a"]
    assert [item["name"] for item in report["changed"]] == ["b"]
    assert report["settings"] == [] and [item["name"] for item in report["lost"]] == ["c"]
    RestoreReport.model_validate(report)
    [told] = kernel.told
    assert "Changed: b (?)" in told and "Not restored: c (t): r." in told


# ------------------------------------------------------------------ describe()
def test_describe_names_changed_values_lost_values_and_lost_settings(tmp_path: Path) -> None:
    message = restore_report.describe(as_agent(statesync._read_report(write(tmp_path,
                                                                        KERNEL_REPORT))))
    lines = message.splitlines()
    assert lines[0] == ("[nbfleet] Resumed: restored 2 variables and 4 kernel settings, "
                        "recomputed fh; 1 came back changed.")
    assert lines[1] == (f"[nbfleet] Changed: d (__main__.Drifts): "
                        f"{KERNEL_REPORT['lost'][0]['reason']}.")
    assert lines[2] == "[nbfleet] Not restored: sock (socket.socket): cannot be pickled."
    assert lines[3] == ("[nbfleet] Setting not restored: working directory: cannot change "
                        "to /gone: [Errno 2] No such file or directory.")
    assert len(lines) == 4 and message.endswith("\n")


def test_describe_never_calls_a_changed_value_restored() -> None:
    report = as_agent({"restored": [], "changed": [{"name": "d", "type": "T", "reason": "r"}],
                       "recomputed": [], "lost": [], "settings": []})
    message = restore_report.describe(report)
    assert message.startswith("[nbfleet] Resumed: restored 0 variables; 1 came back changed.")
    assert "[nbfleet] Changed: d (T): r." in message and "Not restored" not in message


def test_describe_speaks_up_for_a_lost_setting_alone() -> None:
    report = as_agent({"restored": [], "recomputed": [], "lost": [], "changed": [],
                       "settings": [{"name": "random state", "status": "lost",
                                     "reason": "ValueError()"}]})
    assert restore_report.describe(report) == (
        "[nbfleet] Resumed: restored 0 variables.\n"
        "[nbfleet] Setting not restored: random state: ValueError().\n")


def test_describe_stays_quiet_when_there_was_nothing_to_restore() -> None:
    empty = as_agent({"restored": [], "changed": [], "recomputed": [], "lost": [],
                      "settings": [{"name": "In", "status": "restored"}]})
    assert restore_report.describe(empty) == ""
    # A report built before ``changed``/``settings`` existed still reads.
    assert restore_report.describe(as_agent({"restored": ["a"], "recomputed": [], "lost": []})) == (
        "[nbfleet] Resumed: restored 1 variables.\n")


def test_describe_a_files_only_resume() -> None:
    report = {"path": "cold", "files_only": True, "error": "corrupt snapshot: bad",
              "restored": [], "changed": [], "recomputed": [], "lost": [], "settings": []}
    assert restore_report.describe(report) == (
        "[nbfleet] Resumed with your files only: corrupt snapshot: bad.\n")


def test_each_name_is_in_one_list_only() -> None:
    body = {"restored": ["a", "b", "c"], "recomputed": ["b", "r"], "changed": ["c"],
            "lost": [{"name": "a", "type": "int", "reason": "x"},
                     {"name": "c", "type": "int", "reason": "y", "status": "changed"},
                     {"name": "gone", "type": "socket", "reason": "z"}]}
    report = restore_report.clean_report(body)
    assert report["restored"] == ["a", "b"]
    assert report["recomputed"] == ["r"]
    assert [entry["name"] for entry in report["changed"]] == ["c"]
    assert [entry["name"] for entry in report["lost"]] == ["gone"]
