"""Returns stranded credits: holds whose lease lapsed, and grants past their expiry.

Every replica runs it, without a lease: each hold is locked with SKIP LOCKED and
settled at most once, so two reapers (or a reaper and a late finish call) can race
freely. Both passes read the DB clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nbfleet.control.platform import Platform
from nbfleet.ledger import service

log = logging.getLogger(__name__)

BATCH = 100


def _drain(step: Callable[[], int]) -> int:
    """Run ``step`` (which handles up to BATCH rows) until it handles fewer."""
    total = 0
    while True:
        count = step()
        total += count
        if count < BATCH:
            return total


def sweep(platform: Platform) -> tuple[int, int]:
    """One pass: (holds reaped, buckets expired)."""
    reaped = _drain(lambda: len(service.reap(platform.db, BATCH)))
    return reaped, _drain(lambda: service.expire(platform.db, BATCH))


async def run_forever(platform: Platform) -> None:
    while True:
        try:
            reaped, expired = await asyncio.to_thread(sweep, platform)
            if reaped or expired:
                log.info("credit reaper: %d holds released, %d grants expired", reaped, expired)
        except Exception:
            log.exception("credit reaper failed")
        await asyncio.sleep(platform.config.credit_reap_interval_s)
