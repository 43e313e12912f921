"""RFC 9457 problem details for every error an nbfleet HTTP API returns."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nbfleet.model.errors import DomainError

PROBLEM_JSON = "application/problem+json"


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_JSON

    def render(self, content: Any) -> bytes:
        """JSON in UTF-8, except that a problem quoting text which is not valid
        Unicode (a lone surrogate, sent as a JSON escape) is written with ASCII
        escapes: refusing bad input must never fail on echoing it."""
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode("ascii")


def problem(status: int, title: str, detail: str, instance: str = "", **extra: Any) -> JSONResponse:
    """``message`` and ``reason`` repeat ``detail`` and ``title``: jupyter_server's
    gateway client reads only those two from an error body, and would otherwise
    show a bare "HTTP 409: Conflict". A problem's own ``reason`` (a credit refusal
    says which limit) is kept."""
    body: dict[str, Any] = {
        "type": f"https://nbfleet.dev/problems/{title.lower().replace(' ', '-')}",
        "title": title,
        "status": status,
        "detail": detail,
        "message": detail,
        "reason": title,
    }
    if instance:
        body["instance"] = instance
    body.update(extra)
    return ProblemResponse(body, status_code=status, media_type=PROBLEM_JSON)


def install_problem_handlers(app: FastAPI) -> None:
    async def on_domain(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, DomainError)
        return problem(exc.status, exc.title, exc.detail, request.url.path, **exc.extra)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            {"loc": list(err.get("loc", ())), "msg": err.get("msg", ""), "type": err.get("type")}
            for err in exc.errors()
        ]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(part) for part in first["loc"])
        return problem(422, "Unprocessable content", f"{where}: {first['msg']}",
                       request.url.path, errors=errors)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        title = {401: "Unauthorized", 403: "Forbidden", 404: "Not found",
                 405: "Method not allowed", 413: "Content too large",
                 429: "Too many requests"}.get(exc.status_code, "Error")
        # An HTTPException may carry problem members of its own (web.limits does).
        extra = getattr(exc, "problem_extra", None) or {}
        response = problem(exc.status_code, title, str(exc.detail), request.url.path, **extra)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    app.add_exception_handler(DomainError, on_domain)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)


def bearer_token(authorization: str | None) -> str | None:
    """Accept ``Bearer <t>`` and Jupyter's ``token <t>``."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() in ("bearer", "token") and value.strip():
        return value.strip()
    return None


async def deny_websocket(websocket: WebSocket, error: DomainError) -> None:
    """Refuse a WebSocket handshake with the HTTP status and problem the REST API gives.

    Where the server lacks the denial-response extension, a close code of 4000 plus
    the status carries it instead.
    """
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(
            problem(error.status, error.title, error.detail, websocket.url.path, **error.extra)
        )
    else:
        await websocket.close(code=4000 + error.status, reason=error.detail[:120])
