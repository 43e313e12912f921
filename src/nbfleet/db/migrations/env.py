"""Alembic environment: the engine is handed in by ``nbfleet.db.migrate``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from nbfleet.db import (
    credit_tables,  # noqa: F401  (registers the ledger's tables)
    job_tables,  # noqa: F401  (registers the jobs tables)
)
from nbfleet.db.tables import Base

config = context.config
engine = config.attributes["engine"]

with engine.connect() as connection:
    if connection.dialect.name == "postgresql":
        # Two control planes starting together must not both run the migration.
        connection.execute(text("SELECT pg_advisory_lock(74210)"))
        connection.commit()
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_unlock(74210)"))
        connection.commit()
