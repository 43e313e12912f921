"""The cluster secret and the platform's state stay with the user who runs it.

Any local process may read another's command line, so no server is given a secret
on one; the state (DB, tokens, secret) is 0600 in 0700 directories; a secret file
that others can read is refused rather than used.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.cluster import NBFLEET, Cluster


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_no_server_has_the_secret_on_its_command_line(shared_cluster: Cluster) -> None:
    """A hostile local process that read the agent's /proc/PID/cmdline used to get
    the secret, and with it every tenant's kernels on the agent API."""
    secret = shared_cluster.secret.encode()
    assert shared_cluster.control is not None and shared_cluster.agents
    for proc in (shared_cluster.control, *shared_cluster.agents.values()):
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert b"--secret-file" in cmdline  # the secret itself stays in its 0600 file
        assert secret not in cmdline and secret not in environ


def test_the_state_is_private(shared_cluster: Cluster) -> None:
    home = shared_cluster.home
    assert mode(home) == 0o700
    names = {entry.name for entry in home.iterdir()}
    assert {"admin-token", "cluster-secret", "url", "blobs"} <= names
    for entry in home.iterdir():
        assert mode(entry) == (0o700 if entry.is_dir() else 0o600), entry
    for agent in shared_cluster.agents:  # the agents' state, made by them
        assert mode(shared_cluster.root / agent) == 0o700
        assert mode(shared_cluster.root / agent / "agent-id") == 0o600
    if shared_cluster.db_url.startswith("sqlite"):
        db = Path(shared_cluster.db_url.removeprefix("sqlite:///"))
        files = [db, *(p for p in (Path(f"{db}-wal"), Path(f"{db}-shm")) if p.exists())]
        assert len(files) == 3  # WAL mode: both sidecars exist while it runs
        assert {mode(path) for path in files} == {0o600}, files


def _server(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBFLEET_")}
    env["COLUMNS"] = "80"  # a long message must still be one line
    return subprocess.run([*NBFLEET, *args, "--home", str(home)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.no_db
def test_a_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose-secret"
    loose.write_text("s3cret-in-a-loose-file\n")
    loose.chmod(0o640)
    folder = tmp_path / "folder"
    folder.mkdir()
    home = tmp_path / "home"
    cases = [(loose, f"is accessible to other users (mode 0640); run `chmod 600 {loose}` "
                     "and use a new secret"),
             (folder, "is not a regular file"), (tmp_path / "missing", "does not exist")]
    for command in (("control", "--port", "0"), ("agent", "--control", "http://127.0.0.1:9")):
        for path, why in cases:
            result = _server(*command, "--secret-file", str(path), home=home)
            assert result.returncode == 2, (command, result.stdout, result.stderr)
            assert result.stderr == f"error: secret file {path} {why}\n", result.stderr
            assert "s3cret" not in result.stderr + result.stdout
    assert not home.exists()  # refused before touching any state


@pytest.mark.no_db
def test_the_secret_is_never_an_argument(tmp_path: Path) -> None:
    for command in (("control",), ("agent", "--control", "http://127.0.0.1:9")):
        result = _server(*command, "--secret", "s3cret", home=tmp_path / "home")
        assert result.returncode == 2 and "No such option: --secret" in result.stderr


@pytest.mark.no_db
def test_an_agent_without_a_secret_says_where_to_put_one(tmp_path: Path) -> None:
    result = _server("agent", "--control", "http://127.0.0.1:9", "--port", "0",
                     home=tmp_path / "home")
    assert result.returncode == 2
    assert result.stderr.startswith("error: no cluster secret: pass --secret-file PATH, set "
                                     "NBFLEET_CLUSTER_SECRET, or share the control plane's ")
    assert result.stderr.count("\n") == 1
