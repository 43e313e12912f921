"""The CLI against a live control plane: happy paths and clear failures."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import nbformat
import pytest

from tests.support.cluster import NBFLEET, Cluster, free_port


def nbfleet(cluster_url: str, token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["NBFLEET_URL"] = cluster_url
    env["NBFLEET_HOME"] = "/nonexistent-home"  # only the flags/env above may be used
    env["COLUMNS"] = "200"
    if token:
        env["NBFLEET_TOKEN"] = token
    return subprocess.run([*NBFLEET, *args], env=env, capture_output=True, text=True, timeout=120)


def test_user_and_workspace_commands(shared_cluster: Cluster, tmp_path: Path) -> None:
    created = nbfleet(shared_cluster.url, shared_cluster.admin_token,
                      "user", "create", "carol", "--org", "cli", "--project", "p")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("nbf_")

    ws = json.loads(nbfleet(shared_cluster.url, token, "ws", "create", "mine", "--wait").stdout)
    assert ws["state"] == "running"
    notebook = tmp_path / "demo.ipynb"
    notebook.write_text(nbformat.writes(nbformat.v4.new_notebook()))
    assert nbfleet(shared_cluster.url, token, "ws", "put", ws["id"], str(notebook)).returncode == 0
    listing = nbfleet(shared_cluster.url, token, "ws", "files", ws["id"])
    assert "demo.ipynb" in listing.stdout
    cat = nbfleet(shared_cluster.url, token, "ws", "cat", ws["id"], "demo.ipynb")
    assert nbformat.reads(cat.stdout, 4).nbformat == 4

    suspended = nbfleet(shared_cluster.url, token, "ws", "suspend", ws["id"], "--wait")
    assert json.loads(suspended.stdout)["state"] == "suspended"
    resumed = nbfleet(shared_cluster.url, token, "ws", "resume", ws["id"], "--wait")
    assert json.loads(resumed.stdout)["state"] == "running"
    assert ws["id"] in nbfleet(shared_cluster.url, token, "ws", "list").stdout
    gateway = nbfleet(shared_cluster.url, token, "ws", "gateway-url", ws["id"]).stdout.strip()
    assert gateway == f"{shared_cluster.url}/v1/workspaces/{ws['id']}"
    deleted = nbfleet(shared_cluster.url, token, "ws", "delete", ws["id"], "--wait")
    assert json.loads(deleted.stdout)["state"] == "deleted"


def test_cli_errors_are_clear_and_non_zero(shared_cluster: Cluster, tmp_path: Path) -> None:
    token = nbfleet(shared_cluster.url, shared_cluster.admin_token,
                    "user", "create", "dave", "--org", "cli", "--project", "p").stdout.strip()
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{ this is not a notebook")
    ws = json.loads(nbfleet(shared_cluster.url, token, "ws", "create", "w").stdout)["id"]

    cases = [
        (nbfleet(shared_cluster.url, token, "ws", "put", ws, str(bad)), "not a valid notebook"),
        (nbfleet(shared_cluster.url, token, "ws", "get", "ws_nope"), "not found"),
        (nbfleet(shared_cluster.url, "nbf_wrong", "ws", "list"), "invalid or revoked token"),
        (nbfleet(shared_cluster.url, token, "user", "create", "x", "--org", "o",
                 "--project", "p"), "error 404"),
        (nbfleet(shared_cluster.url, shared_cluster.admin_token, "user", "create", "bad name!",
                 "--org", "o", "--project", "p"), "invalid user name"),
        (nbfleet(f"http://127.0.0.1:{free_port()}", token, "ws", "list"), "cannot reach nbfleet"),
        (nbfleet(shared_cluster.url, token, "ws", "put", ws, str(tmp_path / "missing.txt")),
         "is not a file"),
    ]
    for result, message in cases:
        assert result.returncode != 0, (result.args, result.stdout)
        assert message in result.stderr, (message, result.stderr)
        assert "Traceback" not in result.stderr


def test_help_lists_the_commands() -> None:
    result = subprocess.run([*NBFLEET, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("up", "control", "agent", "ws", "user"):
        assert command in result.stdout


@pytest.mark.no_db
def test_servers_refuse_a_busy_or_invalid_port(tmp_path: Path) -> None:
    """One line on stderr and status 2, never a traceback, and no state written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["COLUMNS"] = "80"  # the line is never wrapped
    runs = []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for command in (("up",), ("control",), ("agent", "--control", "http://127.0.0.1:9")):
            for value in (port, "70000", "-1", "abc"):
                home = tmp_path / f"{command[0]}{value}"
                expected = (f"port {port} on 127.0.0.1 is already in use (pass --port)"
                            if value == port else
                            f"--port must be a number from 0 to 65535, not '{value}'")
                proc = subprocess.Popen([*NBFLEET, *command, "--port", value, "--home", str(home)],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                runs.append((proc, home, expected))
        for proc, home, expected in runs:
            out, err = proc.communicate(timeout=120)
            assert (proc.returncode, err) == (2, f"error: {expected}\n"), (proc.args, out)
            assert not home.exists()
