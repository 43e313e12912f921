"""Writing many rows at once, in statements whose text does not depend on their
number.

On PostgreSQL, appends go by COPY, which streams rows without a statement per
row. Inserts that must skip conflicts, and updates, send each column as one array
parameter (``unnest``), so the driver and the server see the same statement for 3
rows or 300 and parse it once (a multi-row VALUES list is new text, parsed again,
for every count), and in psycopg's binary format, which costs a tenth of the text
format's quoting of every element. Elsewhere (SQLite), plain executemany.
Everything runs on the session's own connection, in the caller's transaction.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Dialect, Table, bindparam, insert
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
    source, params = unnest(connection, table, rows)
    sets = ", ".join(f'"{name}" = v."{name}"' for name in values)
    match = " AND ".join(f't."{name}" = v."{name}"' for name in keys)
    run_arrays(connection, f'UPDATE "{table.name}" AS t SET {sets} FROM {source} '
                           f"WHERE {match}", params)


def insert_rows(session: Session, table: Table, rows: Sequence[Mapping[str, Any]],
                skip_conflicts_on: Sequence[str], returning: Sequence[str]
                ) -> list[tuple[Any, ...]]:
    """Insert ``rows`` (every row the same keys), skipping those that clash on the
    unique ``skip_conflicts_on``; return the ``returning`` columns of those inserted.

    On PostgreSQL one ``INSERT ... SELECT FROM unnest(arrays)``: its text is the
    same whatever the number of rows, so the driver parses it once, where a
    multi-row VALUES list (thousands of placeholders) is parsed again on every
    call. Elsewhere one multi-row INSERT.
    """
    if not rows:
        return []
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        statement = sqlite_insert(table).on_conflict_do_nothing(
            index_elements=list(skip_conflicts_on))
        return [tuple(row) for row in connection.execute(
            statement.returning(*[table.c[name] for name in returning]), list(rows))]
    source, params = unnest(connection, table, rows)
    names = ", ".join(f'"{name}"' for name in rows[0])
    conflict = ", ".join(f'"{name}"' for name in skip_conflicts_on)
    back = ", ".join(f'"{name}"' for name in returning)
    return run_arrays(connection, f'INSERT INTO "{table.name}" ({names}) SELECT {names} '
                                  f"FROM {source} ON CONFLICT ({conflict}) DO NOTHING "
                                  f"RETURNING {back}", params)


def unnest(connection: Connection, table: Table, rows: Sequence[Mapping[str, Any]]
           ) -> tuple[str, dict[str, list[Any]]]:
    """PostgreSQL: ``unnest(arrays) AS v(columns)`` of the rows (every row the same
    keys), one typed array per column, and its parameters, for ``run_arrays``.
    Rows come out in the order given, which keeps the lock order of the statements
    that use it. JSON values travel as text (None as SQL NULL, as COPY writes it)."""
    columns = tuple(rows[0])
    sql, as_json = _unnest_sql(table, columns, connection.dialect)
    params = {}
    for i, name in enumerate(columns):
        values = [row[name] for row in rows]
        if name in as_json:
            values = [None if value is None else json.dumps(value) for value in values]
        params[f"a{i}"] = values
    return sql, params


def run_arrays(connection: Connection, sql: str, params: Mapping[str, Any]
               ) -> list[tuple[Any, ...]]:
    """Run ``sql`` (psycopg ``%(name)b`` placeholders) on the connection's own
    driver connection, in its transaction; return the rows it returns."""
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    cursor.execute(sql, params)
    return [tuple(row) for row in cursor.fetchall()] if cursor.description else []


@functools.lru_cache(maxsize=256)
def _unnest_sql(table: Table, columns: tuple[str, ...], dialect: Dialect
                ) -> tuple[str, frozenset[str]]:
    as_json = frozenset(name for name in columns if isinstance(table.c[name].type, JSON))
    arrays = ", ".join(
        f"CAST(CAST(%(a{i})b AS TEXT[]) AS JSON[])" if name in as_json
        else f"CAST(%(a{i})b AS {table.c[name].type.compile(dialect=dialect)}[])"
        for i, name in enumerate(columns))
    names = ", ".join(f'"{name}"' for name in columns)
    return f"unnest({arrays}) AS v({names})", as_json
