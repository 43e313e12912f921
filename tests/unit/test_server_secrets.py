"""The servers' start-up guards: the cluster secret's sources, private state, ports."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nbfleet.cli import cluster_secret, listen, owner_only
from nbfleet.web.credentials import is_cluster_secret


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_environment_secret_is_taken_once_and_never_inherited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cluster_secret.ENV_VAR, " s3cret-from-env \n")
    assert cluster_secret.take_from_env() == "s3cret-from-env"
    assert cluster_secret.ENV_VAR not in os.environ
    child = subprocess.run([sys.executable, "-c", "import os; print(dict(os.environ))"],
                           capture_output=True, text=True, check=True)
    assert "s3cret-from-env" not in child.stdout
    assert cluster_secret.take_from_env() is None


def test_a_secret_file_must_be_private_and_regular(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    for loose in (0o640, 0o604, 0o620, 0o644):
        path.chmod(loose)
        with pytest.raises(cluster_secret.SecretError, match=f"other users \\(mode {loose:04o}"):
            cluster_secret.read_private(path)
    path.chmod(0o600)
    assert cluster_secret.read_private(path) == "s3cret"
    path.chmod(0o400)
    assert cluster_secret.explicit(str(path), "from-env") == "s3cret"  # the flag wins
    assert cluster_secret.explicit(None, "from-env") == "from-env"
    empty = tmp_path / "empty"
    empty.touch(0o600)
    folder = tmp_path / "folder"
    folder.mkdir(0o700)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for bad, why in [(empty, "is empty"), (folder, "not a regular file"),
                     (fifo, "not a regular file"), (tmp_path / "missing", "does not exist")]:
        with pytest.raises(cluster_secret.SecretError, match=why):
            cluster_secret.read_private(bad)


def test_the_home_secret_is_made_private_or_required(tmp_path: Path) -> None:
    with pytest.raises(cluster_secret.SecretError, match="no cluster secret: pass --secret-file"):
        cluster_secret.from_home(tmp_path, create=False)
    made = cluster_secret.from_home(tmp_path, create=True)
    assert len(made) >= 32 and mode(tmp_path / "cluster-secret") == 0o600
    assert cluster_secret.from_home(tmp_path, create=False) == made


def test_secure_home_tightens_what_an_older_version_left(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "blobs" / "deep").mkdir(parents=True)
    for name in ("nbfleet.db", "nbfleet.db-wal", "nbfleet.db-shm", "admin-token", "url"):
        (home / name).write_text("x")
        (home / name).chmod(0o644)
    home.chmod(0o755)
    (home / "notes.txt").touch(0o644)  # not nbfleet's: left as it is
    target = tmp_path / "target"
    target.touch(0o644)
    (home / "cluster-secret").symlink_to(target)
    owner_only.secure_home(home)
    assert mode(home) == 0o700 and mode(home / "blobs") == 0o700
    for name in ("nbfleet.db", "nbfleet.db-wal", "nbfleet.db-shm", "admin-token", "url"):
        assert mode(home / name) == 0o600, name
    assert mode(home / "notes.txt") == mode(target) == 0o644  # a link is never followed
    assert mode(home / "blobs" / "deep") == 0o755  # below the top: the 0700 home guards it
    fresh = tmp_path / "fresh" / "home"
    owner_only.secure_home(fresh)
    assert mode(fresh) == 0o700
    owner_only.secure_home(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()


def test_a_shared_directory_is_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "someone-elses").touch(0o644)
    (shared / "admin-token").touch(0o644)
    owner_only.secure_home(shared)
    assert mode(shared) == 0o1777 and mode(shared / "someone-elses") == 0o644
    assert mode(shared / "admin-token") == 0o600


def test_a_sqlite_db_outside_the_home_is_tightened(tmp_path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"x.db{suffix}").touch(0o644)
    owner_only.secure_sqlite(f"sqlite:///{tmp_path / 'x.db'}")
    assert {mode(tmp_path / f"x.db{s}") for s in ("", "-wal", "-shm")} == {0o600}
    owner_only.secure_sqlite("postgresql://u@h/db")  # nothing to do, no error


def test_ports_are_checked_with_a_one_line_reason() -> None:
    assert listen.parse_port("0") == 0 and listen.parse_port(" 8765 ") == 8765
    for bad in ("70000", "-1", "abc", "", "1e3", "65536"):
        with pytest.raises(listen.ListenError, match="--port must be a number from 0 to 65535"):
            listen.parse_port(bad)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(listen.ListenError) as refused:
            listen.bind("127.0.0.1", port)
        assert str(refused.value) == f"port {port} on 127.0.0.1 is already in use (pass --port)"
    with pytest.raises(listen.ListenError, match="not a known host name"):
        listen.bind("no-such-host.invalid", 0)
    sock = listen.bind("127.0.0.1", 0)
    with sock:
        assert listen.url_of(sock) == f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_the_secret_comparison_never_raises() -> None:
    assert is_cluster_secret("s3cret", "s3cret")
    assert not is_cluster_secret("s3cre", "s3cret")
    assert not is_cluster_secret("s\u00e9cret", "s3cret")  # hmac refuses non-ASCII str
    assert not is_cluster_secret(None, "s3cret") and not is_cluster_secret("", "")
