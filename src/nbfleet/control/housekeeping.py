"""Periodic clean-up that must run once per cluster, under its own lease."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from sqlalchemy import delete

from nbfleet.control import leases, websessions
from nbfleet.control.platform import Platform
from nbfleet.db.engine import rows_affected
from nbfleet.db.tables import IdempotencyKey

log = logging.getLogger(__name__)

LEASE = "housekeeping"
INTERVAL_S = 60.0
#: How long a stored response can be replayed (Stripe keeps keys for 24 hours).
IDEMPOTENCY_RETENTION = timedelta(hours=24)


def purge_idempotency_keys(platform: Platform, token: int) -> int:
    with platform.db.transaction() as session:
        if not leases.still_held(session, LEASE, token):
            return 0
        cutoff = platform.db.now(session) - IDEMPOTENCY_RETENTION
        result = session.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < cutoff))
        return rows_affected(result)


async def run_forever(platform: Platform) -> None:
    while True:
        try:
            token = await asyncio.to_thread(
                leases.acquire, platform.db, LEASE, platform.instance_id, INTERVAL_S * 2
            )
            if token is not None:
                purged = await asyncio.to_thread(purge_idempotency_keys, platform, token)
                if purged:
                    log.info("purged %d expired idempotency keys", purged)
                sessions = await asyncio.to_thread(websessions.purge_expired, platform.db)
                if sessions:
                    log.info("purged %d expired browser sessions", sessions)
        except Exception:
            log.exception("housekeeping failed")
        await asyncio.sleep(INTERVAL_S)
