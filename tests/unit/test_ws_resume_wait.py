"""`ws resume --wait` and `POST .../resume?wait=` tell the truth about this resume.

Issue 13: a resume that took 3 min 45 s was reported `failed` (a failed placement is
retried, so it later succeeded), and the summary printed could be an earlier
resume's. Issue 15: it still could, for a resume of a workspace already running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from nbfleet.cli import ws as ws_cli
from nbfleet.cli.client import Api
from nbfleet.control import workspaces
from nbfleet.control.routers.workspaces import resume_answer
from nbfleet.control.step_results import Work
from nbfleet.control.step_results import restore_summary as _restore_summary
from nbfleet.db.tables import Workspace
from nbfleet.model.workspace import Action, Step, WorkspaceState
from nbfleet.protocol.agent import RuntimePlaced

WS = "ws_01test"
OLD_REPORT = {"path": "warm", "restored": ["a"], "recomputed": [], "files_only": False,
              "lost": [{"name": "old_sock", "type": "socket.socket", "reason": "old"}]}
NEW_REPORT = {"path": "cold", "restored": ["a", "b"], "recomputed": ["fh"], "files_only": False,
              "lost": [{"name": "lock", "type": "_thread.lock", "reason": "writes files"}]}


def body(state: str, generation: int = 5, restore_generation: int | None = 3,
         report: dict[str, Any] | None = None, last_error: str | None = None) -> dict[str, Any]:
    restore = None if restore_generation is None else {
        "generation": restore_generation, "kernels": {"k1": report or OLD_REPORT}}
    return {"id": WS, "name": "w", "state": state, "desired_state": "running",
            "generation": generation, "host_id": None, "last_error": last_error,
            "snapshot": {"kernels": ["k1"]}, "restore": restore}


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """Runs `nbfleet ws resume WS --wait` against canned answers."""
    monkeypatch.setattr(ws_cli, "POLL_S", 0.5)

    def run(post: dict[str, Any], gets: list[dict[str, Any]]) -> Any:
        def handler(request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                return httpx.Response(200 if post["state"] == "running" else 202, json=post)
            return httpx.Response(200, json=gets.pop(0) if len(gets) > 1 else gets[0])

        def api(url: str | None = None, token: str | None = None) -> Api:
            client = Api("http://nbfleet.test", "t")
            client.http = httpx.Client(base_url="http://nbfleet.test",
                                       transport=httpx.MockTransport(handler))
            return client

        monkeypatch.setattr(ws_cli, "Api", api)
        # The consoles took their width when imported: make it wide whatever the
        # terminal that ran the tests, so no message is wrapped mid-sentence.
        from nbfleet.cli import client as client_module
        monkeypatch.setattr(client_module.err, "width", 300)
        monkeypatch.setattr(client_module.out, "width", 300)
        return CliRunner().invoke(ws_cli.app, ["resume", WS, "--wait"], env={"COLUMNS": "300"})

    yield run


def test_a_resume_still_running_when_the_wait_ends_says_so(cli: Callable[..., Any]) -> None:
    result = cli(body("resuming"), [body("failed", last_error="place failed: agent timed out")])
    assert result.exit_code == 1
    assert "still resuming after" in result.stderr
    assert "being retried" in result.stderr
    assert "old_sock" not in result.stderr and "k1" not in result.stderr


def test_failed_is_not_the_end_of_a_wait(cli: Callable[..., Any]) -> None:
    own = body("running", restore_generation=5, report=NEW_REPORT)
    result = cli(body("resuming"), [body("failed", last_error="agent timed out"), own])
    assert result.exit_code == 0, result.stderr
    assert '"state": "running"' in result.stdout
    assert "recomputed fh; not restored: lock (_thread.lock)" in result.stderr


def test_an_earlier_resumes_summary_is_never_printed(cli: Callable[..., Any]) -> None:
    result = cli(body("running", restore_generation=3), [])
    assert result.exit_code == 0
    assert "no restore report for this resume" in result.stderr
    assert "old_sock" not in result.stderr


def test_kernels_restored_by_a_lost_attempt_are_named(cli: Callable[..., Any]) -> None:
    summary = body("running", restore_generation=5)
    summary["restore"] = {"generation": 5, "kernels": {}, "unreported": ["k1"]}
    result = cli(summary, [])
    assert "kernel k1: restored by an earlier attempt whose report was lost" in result.stderr


# --------------------------------------------------------------- REST ?wait=
def row(state: str, desired: str = "running") -> Workspace:
    return Workspace(id=WS, state=state, desired_state=desired, generation=5)


@pytest.mark.parametrize(("state", "desired", "done"), [
    ("running", "running", True), ("resuming", "running", False),
    ("failed", "running", False),  # retried: a wait goes on, then answers 202
    ("suspended", "suspended", True), ("deleted", "deleted", True),
])
def test_a_wait_ends_only_when_the_change_has_run_its_course(state: str, desired: str,
                                                             done: bool) -> None:
    assert workspaces.is_done(row(state, desired)) is done


def test_the_answer_to_a_resume_carries_only_its_own_summary() -> None:
    mine = {"generation": 5, "restore": {"generation": 5, "kernels": {}}}
    assert workspaces.for_request(mine, 5) == mine
    earlier = {"generation": 5, "restore": {"generation": 3, "kernels": {"k1": OLD_REPORT}}}
    assert workspaces.for_request(earlier, 5)["restore"] is None
    legacy = {"generation": 5, "restore": {"kernels": {"k1": OLD_REPORT}}}  # before this change
    assert workspaces.for_request(legacy, 5)["restore"] is None


def test_a_resume_that_found_the_workspace_running_shows_no_summary() -> None:
    """Issue 15: a resume of a running workspace keeps its generation, so the summary
    on record (the resume that started it) matched and was shown as its own."""
    on_record = {"generation": 5, "state": "running",
                 "restore": {"generation": 5, "kernels": {"k1": OLD_REPORT}}}
    assert resume_answer(on_record, 5, found_running=True)["restore"] is None
    assert resume_answer(on_record, 5, found_running=False) == on_record
    earlier = {**on_record, "restore": {"generation": 3, "kernels": {"k1": OLD_REPORT}}}
    assert resume_answer(earlier, 5, found_running=False)["restore"] is None


def test_the_cli_says_why_a_resume_has_no_summary(cli: Callable[..., Any]) -> None:
    answer = body("running", restore_generation=None)  # as the server answers it now
    result = cli(answer, [])
    assert result.exit_code == 0
    assert "nothing was restored by it: the workspace was already running" in result.stderr
    assert "restored 1" not in result.stderr


# ---------------------------------------------------------- the reconciler
def work(snapshot: dict[str, Any] | None) -> Work:
    return Work(WS, Step(Action.PLACE, WorkspaceState.RUNNING), 7, WorkspaceState.RESUMING,
                "http://agent", (("k1", "python3"),), snapshot)


NOW = datetime(2026, 11, 25, tzinfo=UTC)


def placed(answer: dict[str, Any]) -> RuntimePlaced:
    """An agent's answer to a placement, as the control plane's client reads it."""
    return RuntimePlaced.model_validate({"kernels": [], **answer})


def test_a_placement_records_its_generation_with_what_it_restored() -> None:
    summary = _restore_summary(work({"kernels": {"k1": {"key": "x"}}}),
                               placed({"restore": {"k1": NEW_REPORT}, "packages": {}}), NOW)
    assert summary is not None
    assert summary["generation"] == 7 and summary["kernels"] == {"k1": NEW_REPORT}
    assert "unreported" not in summary


def test_a_placement_whose_report_was_lost_replaces_the_old_summary() -> None:
    """The agent already had the runtime (the first attempt's answer timed out)."""
    summary = _restore_summary(work({"kernels": {"k1": {"key": "x"}}}),
                               placed({"restore": {}, "packages": {}}), NOW)
    assert summary == {"generation": 7, "at": "2026-11-25T00:00:00Z", "kernels": {},
                       "packages": {}, "unreported": ["k1"]}


def test_a_placement_with_nothing_to_restore_records_nothing() -> None:
    assert _restore_summary(work(None), placed({"restore": {}}), NOW) is None


def test_values_that_came_back_changed_and_lost_settings_are_named(
        cli: Callable[..., Any]) -> None:
    report = {"path": "warm", "restored": ["a"], "recomputed": [], "lost": [],
              "changed": [{"name": "d", "type": "Drifts", "reason": "its digest differs"}],
              "settings": [{"name": "random state", "status": "restored"},
                           {"name": "working directory", "status": "lost",
                            "reason": "cannot change to /gone"}]}
    result = cli(body("running", restore_generation=5, report=report), [])
    assert result.exit_code == 0, result.stderr
    assert "restored 1 variables; came back changed: d (its digest differs)" in result.stderr
    assert "settings not restored: working directory (cannot change to /gone)" in result.stderr
    assert "random state" not in result.stderr
