"""A value the database refuses to store is the request's fault: 422, not 500.

PostgreSQL refuses some values every route accepts as text: a NUL character
(``%00`` in a path or query, ``\\u0000`` in JSON) cannot be stored or even
compared in a text column, and the driver raises a DataError (SQLSTATE class 22,
"data exception") before the query runs. Validating every string of every route
for what one backend cannot hold would scatter the rule; the backend already
says so, in one exception type, which is answered here as a problem.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError

from nbfleet.web.problems import problem

log = logging.getLogger(__name__)


def install_data_error_handler(app: FastAPI) -> None:
    async def on_data_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DataError)
        reason = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else "invalid"
        log.info("refused a value the database cannot store (%s %s): %s",
                 request.method, request.url.path, reason)
        return problem(422, "Unprocessable content",
                       f"the request holds a value that cannot be stored: {reason}",
                       request.url.path)

    app.add_exception_handler(DataError, on_data_error)
