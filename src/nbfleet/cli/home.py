"""``$NBFLEET_HOME``: where embedded mode keeps its DB, blobs and secrets."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PORT = 8765


def home_dir(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("NBFLEET_HOME") or ".nbfleet").resolve()


def sqlite_url(home: Path) -> str:
    return f"sqlite:///{home / 'nbfleet.db'}"
