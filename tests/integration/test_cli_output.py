"""The CLI's output for people and for scripts (issue 15): ids are never cut, every
list and get command takes ``--json``, an unreachable control plane is explained,
``ws open`` gives the workspace's JupyterLab, and ``ws resume --wait`` reports only
its own resume."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import (
    NBFLEET,
    Cluster,
    create_running,
    free_port,
    run_cell,
    start_kernel,
    token_of,
)
from tests.support.job_api import COMMAND, funded_tenant, register, submit


def nbfleet(url: str | None, token: str | None, *args: str, columns: int = 80,
            extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, on an 80-column terminal unless told otherwise;
    only the URL and token given (no NBFLEET_* of the test run's own)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("NBFLEET_") and k not in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER")}
    env["COLUMNS"] = str(columns)
    env["NBFLEET_HOME"] = "/nonexistent-home"
    if url:
        env["NBFLEET_URL"] = url
    if token:
        env["NBFLEET_TOKEN"] = token
    env.update(extra or {})
    return subprocess.run([*NBFLEET, *args], env=env, capture_output=True, text=True,
                          timeout=120)


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, (result.args, result.stderr)
    return json.loads(result.stdout)


def assert_whole(ids: list[str], output: str, columns: int = 80) -> None:
    """Each id on one line, uncut; and the table fits the terminal."""
    for item in ids:
        assert item in output, (item, output)
    assert "…" not in output
    assert max(len(line.rstrip()) for line in output.splitlines()) <= columns, output


@pytest.fixture(scope="module")
def alice(shared_cluster: Cluster) -> str:
    created = nbfleet(shared_cluster.url, shared_cluster.admin_token,
                      "user", "create", "alice", "--org", "out", "--project", "p")
    assert created.returncode == 0, created.stderr
    return created.stdout.strip()


def test_workspace_ids_are_whole_at_80_columns_and_in_json(shared_cluster: Cluster,
                                                           alice: str, tmp_path: Path) -> None:
    made = [as_json(nbfleet(shared_cluster.url, alice, "ws", "create", name))["id"]
            for name in ("a-workspace-with-a-rather-long-name-indeed", "[bold]short[/bold]")]
    listing = nbfleet(shared_cluster.url, alice, "ws", "list")
    assert listing.returncode == 0, listing.stderr
    assert_whole(made, listing.stdout)
    # A name is shown as typed, not read as rich markup.
    wide = nbfleet(shared_cluster.url, alice, "ws", "list", columns=200).stdout
    assert "[bold]short[/bold]" in wide

    listed = as_json(nbfleet(shared_cluster.url, alice, "ws", "list", "--json"))
    assert sorted(ws["id"] for ws in listed["items"]) == sorted(made)
    got = nbfleet(shared_cluster.url, alice, "ws", "get", made[0], "--json")
    assert as_json(got)["id"] == made[0] and got.stderr == ""  # the JSON alone

    long_name = "results-of-the-third-experiment-with-a-long-descriptive-name.txt"
    local = tmp_path / long_name
    local.write_text("data")
    assert nbfleet(shared_cluster.url, alice, "ws", "put", made[0], str(local)).returncode == 0
    files = nbfleet(shared_cluster.url, alice, "ws", "files", made[0])
    assert_whole([long_name], files.stdout)
    paths = as_json(nbfleet(shared_cluster.url, alice, "ws", "files", made[0], "--json"))
    assert long_name in [entry["path"] for entry in paths["files"]]


def test_jobs_credits_and_fleet_take_json_and_keep_ids_whole(shared_cluster: Cluster) -> None:
    register(shared_cluster, "fakegen", "1.0", COMMAND)
    tenant = funded_tenant(shared_cluster, project="jobs")
    token = token_of(tenant.client)
    job = submit(tenant.client)
    listing = nbfleet(shared_cluster.url, token, "job", "list")
    assert listing.returncode == 0, listing.stderr
    assert_whole([job["id"]], listing.stdout)
    jobs = as_json(nbfleet(shared_cluster.url, token, "job", "list", "--json"))
    assert [item["id"] for item in jobs["items"]] == [job["id"]]
    assert as_json(nbfleet(shared_cluster.url, token, "job", "get", job["id"], "--json")
                   )["id"] == job["id"]

    admin = shared_cluster.admin_token
    binaries = as_json(nbfleet(shared_cluster.url, admin, "binary", "list", "--json"))
    assert "fakegen" in [row["name"] for row in binaries["items"]]
    assert as_json(nbfleet(shared_cluster.url, token, "credit", "balance", "--json")
                   )["available"] > 0
    ledger = as_json(nbfleet(shared_cluster.url, token, "credit", "ledger", "--json"))
    assert ledger["items"], ledger
    assert "items" in as_json(nbfleet(shared_cluster.url, token, "credit", "budget", "list",
                                      "--json"))

    fleet = as_json(nbfleet(shared_cluster.url, admin, "admin", "fleet", "--json"))
    hosts = [host["id"] for host in fleet["hosts"]]
    assert hosts
    table = nbfleet(shared_cluster.url, admin, "admin", "fleet")
    assert table.returncode == 0, table.stderr
    assert_whole(hosts, table.stdout)


@pytest.mark.no_db
@pytest.mark.parametrize("columns", [40, 60, 80, 120])
def test_a_table_never_cuts_an_id_however_narrow(columns: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two 40-character ids side by side do not fit 40 or 60 columns: the lines run
    past the edge, whole, rather than end in an ellipsis."""
    from io import StringIO

    from rich.console import Console

    from nbfleet.cli import client

    screen = StringIO()
    monkeypatch.setattr(client, "out", Console(file=screen, width=columns))
    ids = [f"cell_{'a' * 35}", f"ws_{'b' * 37}"]
    client.print_table(("cell", "workspace", "state", "why"),
                       [(ids[0], ids[1], "waiting", "no host has 8 free GPUs of that type")],
                       ids=("cell", "workspace"))
    shown = screen.getvalue()
    assert all(item in shown for item in ids) and "…" not in shown, shown
    assert "state" in shown and "why" in shown, shown  # narrowed, not dropped
    if columns >= 120:
        assert max(len(line) for line in shown.splitlines()) <= columns, shown


@pytest.mark.no_db
def test_an_unreachable_control_plane_is_explained(tmp_path: Path) -> None:
    """Each way of choosing the URL is named, with how to choose another; exit 1 and
    no traceback."""
    dead = f"http://127.0.0.1:{free_port()}"
    home = tmp_path / "home"
    home.mkdir()
    (home / "url").write_text(f"{dead}\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["ws", "list", "--url", dead], {}, "from --url"),
        (["job", "list"], {"NBFLEET_URL": dead}, "from NBFLEET_URL"),
        (["ws", "get", "ws_x"], {"NBFLEET_HOME": str(home)},
         f"from {home / 'url'}, which `nbfleet up` wrote (NBFLEET_HOME={home})"),
        (["credit", "balance"], {"NBFLEET_HOME": str(empty)},
         f"the default: no --url, no NBFLEET_URL, and no url file in {empty}"),
    ]
    for args, env, how in cases:
        result = nbfleet(None, "nbf_x", *args, columns=300, extra=env)
        assert result.returncode == 1, (args, result.stdout)
        url = "http://127.0.0.1:8765" if how.startswith("the default") else dead
        assert f"cannot reach nbfleet at {url}" in result.stderr, result.stderr
        assert how in result.stderr, (how, result.stderr)
        assert "NBFLEET_URL" in result.stderr and "NBFLEET_HOME" in result.stderr
        assert "Traceback" not in result.stderr


def test_ws_open_gives_the_lab_of_ones_own_workspaces_only(shared_cluster: Cluster,
                                                            alice: str, tmp_path: Path) -> None:
    ws = as_json(nbfleet(shared_cluster.url, alice, "ws", "create", "lab"))["id"]
    lab = f"{shared_cluster.url}/w/{ws}/lab"
    printed = nbfleet(shared_cluster.url, alice, "ws", "open", ws, "--no-browser")
    assert (printed.returncode, printed.stdout) == (0, f"{lab}\n"), printed.stderr
    assert as_json(nbfleet(shared_cluster.url, alice, "ws", "open", ws, "--json",
                           "--no-browser")) == {"url": lab}

    # With a display (here a $BROWSER command), the URL is opened too.
    opened = tmp_path / "opened"
    browser = tmp_path / "browser"
    browser.write_text(f"#!/bin/sh\nprintf '%s' \"$1\" > {opened}\n")
    browser.chmod(0o755)
    shown = nbfleet(shared_cluster.url, alice, "ws", "open", ws,
                    extra={"BROWSER": f"{browser} %s"})
    assert shown.returncode == 0, shown.stderr
    assert opened.read_text() == lab
    opened.unlink()
    nbfleet(shared_cluster.url, alice, "ws", "open", ws, "--no-browser",
            extra={"BROWSER": f"{browser} %s"})
    assert not opened.exists()

    bob = nbfleet(shared_cluster.url, shared_cluster.admin_token,
                  "user", "create", "bob", "--org", "elsewhere", "--project", "p").stdout.strip()
    for token, workspace in ((bob, ws), (alice, "ws_01nonexistent0000000000000"),
                             (alice, f"../{ws}")):
        refused = nbfleet(shared_cluster.url, token, "ws", "open", workspace,
                          extra={"BROWSER": f"{browser} %s"})
        assert refused.returncode == 1, refused.stdout
        assert f"workspace {workspace} not found" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert refused.stdout == "" and not opened.exists()


def test_a_resume_of_a_running_workspace_reports_no_earlier_resume(
        shared_cluster: Cluster) -> None:
    """The second `ws resume --wait` resumed nothing: it must not print the first
    one's summary as its own (it did, as both answered for the same generation)."""
    client = shared_cluster.new_user(org="out", project="resume")
    token = token_of(client)
    ws = create_running(client)
    kernel = start_kernel(client, ws)
    assert run_cell(shared_cluster, client, ws, kernel, "kept = 41").status == "ok"
    suspended = nbfleet(shared_cluster.url, token, "ws", "suspend", ws, "--wait")
    assert suspended.returncode == 0, suspended.stderr
    first = nbfleet(shared_cluster.url, token, "ws", "resume", ws, "--wait", columns=300)
    assert first.returncode == 0, first.stderr
    assert f"kernel {kernel} (" in first.stderr and "restored 1 variables" in first.stderr

    again = nbfleet(shared_cluster.url, token, "ws", "resume", ws, "--wait", columns=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["restore"] is None
    assert "restored 1 variables" not in again.stderr, again.stderr
    assert "no restore report for this resume" in again.stderr
    rest = client.post(f"/v1/workspaces/{ws}/resume", params={"wait": 5})
    assert rest.status_code == 200 and rest.json()["restore"] is None
    # The summary on record is still the first resume's, for whoever reads it.
    assert client.get(f"/v1/workspaces/{ws}").json()["restore"]["kernels"][kernel]


@pytest.mark.no_db
def test_every_list_and_get_command_takes_json() -> None:
    """A survey of every command, so a new list or get command cannot miss --json."""
    import typer

    from nbfleet.cli.main import app

    def walk(command: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        """Leaf commands without --json (a group has ``commands``)."""
        if getattr(command, "commands", None):
            return [found for name, sub in command.commands.items()
                    for found in walk(sub, (*path, name))]
        if not any("--json" in param.opts for param in command.params):
            return [path]
        return []

    readers = ("list", "get", "files", "ledger", "audit", "balance", "fleet", "verify")
    every = walk(typer.main.get_command(app), ())
    assert len(every) > 20, every  # the survey saw the commands
    assert [path for path in every if path[-1] in readers] == []
