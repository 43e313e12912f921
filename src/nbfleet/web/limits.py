"""A size bound on every HTTP request body, per route or global.

Without one, any route that reads its body (FastAPI parses JSON bodies before the
handler runs) holds whatever a client sends: a bound is what keeps a server's
memory independent of its callers. A body that declares a larger Content-Length is
refused (413 problem+json) before the app runs and before a byte of it is read; a
body without one (chunked) is counted as it arrives and refused the moment it
passes the bound. Uvicorn discards whatever the app did not read, so a client that
sends everything before reading the answer still gets the 413.

Starlette's own ``RequestBodyLimitMiddleware`` counts bytes only when the route
reads them and answers in plain text; this one answers every refusal as a problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nbfleet.web.problems import problem

#: The bound of a route no rule names: ample for any JSON body nbfleet accepts.
DEFAULT_LIMIT = 1024 * 1024


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes its bound. An HTTPException, so
    FastAPI's body parsing lets it through (it turns other errors into 400) and the
    problem handlers answer it; :class:`BodyLimitMiddleware` answers it otherwise."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes, "
                              f"the most this route accepts")
        self.limit = limit
        self.problem_extra = {"limit": limit}


@dataclass(frozen=True)
class BodyLimit:
    """``limit`` bytes for requests whose method is ``method`` (``*``: any) and
    whose path matches ``path`` (a regular expression, matched in full)."""

    method: str
    path: str
    limit: int

    def matches(self, method: str, path: str) -> bool:
        return self.method in ("*", method) and re.fullmatch(self.path, path) is not None


class BodyLimitMiddleware:
    """Applies the first matching :class:`BodyLimit`, else ``default``, to every
    HTTP request (WebSockets bound their messages themselves)."""

    def __init__(self, app: ASGIApp, rules: tuple[BodyLimit, ...] = (),
                 default: int = DEFAULT_LIMIT) -> None:
        self.app = app
        self.rules = rules
        self.default = default

    def limit_for(self, method: str, path: str) -> int:
        for rule in self.rules:
            if rule.matches(method, path):
                return rule.limit
        return self.default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["method"], scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _refuse(scope, receive, send, BodyTooLarge(limit))
            return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as exc:
            if started:  # too late for a status; the server closes the connection
                raise
            await _refuse(scope, receive, send, exc)


def _content_length(scope: Scope) -> int | None:
    raw = Headers(scope=scope).get("content-length")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None  # the server refuses a malformed length; counting still applies


async def _refuse(scope: Scope, receive: Receive, send: Send, exc: BodyTooLarge) -> None:
    response = problem(413, "Content too large", str(exc.detail), scope["path"],
                       limit=exc.limit)
    await response(scope, receive, send)
