"""Signing in with an API token, and out.

The sign-in form has CSRF protection of its own, although it only ever accepts a
valid token: without it another site could post *its* token and sign the victim's
browser in as the attacker ("login CSRF"), so that what the victim then uploads
lands in the attacker's workspace. GET ``/ui/login`` sets a random
``nbfleet_login`` cookie (HttpOnly, SameSite=Strict, Path=/ui/login) and puts the
same value in the form; the POST must carry both, equal, and an ``Origin`` (when
the browser sends one) naming this server. Another site can neither read the
cookie nor, SameSite=Strict, have it sent.

Failures answer "invalid token" and nothing more, whether the token never existed,
was revoked or was mistyped. Failed attempts are limited per client address
(``FAILURES``, counted in this process): over the limit every attempt from that
address, a correct token's too (checking it would let guessing go on), answers 429
with ``Retry-After`` until the window frees a slot. Successes never count, and
tokens carry 256 random bits, so the limit keeps noise and load down rather than
stopping a guess that could not succeed anyway.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import secrets
import time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from limits import parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from nbfleet.control import auth, deps, websessions
from nbfleet.control.dashboard.pages import (
    PageRoute,
    SignInRequired,
    read_form,
    redirect,
    render,
    safe_next,
    viewer,
)
from nbfleet.model.errors import DomainError, Forbidden

router = APIRouter(route_class=PageRoute)

LOGIN_COOKIE = "nbfleet_login"
LOGIN_COOKIE_PATH = "/ui/login"
FAILURES = parse("10/minute")
INVALID = "invalid token"
MAX_TOKEN_CHARS = 200


class _Limiter:
    """Failed sign-ins per client address, in this process's memory."""

    def __init__(self) -> None:
        self.limiter = MovingWindowRateLimiter(MemoryStorage())

    def retry_after(self, key: str) -> int:
        """Seconds until ``key`` may try again (0: now)."""
        if self.limiter.test(FAILURES, "signin", key):
            return 0
        reset = self.limiter.get_window_stats(FAILURES, "signin", key).reset_time
        return max(1, math.ceil(reset - time.time()))

    def failed(self, key: str) -> None:
        self.limiter.hit(FAILURES, "signin", key)


def _limiter(request: Request) -> _Limiter:
    state = request.app.state
    limiter: _Limiter | None = getattr(state, "signin_limiter", None)
    if limiter is None:
        limiter = state.signin_limiter = _Limiter()
    return limiter


def _form(request: Request, next_url: str, status: int = 200, error: str | None = None,
          notice: str | None = None, headers: dict[str, str] | None = None) -> HTMLResponse:
    """The sign-in page with a fresh login CSRF cookie and field."""
    nonce = secrets.token_urlsafe(32)
    response = render(request, None, "login.html", status, title="Sign in", nonce=nonce,
                      next_url=next_url, error=error, notice=notice)
    response.set_cookie(LOGIN_COOKIE, nonce, max_age=3600, path=LOGIN_COOKIE_PATH,
                        secure=deps.cookies_secure(request), httponly=True, samesite="strict")
    response.headers.update(headers or {})
    return response


@router.get("/ui/login")
def login_page(request: Request, next: str | None = None, done: str | None = None) -> Response:
    target = safe_next(next)
    if websessions.SESSION_COOKIE in request.cookies:
        try:
            viewer(request)
            return redirect(target)
        except SignInRequired:
            pass
    notice = "You are signed out." if done == "signed-out" else None
    return _form(request, target, notice=notice)


@router.post("/ui/login")
async def login(request: Request) -> Response:
    form = await read_form(request)
    target = safe_next(form.get("next"))
    nonce = request.cookies.get(LOGIN_COOKIE, "")
    presented = form.get(websessions.XSRF_FIELD, "")
    origin = request.headers.get("origin")
    if (not nonce or not hmac.compare_digest(nonce.encode(), presented.encode())
            or (origin is not None
                and not websessions.same_origin(origin, request.headers.get("host")))):
        return _form(request, target, 403, "This sign-in form expired or came from another "
                                            "site. Please try again.")
    client = request.client.host if request.client else "unknown"
    limiter = _limiter(request)
    wait = limiter.retry_after(client)
    if wait:
        return _form(request, target, 429, f"Too many failed attempts: try again in {wait} s.",
                     headers={"Retry-After": str(wait)})
    token = form.get("token", "").strip()
    platform = deps.platform_of(request)

    def check() -> auth.Principal | None:
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        with platform.db.transaction(write=False) as session:
            return auth.resolve_many(session, [token]).get(token)

    principal = await asyncio.to_thread(check)
    if principal is None:
        limiter.failed(client)
        return _form(request, target, 401, INVALID)
    old = request.cookies.get(websessions.SESSION_COOKIE)
    if old:  # a fresh secret every sign-in; the previous session ends
        await asyncio.to_thread(websessions.revoke, platform.db, old)
    started = await asyncio.to_thread(websessions.start, platform.db, platform.config.secret,
                                      principal.user_id)
    response = redirect(target)
    secure = deps.cookies_secure(request)
    websessions.set_cookies(response, started, secure,
                            int(websessions.SESSION_TTL.total_seconds()))
    response.delete_cookie(LOGIN_COOKIE, path=LOGIN_COOKIE_PATH, secure=secure,
                           httponly=True, samesite="strict")
    return response


@router.post("/ui/logout")
async def logout(request: Request) -> Response:
    """Revoke the session and clear both cookies. CSRF-checked without asking the
    database, so an expired session can still be cleared away."""
    try:
        form = await read_form(request)
    except DomainError:
        form = {}  # the X-XSRFToken header may still vouch for it
    platform = deps.platform_of(request)
    secret = request.cookies.get(websessions.SESSION_COOKIE)
    if secret:
        presented = (request.headers.get(websessions.XSRF_HEADER)
                     or form.get(websessions.XSRF_FIELD))
        if not websessions.xsrf_matches(platform.config.secret, secret, presented):
            raise Forbidden(websessions.XSRF_REFUSED)
        await asyncio.to_thread(websessions.revoke, platform.db, secret)
    response = redirect("/ui/login?done=signed-out")
    websessions.clear_cookies(response, deps.cookies_secure(request))
    return response
