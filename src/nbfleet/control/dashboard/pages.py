"""What every dashboard page shares: templates, the signed-in viewer, forms, errors.

Pages are rendered on the server with Jinja2 (autoescaping on everywhere, so a
name like ``<script>`` is text, never markup) and served with a Content Security
Policy that allows scripts and styles from this server only: even a slip in a
template could not run an injected script. Errors are pages, never tracebacks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from sqlalchemy import select
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException

from nbfleet.control import deps, websessions
from nbfleet.control.auth import Principal
from nbfleet.db.tables import Org, Project, User
from nbfleet.model.errors import ContentTooLarge, DomainError, InvalidInput, Unauthorized

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
STATIC = HERE / "static"
PAGE_SIZE = 50
MAX_FORM_BYTES = 64 * 1024

#: Sent with every dashboard page. ``connect-src 'self'``: the poller's fetches.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

TITLES = {400: "Bad request", 401: "Not signed in", 403: "Forbidden", 404: "Not found",
          405: "Method not allowed", 409: "Conflict", 413: "Too large",
          422: "Cannot do that", 429: "Too many attempts", 500: "Something went wrong",
          503: "Temporarily unavailable"}


def _asset_versions() -> dict[str, str]:
    """A short content hash per static file, for cache-busting URLs."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()[:12]
            for path in STATIC.iterdir() if path.is_file()}


ASSET_VERSIONS = _asset_versions()


def static_url(name: str) -> str:
    return f"/ui/static/{name}?v={ASSET_VERSIONS.get(name, '0')}"


def credits(micro: int | None) -> str:
    """Micro-credits as credits, e.g. ``12.5`` (the API's integers, as the CLI shows)."""
    if micro is None:
        return "\N{EN DASH}"
    sign = "-" if micro < 0 else ""
    whole, frac = divmod(abs(int(micro)), 1_000_000)
    text = f"{whole:,}.{frac:06d}".rstrip("0").rstrip(".")
    return sign + text


def when(value: Any) -> str:
    """A time as the API writes it, shortened for a table: ``2026-11-26 13:00:05Z``."""
    if not value:
        return "\N{EN DASH}"
    text = value if isinstance(value, str) else value.isoformat()
    return text.replace("T", " ").replace("+00:00", "Z").split(".")[0].rstrip("Z") + "Z"


#: Templates are package data: compiled once, never looked at again (no reload stat).
ENV = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True,
                  undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                  auto_reload=False)
ENV.globals["static"] = static_url
ENV.filters["credits"] = credits
ENV.filters["when"] = when


class SignInRequired(Exception):
    """Raised by a page for a caller who is not signed in: answered with a redirect."""


@dataclass(frozen=True, slots=True)
class Viewer:
    """The signed-in user as the page header shows them, and the CSRF token its
    forms carry ("" when signed in by API token, which needs none)."""

    principal: Principal
    xsrf: str
    name: str
    org: str
    project: str

    @property
    def is_admin(self) -> bool:
        return self.principal.is_admin


def _viewer(request: Request, form_xsrf: str | None = None) -> Viewer:
    try:
        principal = deps.principal_of(request, form_xsrf)
    except deps.TokenInUrl:
        raise  # an error page that says so, not a sign-in that would drop it silently
    except Unauthorized as exc:
        raise SignInRequired from exc
    platform = deps.platform_of(request)
    cookie = request.cookies.get(websessions.SESSION_COOKIE)
    by_token = deps.token_of(request.headers, request.query_params) is not None
    xsrf = websessions.xsrf_token(platform.config.secret, cookie) if cookie and not by_token \
        else ""
    with platform.db.transaction(write=False) as session:
        row = session.execute(
            select(User.name, Org.name, Project.name)
            .join(Org, Org.id == User.org_id).join(Project, Project.id == User.project_id)
            .where(User.id == principal.user_id)).first()
    name, org, project = row if row is not None else ("?", "?", "?")
    return Viewer(principal, xsrf, name, org, project)


def viewer(request: Request) -> Viewer:
    """The caller of a page (a safe request): cookie or token; else sign in first."""
    return _viewer(request)


async def read_form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (the first value of each field),
    at most ``MAX_FORM_BYTES``. Parsed here: the multipart library is not needed."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise InvalidInput("send the form as application/x-www-form-urlencoded")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ContentTooLarge(f"a form is at most {MAX_FORM_BYTES} bytes")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=100)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput("the form could not be read") from exc
    form: dict[str, str] = {}
    for key, value in pairs:
        form.setdefault(key, value)
    return form


async def form_viewer(request: Request) -> tuple[Viewer, dict[str, str]]:
    """The form of an unsafe request and its caller, CSRF-checked (the ``_xsrf``
    field or the ``X-XSRFToken`` header) before anything is done with it."""
    try:
        form = await read_form(request)
    except DomainError as unreadable:  # no form, no field: the header alone must do
        await asyncio.to_thread(_viewer, request)
        raise unreadable
    return await asyncio.to_thread(_viewer, request, form.get(websessions.XSRF_FIELD)), form


def render(request: Request, me: Viewer | None, template: str, status: int = 200,
           **context: Any) -> HTMLResponse:
    html = ENV.get_template(template).render(me=me, path=request.url.path, **context)
    return HTMLResponse(html, status_code=status)


def redirect(url: str) -> RedirectResponse:
    """After a form: 303, so reloading the next page does not repeat the action."""
    return RedirectResponse(url, status_code=303)


def safe_next(value: str | None) -> str:
    """A same-site path to return to after signing in; anything else goes home
    (never an open redirect: no scheme, no ``//host``, no backslash, no control)."""
    if (not value or len(value) > 2000 or not value.startswith("/") or value.startswith("//")
            or "\\" in value or any(ord(char) < 32 or ord(char) == 127 for char in value)):
        return "/"
    return value


def sign_in_redirect(request: Request) -> RedirectResponse:
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    target = "/ui/login" if here == "/" else f"/ui/login?next={quote(here, safe='')}"
    return redirect(target)


def error_page(request: Request, status: int, detail: str, me: Viewer | None = None,
               headers: dict[str, str] | None = None) -> HTMLResponse:
    response = render(request, me, "error.html", status, title=TITLES.get(status, "Error"),
                      code=status, detail=detail)
    response.headers.update(headers or {})
    return response


class PageRoute(APIRoute):
    """A dashboard route: errors become readable pages (with the status the API
    would give), a caller who is not signed in is sent to sign in, and every
    answer carries the security headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def page(request: Request) -> Response:
            try:
                response = await handler(request)
            except SignInRequired:
                response = sign_in_redirect(request)
            except DomainError as exc:
                response = error_page(request, exc.status, exc.detail)
            except RequestValidationError as exc:
                first: dict[str, Any] = next(iter(exc.errors()), {})
                where = ".".join(str(part) for part in first.get("loc", ()))
                response = error_page(request, 422, f"{where}: {first.get('msg', 'invalid')}")
            except HTTPException as exc:
                response = error_page(request, exc.status_code, str(exc.detail))
            except DataError:
                response = error_page(request, 422, "the request holds a value that cannot be "
                                                    "stored")
            except Exception:
                log.exception("dashboard page %s failed", request.url.path)
                response = error_page(request, 500, "The page could not be shown. Try again; "
                                                    "if it persists, tell an operator.")
            for name, value in SECURITY_HEADERS.items():
                response.headers.setdefault(name, value)
            return response

        return page
