"""How the APIs write values in JSON (one way everywhere)."""

from __future__ import annotations

from datetime import datetime


def iso(moment: datetime | None) -> str | None:
    """RFC 3339 in UTC with a ``Z``, as every nbfleet API answers times."""
    return moment.isoformat().replace("+00:00", "Z") if moment else None
