"""Request plumbing shared by the routers: the platform, the caller, idempotent replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request, WebSocket
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from nbfleet.control import auth, websessions
from nbfleet.control.idempotency import request_fingerprint, run_idempotent
from nbfleet.control.platform import Platform
from nbfleet.model.errors import Forbidden, NotFound, Unauthorized
from nbfleet.web import browser
from nbfleet.web.problems import bearer_token, problem


def platform_of(request: Request) -> Platform:
    platform: Platform = request.app.state.platform
    return platform


#: The query parameter in which Jupyter clients put a token where they cannot send
#: a header: a browser's WebSocket, and Jupyter's token login link.
URL_TOKEN = "token"
TOKEN_IN_URL = ("a token in the URL (?token=) is accepted only by WebSockets (kernel "
                "channels) and to open JupyterLab (/w/{id}/lab), as URLs end up in logs "
                "and browser history: send it in the 'Authorization: Bearer <token>' header")


class TokenInUrl(Unauthorized):
    """An HTTP request that carries ``?token=`` where none is accepted: refused
    (401) whatever else it carries, so that the client learns to send the header
    rather than have its token ignored, or worse, copied into every log on the way."""


def token_of(headers: Any, query: Any) -> str | None:
    """An HTTP request's API token, from its ``Authorization`` header (``Bearer`` or
    Jupyter's ``token`` scheme). Raises :class:`TokenInUrl` for ``?token=``."""
    if URL_TOKEN in query:
        raise TokenInUrl(TOKEN_IN_URL)
    return bearer_token(headers.get("authorization"))


def url_token_of(headers: Any, query: Any) -> str | None:
    """Where ``?token=`` is accepted (WebSockets, Lab's first page): the header
    first, else the URL's token."""
    token = bearer_token(headers.get("authorization")) or query.get(URL_TOKEN)
    return str(token) if token else None


def current_principal(request: Request) -> auth.Principal:
    """The caller: by API token (the ``Authorization`` header), else by the
    browser's session cookie, whose unsafe requests must carry the CSRF token in
    the ``X-XSRFToken`` header (``websessions``). ``?token=`` is refused (401)."""
    return principal_of(request)


def principal_of(request: Request, form_xsrf: str | None = None,
                 url_token: bool = False) -> auth.Principal:
    """:func:`current_principal`, also accepting the CSRF token from an ``_xsrf`` form
    field the caller has already parsed (the dashboard's forms). Kept apart so that
    FastAPI never reads ``form_xsrf`` from a query string: tokens stay out of URLs.
    ``url_token``: accept ``?token=`` too (JupyterLab's page, as Jupyter's token
    login link, which it then exchanges for a session cookie)."""
    platform = platform_of(request)
    token = (url_token_of if url_token else token_of)(request.headers, request.query_params)
    if token or websessions.SESSION_COOKIE not in request.cookies:
        with platform.db.transaction(write=False) as session:
            return auth.resolve(session, token)
    return websessions.authenticate(
        platform.db, platform.config.secret, request.cookies, request.method,
        request.headers.get(websessions.XSRF_HEADER) or form_xsrf)


def principal_of_websocket(platform: Platform, websocket: WebSocket) -> auth.Principal:
    """The caller of a WebSocket: by token (header or ``?token=``: a browser cannot
    set a WebSocket's headers), else by session cookie. A handshake is a GET and
    carries no CSRF header, and browsers send cookies on WebSockets opened from any
    site; so with a cookie, the ``Origin`` the browser sets must be ours (or absent:
    not a browser), or anyone's page could drive the user's kernels (cross-site
    WebSocket hijacking). Raises 401 or 403."""
    token = url_token_of(websocket.headers, websocket.query_params)
    if token or websessions.SESSION_COOKIE not in websocket.cookies:
        with platform.db.transaction(write=False) as session:
            return auth.resolve(session, token)
    origin = websocket.headers.get("origin")
    if origin is not None and not websessions.same_origin(origin,
                                                          websocket.headers.get("host")):
        raise Forbidden("cross-origin WebSocket refused: its Origin is not this server")
    return websessions.authenticate(platform.db, platform.config.secret, websocket.cookies,
                                    "GET", None)


def cookies_secure(request: Request) -> bool:
    """Whether the cookies set in answer to ``request`` get ``Secure``
    (``--secure-cookies``, see ``web.browser``)."""
    return browser.cookies_secure(platform_of(request).config.secure_cookies,
                                  request.url.scheme)


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
