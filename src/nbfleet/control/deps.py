"""Request plumbing shared by the routers: the platform, the caller, idempotent replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from nbfleet.control import auth
from nbfleet.control.idempotency import request_fingerprint, run_idempotent
from nbfleet.control.platform import Platform
from nbfleet.model.errors import NotFound
from nbfleet.web.problems import bearer_token, problem


def platform_of(request: Request) -> Platform:
    platform: Platform = request.app.state.platform
    return platform


def token_of(headers: Any, query: Any) -> str | None:
    """Header first; ``?token=`` is accepted too, as Jupyter clients may use it."""
    return bearer_token(headers.get("authorization")) or query.get("token")


def current_principal(request: Request) -> auth.Principal:
    platform = platform_of(request)
    token = token_of(request.headers, request.query_params)
    with platform.db.transaction(write=False) as session:
        return auth.resolve(session, token)


def require_admin(request: Request) -> auth.Principal:
    principal = current_principal(request)
    if not principal.is_admin:
        raise NotFound("not found")  # admin routes do not exist for ordinary callers
    return principal


def idempotent_reply(
    request: Request,
    principal: auth.Principal,
    body: Any,
    action: Callable[[Session], tuple[int, dict[str, Any]]],
    wake_reconciler: bool = True,
) -> JSONResponse:
    """Run a mutation under the request's Idempotency-Key and answer with its outcome.

    ``wake_reconciler``: nudge the workspace reconciler afterwards (mutations of
    other resources, jobs say, have nothing for it to do)."""
    platform = platform_of(request)
    key = request.headers.get("idempotency-key")
    fingerprint = request_fingerprint(request.method, request.url.path, body)
    (status, payload), replayed = run_idempotent(platform.db, principal.user_id, key,
                                                 fingerprint, action)
    if not replayed and wake_reconciler:
        platform.wake()
    return outcome_response(request, status, payload, replayed)


def outcome_response(request: Request, status: int, payload: dict[str, Any],
                     replayed: bool) -> JSONResponse:
    """An outcome (perhaps a stored refusal, perhaps replayed) as the answer."""
    headers = {"Idempotent-Replayed": "true"} if replayed else {}
    if status >= 400:
        extra = {k: v for k, v in payload.items() if k not in ("title", "detail")}
        response = problem(status, payload.get("title", "Error"), payload.get("detail", ""),
                           request.url.path, **extra)
        response.headers.update(headers)
        return response
    return JSONResponse(payload, status_code=status, headers=headers)
