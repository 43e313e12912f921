"""What the control plane tells browsers, and keeps out of its logs.

- **JupyterLab's headers** (``LAB_HEADERS``). Lab runs on the control plane's origin
  under Jupyter's trust model: the output of a cell the user ran may run script,
  and that script acts with the user's session, as it does in Jupyter. The policy
  does not pretend otherwise (scripts may be inline or evaluated: Lab's settings
  validator compiles schemas with ``Function`` and its JavaScript renderer calls
  ``eval``). What it does enforce: no page of another site may frame Lab
  (clickjacking), scripts, styles, fonts, frames, workers and every connection
  (``fetch``, XHR, WebSocket, EventSource, beacons) go to this server only, forms
  post only here, no ``<base>`` may re-point Lab's relative URLs elsewhere, and no
  plugin (``<object>``, ``<embed>``) loads. Images may come from any ``https:`` site
  (notebooks' Markdown links them) and from ``data:``/``blob:`` (plots).
- **Secure cookies** (``SECURE_COOKIES``): "auto" marks cookies ``Secure`` when the
  request came over https, which uvicorn also decides from ``X-Forwarded-Proto``
  sent by a proxy it trusts (``FORWARDED_ALLOW_IPS``, default 127.0.0.1); "always"
  marks them ``Secure`` whatever the request says, for a TLS proxy that is not
  trusted or sends no such header.
- **Credentials in URLs are never logged** (:func:`redact_server_logs`): uvicorn's
  access log and its WebSocket lines print the path with its query string, which
  may hold ``?token=`` (kernel WebSockets accept one) or a channel ticket
  (``/t/{ticket}/...``), and at debug level the websockets library prints each
  handshake header (a cookie, a token, the cluster secret). Their values are
  replaced before anything is written.

Standard library only: the CLI reads ``SECURE_COOKIES`` without the server stack.
"""

from __future__ import annotations

import logging
import re

#: ``--secure-cookies``: its values and its default, declared once.
SECURE_COOKIES = ("auto", "always")
SECURE_COOKIES_DEFAULT = "auto"


def cookies_secure(mode: str, scheme: str) -> bool:
    """Whether cookies set in answer to a request of ``scheme`` get ``Secure``."""
    return mode == "always" or scheme == "https"


LAB_CSP = "; ".join((
    "default-src 'self'",
    "script-src 'self' 'unsafe-inline' 'unsafe-eval'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data: blob: https:",
    "font-src 'self' data:",
    "media-src 'self' data: blob:",
    "connect-src 'self'",
    "worker-src 'self' blob:",
    "frame-src 'self' data: blob:",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'self'",
))

#: Sent with JupyterLab's page. ``X-Frame-Options`` for browsers that predate
#: ``frame-ancestors``; the referrer never carries a workspace's paths elsewhere.
LAB_HEADERS = {
    "Content-Security-Policy": LAB_CSP,
    "X-Frame-Options": "SAMEORIGIN",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

REDACTED = "[redacted]"
#: A credential's value in a query string (``token``, and Lab's ``_xsrf`` on
#: download links), and a channel ticket: the first segment after ``/t/``.
_QUERY_SECRET = re.compile(r"([?&](?:token|_xsrf)=)[^&#\s\"']*", re.IGNORECASE)
_TICKET = re.compile(r"(^|[\s\"'])/t/[^/?#\s\"']+")


def redact(text: str) -> str:
    """``text`` with the values of credentials in URLs replaced by ``[redacted]``."""
    if "=" in text:
        text = _QUERY_SECRET.sub(rf"\g<1>{REDACTED}", text)
    if "/t/" in text:
        text = _TICKET.sub(rf"\g<1>/t/{REDACTED}", text)
    return text


#: Headers whose values are credentials. At debug level the websockets library
#: logs every handshake header as ``"< %s: %s"`` (received) or ``"> %s: %s"`` (sent):
#: a browser's session cookie, a client's token, and the cluster secret the
#: control plane sends to an agent's kernel channels.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie",
                            "x-xsrftoken"})
_HEADER_LINES = frozenset({"< %s: %s", "> %s: %s"})


class RedactCredentials(logging.Filter):
    """Rewrites a record's message and string arguments with :func:`redact`, and
    hides the value of a handshake header in :data:`SECRET_HEADERS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (record.msg in _HEADER_LINES and isinstance(args, tuple) and len(args) == 2
                and str(args[0]).lower() in SECRET_HEADERS):
            record.args = (args[0], REDACTED)
            return True
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(args, tuple):
            record.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in args)
        return True


#: The loggers that print request paths or headers: uvicorn's access log, its
#: error log (``"WebSocket /path?query" [accepted]``, and the handshakes the
#: websockets library logs through it), and that library's own client and server.
SERVER_LOGGERS = ("uvicorn.access", "uvicorn.error", "websockets.client",
                  "websockets.server")


def redact_server_logs() -> None:
    """Put a :class:`RedactCredentials` on :data:`SERVER_LOGGERS` (once each). A
    filter on a logger sees only what is logged to that logger itself, which is
    where these lines are logged."""
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(found, RedactCredentials) for found in logger.filters):
            logger.addFilter(RedactCredentials())
