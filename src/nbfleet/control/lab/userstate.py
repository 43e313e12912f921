"""What JupyterLab keeps per user (settings overrides, layouts, frontend config):
rows of ``lab_state``, where jupyterlab_server would keep files on one machine."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select

from nbfleet.control.platform import Platform
from nbfleet.db.tables import LabState

#: A user's settings for one plugin stay small; so do layouts (a few KiB).
MAX_VALUE_CHARS = 1_000_000


def read(platform: Platform, user_id: str, key: str) -> tuple[str, datetime] | None:
    with platform.db.transaction(write=False) as session:
        row = session.get(LabState, (user_id, key))
        return None if row is None else (row.value, row.updated_at)


def read_prefix(platform: Platform, user_id: str, prefix: str) -> dict[str, tuple[str, datetime]]:
    with platform.db.transaction(write=False) as session:
        rows = session.execute(select(LabState).where(
            LabState.user_id == user_id, LabState.key.startswith(prefix, autoescape=True)))
        return {row.key: (row.value, row.updated_at) for row in rows.scalars()}


def write(platform: Platform, user_id: str, key: str, value: str) -> None:
    with platform.db.transaction() as session:
        now = platform.db.now(session)
        row = session.get(LabState, (user_id, key), with_for_update=True)
        if row is None:
            session.add(LabState(user_id=user_id, key=key, value=value, updated_at=now))
        else:
            row.value, row.updated_at = value, now


def remove(platform: Platform, user_id: str, key: str) -> bool:
    with platform.db.transaction() as session:
        row = session.get(LabState, (user_id, key))
        if row is None:
            return False
        session.delete(row)
        return True
