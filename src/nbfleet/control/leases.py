"""DB leases with fencing tokens, so one control-plane replica runs each singleton loop.

Time comes from the DB clock only. The token grows each time the lease changes
hands; writes made under a lease check that the token is still current.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from nbfleet.db.engine import Database
from nbfleet.db.tables import Lease

#: The lease of the workspace reconciler, which also runs the fleet's scheduler and
#: its drains: everything that places or moves runtimes writes under it.
WORKSPACES = "workspace-reconciler"


def acquire(db: Database, name: str, holder: str, ttl_s: float) -> int | None:
    """Take or renew the lease; return its fencing token, or None if another holds it."""
    try:
        with db.transaction() as session:
            now = db.now(session)
            expires = now + timedelta(seconds=ttl_s)
            row = session.get(Lease, name, with_for_update=True)
            if row is None:
                session.add(Lease(name=name, holder=holder, token=1, expires_at=expires))
                return 1
            if row.holder != holder and row.expires_at > now:
                return None
            if row.holder != holder:
                row.token += 1
                row.holder = holder
            row.expires_at = expires
            return row.token
    except IntegrityError:
        return None


def still_held(session: Session, name: str, token: int) -> bool:
    current = session.execute(select(Lease.token).where(Lease.name == name)).scalar_one_or_none()
    return current == token


def release(db: Database, name: str, holder: str) -> None:
    """Expire the lease now. The row stays, so the next holder's token is higher:
    deleting it would restart tokens at 1 and let a stale holder pass as current."""
    with db.transaction() as session:
        row = session.get(Lease, name, with_for_update=True)
        if row is not None and row.holder == holder:
            row.expires_at = db.now(session)
