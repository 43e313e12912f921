"""Appending many rows at once: COPY on PostgreSQL, executemany elsewhere.

The ledger's metering path appends hundreds of journal and audit rows per
transaction. COPY sends them in one round trip without one statement per row,
which is several times faster than executemany on PostgreSQL; it runs on the
session's own connection, so it is part of the caller's transaction.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Table, bindparam, insert, text
from sqlalchemy.orm import Session
from sqlalchemy.types import JSON


def append_rows(session: Session, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` (every row the same keys) into ``table``."""
    if not rows:
        return
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        connection.execute(insert(table), list(rows))
        return
    columns = list(rows[0])
    as_json = {name for name in columns if isinstance(table.c[name].type, JSON)}
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    quoted = ", ".join(f'"{name}"' for name in columns)
    with cursor.copy(f'COPY "{table.name}" ({quoted}) FROM STDIN') as copy:
        for row in rows:
            copy.write_row([json.dumps(row[name]) if name in as_json and row[name] is not None
                            else row[name] for name in columns])


def update_rows(session: Session, table: Table, keys: Sequence[str],
                rows: Sequence[Mapping[str, Any]]) -> None:
    """Set columns of many rows found by ``keys`` (every row the same keys).

    On PostgreSQL one ``UPDATE ... FROM unnest(arrays)`` statement; elsewhere
    executemany. Only for rows the transaction has locked already (or that only
    it can touch): the order in which one statement updates them is the planner's.
    """
    if not rows:
        return
    connection = session.connection()
    columns = list(rows[0])
    values = [name for name in columns if name not in keys]
    if connection.dialect.name != "postgresql":
        statement = table.update().where(
            *[table.c[name] == bindparam(f"k_{name}") for name in keys]
        ).values({name: bindparam(f"v_{name}") for name in values})
        connection.execute(statement, [
            {(f"k_{name}" if name in keys else f"v_{name}"): row[name] for name in columns}
            for row in rows])
        return
    dialect = connection.dialect
    arrays = ", ".join(
        f"CAST(:a{i} AS {table.c[name].type.compile(dialect=dialect)}[])"
        for i, name in enumerate(columns))
    names = ", ".join(f'"{name}"' for name in columns)
    sets = ", ".join(f'"{name}" = v."{name}"' for name in values)
    match = " AND ".join(f't."{name}" = v."{name}"' for name in keys)
    sql = (f'UPDATE "{table.name}" AS t SET {sets} FROM unnest({arrays}) AS v({names}) '
           f"WHERE {match}")
    connection.execute(text(sql), {f"a{i}": [row[name] for row in rows]
                                   for i, name in enumerate(columns)})
