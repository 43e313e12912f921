"""Query fragments whose SQL text does not depend on their data."""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

from sqlalchemy import ColumnElement, any_, bindparam
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session


@functools.cache
def _array_of(column: Any) -> ARRAY[Any]:
    return ARRAY(column.type)


def among(session: Session, column: Any, values: Collection[Any]) -> ColumnElement[bool]:
    """``column`` is one of ``values``.

    On PostgreSQL ``column = ANY(:array)``: one parameter, so the statement's text
    is the same for any number of values, and SQLAlchemy and the driver reuse
    their work (an ``IN`` list is rendered and parsed anew for each count, which
    costs a batch of admissions more than the statement itself). Elsewhere ``IN``.
    """
    result: ColumnElement[bool]
    if session.get_bind().dialect.name == "postgresql":
        result = column == any_(bindparam(None, list(values), type_=_array_of(column)))
    else:
        result = column.in_(list(values))
    return result
