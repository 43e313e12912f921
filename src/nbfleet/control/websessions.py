"""Browser sign-in sessions and their CSRF token.

A browser signs in once with an API token and from then on carries two cookies:

- ``nbfleet_session``: 256 random bits, HttpOnly (page scripts never see it),
  SameSite=Lax, Secure over https or always (``--secure-cookies``). Only its
  SHA-256 is stored (``web_sessions``), so a copy of the database signs nobody in;
  the secret is high-entropy, so an unsalted fast hash is enough, and the
  per-request check is one lookup on a unique index.
- ``_xsrf``: HMAC-SHA256(cluster secret, session secret), readable by scripts. A
  cookie-authenticated request that changes anything must send it back in the
  ``X-XSRFToken`` header (what JupyterLab's frontend does with a cookie of this
  name) or an ``_xsrf`` form field. Another site can make the browser send the
  cookies but cannot read them, so it cannot forge the header or the field. The
  value is derived rather than stored: no second column, and it dies with the
  session. Requests carrying an API token need none: a token is never sent
  implicitly by a browser.

Sessions last ``SESSION_TTL`` by the DB clock; signing out revokes the row.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session
from starlette.responses import Response

from nbfleet.control.auth import Principal
from nbfleet.db.engine import Database, rows_affected
from nbfleet.db.ids import new_id
from nbfleet.db.tables import User, WebSession
from nbfleet.model.errors import Forbidden, Unauthorized

SESSION_COOKIE = "nbfleet_session"
XSRF_COOKIE = "_xsrf"
XSRF_HEADER = "x-xsrftoken"
XSRF_FIELD = "_xsrf"
SESSION_TTL = timedelta(hours=12)
#: Methods that change nothing, so need no CSRF token; every other one does.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Longer than any secret this module issues: refused before hashing or querying.
MAX_SECRET_CHARS = 100

SIGNED_OUT = "not signed in: sign in again, or send 'Authorization: Bearer <token>'"
XSRF_REFUSED = ("missing or wrong XSRF token: a request signed in by cookie must send the "
                "_xsrf cookie's value in the X-XSRFToken header or an _xsrf form field")


@dataclass(frozen=True, slots=True)
class Started:
    """A new session: what goes into the cookies, and until when."""

    secret: str
    xsrf: str
    expires_at: datetime


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def xsrf_token(cluster_secret: str, session_secret: str) -> str:
    """The CSRF token bound to one session (hex HMAC-SHA256 keyed by the cluster secret)."""
    return hmac.new(cluster_secret.encode(), session_secret.encode(), hashlib.sha256).hexdigest()


def xsrf_matches(cluster_secret: str, session_secret: str, presented: str | None) -> bool:
    """Constant-time check of a presented CSRF token (on bytes: a non-ASCII str would
    make ``compare_digest`` raise)."""
    if not presented or len(presented) > 128:
        return False
    expected = xsrf_token(cluster_secret, session_secret)
    return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "replace"))


def start(db: Database, cluster_secret: str, user_id: str) -> Started:
    """Open a session for ``user_id`` (already authenticated by its token)."""
    secret = secrets.token_urlsafe(32)  # 256 bits
    with db.transaction() as session:
        now = db.now(session)
        expires = now + SESSION_TTL
        session.add(WebSession(id=new_id("wsn"), user_id=user_id,
                               session_hash=hash_secret(secret), created_at=now,
                               expires_at=expires, revoked_at=None))
    return Started(secret, xsrf_token(cluster_secret, secret), expires)


def resolve(session: Session, now: datetime, secret: str | None) -> Principal | None:
    """The principal of a live (unrevoked, unexpired) session, or None."""
    if not secret or len(secret) > MAX_SECRET_CHARS:
        return None
    row = session.execute(
        select(User.id, User.org_id, User.project_id, User.is_admin)
        .join(WebSession, WebSession.user_id == User.id)
        .where(WebSession.session_hash == hash_secret(secret),
               WebSession.revoked_at.is_(None), WebSession.expires_at > now)
    ).first()
    return Principal(row[0], row[1], row[2], bool(row[3])) if row is not None else None


def revoke(db: Database, secret: str | None) -> bool:
    """End the session (signing out); True if a live one was revoked."""
    if not secret or len(secret) > MAX_SECRET_CHARS:
        return False
    with db.transaction() as session:
        result = session.execute(
            update(WebSession)
            .where(WebSession.session_hash == hash_secret(secret),
                   WebSession.revoked_at.is_(None))
            .values(revoked_at=db.now(session)))
        return rows_affected(result) > 0


def purge_expired(db: Database, older_than: timedelta = timedelta(days=1),
                  limit: int = 1000) -> int:
    """Delete up to ``limit`` sessions that expired over ``older_than`` ago (a revoked
    one expires within ``SESSION_TTL`` too); for a housekeeping loop. Returns how many
    went. ``expires_at`` is not indexed: this is a periodic scan, never a request's."""
    with db.transaction() as session:
        cutoff = db.now(session) - older_than
        ids = list(session.execute(
            select(WebSession.id).where(WebSession.expires_at < cutoff).limit(limit)
        ).scalars())
        if ids:
            session.execute(delete(WebSession).where(WebSession.id.in_(ids)))
        return len(ids)


def authenticate(db: Database, cluster_secret: str, cookies: Mapping[str, str], method: str,
                 presented_xsrf: str | None) -> Principal:
    """The principal of a request signed in by cookie. An unsafe method without the
    session's CSRF token is refused (403) before the database is asked; no live
    session is 401."""
    secret = cookies.get(SESSION_COOKIE)
    if not secret:
        raise Unauthorized(SIGNED_OUT)
    if method.upper() not in SAFE_METHODS and not xsrf_matches(cluster_secret, secret,
                                                               presented_xsrf):
        raise Forbidden(XSRF_REFUSED)
    with db.transaction(write=False) as session:
        principal = resolve(session, db.now(session), secret)
    if principal is None:
        raise Unauthorized("session expired or signed out: sign in again")
    return principal


def same_origin(origin: str | None, host: str | None) -> bool:
    """Whether an ``Origin`` header names the host and port of the ``Host`` header
    (ports defaulted by the Origin's scheme). ``null`` and anything unparsable are
    foreign."""
    if not origin or not host:
        return False
    seen = urlsplit(origin)
    if seen.scheme not in ("http", "https") or not seen.hostname:
        return False
    default = 443 if seen.scheme == "https" else 80
    ours = urlsplit("//" + host)
    try:
        return bool(ours.hostname) and (seen.hostname.lower(), seen.port or default) == (
            (ours.hostname or "").lower(), ours.port or default)
    except ValueError:  # a port that is not a number, or out of range
        return False


def set_cookies(response: Response, started: Started, secure: bool, max_age: int) -> None:
    """Both cookies, Path=/ so JupyterLab under ``/w/`` reads ``_xsrf`` too."""
    response.set_cookie(SESSION_COOKIE, started.secret, max_age=max_age, path="/",
                        secure=secure, httponly=True, samesite="lax")
    response.set_cookie(XSRF_COOKIE, started.xsrf, max_age=max_age, path="/",
                        secure=secure, httponly=False, samesite="lax")


def clear_cookies(response: Response, secure: bool) -> None:
    for name, http_only in ((SESSION_COOKIE, True), (XSRF_COOKIE, False)):
        response.delete_cookie(name, path="/", secure=secure, httponly=http_only,
                               samesite="lax")
