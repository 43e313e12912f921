"""Expired idempotency keys are purged, by the lease holder only."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from nbfleet.control import housekeeping, leases
from nbfleet.control.platform import ControlConfig, Platform
from nbfleet.db.migrate import upgrade
from nbfleet.db.tables import IdempotencyKey


def test_purge_keeps_recent_keys_and_needs_the_lease(db_url: str, tmp_path: Path) -> None:
    platform = Platform(ControlConfig(db_url, str(tmp_path / "blobs"), "secret"))
    upgrade(platform.db.engine)
    with platform.db.transaction() as session:
        now = platform.db.now(session)
        for key, age in (("old", timedelta(hours=25)), ("fresh", timedelta(hours=1))):
            session.add(IdempotencyKey(owner_id="usr_1", key=key, request_hash="h",
                                       status_code=201, response={}, locked_until=now,
                                       created_at=now - age))
    other = leases.acquire(platform.db, housekeeping.LEASE, "another-replica", 60)
    assert other is not None
    # A replica that lost the lease (stale token) must not delete anything.
    assert housekeeping.purge_idempotency_keys(platform, other + 1) == 0
    leases.release(platform.db, housekeeping.LEASE, "another-replica")
    token = leases.acquire(platform.db, housekeeping.LEASE, platform.instance_id, 60)
    assert token is not None and token != other  # the fencing token moved on
    assert housekeeping.purge_idempotency_keys(platform, token) == 1
    with platform.db.transaction(write=False) as session:
        left = session.execute(select(IdempotencyKey.key)).scalars().all()
    assert left == ["fresh"]
    platform.db.dispose()
