"""Where the servers get the cluster secret from: never a command line.

Any local process can read another's command line (``/proc/PID/cmdline``), and
the cluster secret opens every agent's API (every tenant's kernels). So it comes
from a file only its owner can read (``--secret-file``, or
``$NBFLEET_HOME/cluster-secret``, which embedded mode creates), or from
``NBFLEET_CLUSTER_SECRET``, which is taken out of the environment as the command
starts so that no child (kernel, job, pip) inherits it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from nbfleet.control.tenancy import write_secret

ENV_VAR = "NBFLEET_CLUSTER_SECRET"
FILE_NAME = "cluster-secret"
#: More than any secret needs; a bigger file is a wrong path, not a secret.
MAX_BYTES = 4096


class SecretError(Exception):
    """A secret that cannot be used; the message is one line for the CLI."""


def take_from_env() -> str | None:
    """NBFLEET_CLUSTER_SECRET, removed from the environment (children never see it)."""
    value = (os.environ.pop(ENV_VAR, None) or "").strip()
    return value or None


def read_private(path: Path) -> str:
    """The secret in ``path``: a regular file no one but its owner may read.

    The checks run on the opened file (no race with a swapped path); a group- or
    world-readable file is refused rather than fixed, since its secret may already
    have leaked and the operator should know.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise SecretError(f"secret file {path} does not exist") from None
    except OSError as exc:
        raise SecretError(f"cannot read secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"secret file {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise SecretError(f"secret file {path} is accessible to other users (mode "
                              f"{mode:04o}); run `chmod 600 {path}` and use a new secret")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise SecretError(f"secret file {path} is larger than {MAX_BYTES} bytes")
    value = raw.decode("utf-8", errors="replace").strip()
    if not value:
        raise SecretError(f"secret file {path} is empty")
    return value


def explicit(secret_file: str | None, from_env: str | None) -> str | None:
    """The secret the operator gave: ``--secret-file`` first, then the environment."""
    if secret_file:
        return read_private(Path(secret_file))
    return from_env


def from_home(home: Path, create: bool) -> str:
    """``home/cluster-secret``; created (0600) when ``create`` and it is missing."""
    path = home / FILE_NAME
    if create and not path.exists():
        write_secret(str(path), secrets.token_urlsafe(32))
    if not path.exists():
        raise SecretError(f"no cluster secret: pass --secret-file PATH, set {ENV_VAR}, "
                          f"or share the control plane's {path}")
    return read_private(path)
