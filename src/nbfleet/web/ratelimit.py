"""Per-token rate limits for the REST API under ``/v1``.

A moving window (the ``limits`` library) counts each caller's requests: unlike a
fixed window it never lets a burst of twice the limit through across a window
edge, and the time until a request is let through again is known exactly, so
``Retry-After`` is honest. Callers are keyed by the SHA-256 of their token (the
raw token never reaches the storage, which may be a shared Redis), or by client
address when they send none.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass

import anyio.to_thread
from limits import RateLimitItem, parse_many
from limits.errors import ConfigurationError
from limits.storage import MemoryStorage, storage_from_string
from limits.strategies import MovingWindowRateLimiter
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nbfleet.web.problems import bearer_token, problem

logger = logging.getLogger(__name__)

#: Rate strings that turn rate limiting off.
OFF = ("", "0", "none", "off")


def parse_rate(rate: str) -> list[RateLimitItem]:
    """``"100/second;3000/minute"`` as limit items, all of which apply; ``[]`` for off.

    Raises ValueError naming the bad string, so a typo fails at startup.
    """
    if rate.strip().lower() in OFF:
        return []
    try:
        items = parse_many(rate)
    except ValueError as exc:
        raise ValueError(
            f"invalid rate limit {rate!r}: expected e.g. '100/second;3000/minute' "
            f"(or 0 or none to turn limits off)"
        ) from exc
    if not items or any(item.amount < 1 for item in items):
        raise ValueError(f"invalid rate limit {rate!r}: every amount must be at least 1")
    return items


def describe(item: RateLimitItem) -> str:
    """``5 per 1 second``, ``3000 per 10 minutes``."""
    unit = item.GRANULARITY.name + ("s" if item.multiples != 1 else "")
    return f"{item.amount} per {item.multiples} {unit}"


@dataclass(frozen=True)
class Verdict:
    """One request's outcome, described by the tightest of the limits."""

    allowed: bool
    item: RateLimitItem
    remaining: int
    reset_s: int  # seconds until the tightest window frees a slot


class ApiRateLimit:
    """The limits and their storage: ``memory://`` (per process) or e.g. ``redis://``
    (shared by every control-plane replica)."""

    def __init__(self, items: list[RateLimitItem], storage_url: str = "memory://") -> None:
        if not items:
            raise ValueError("no rate limit items (rate limiting is off)")
        self.items = items
        try:
            self.storage = storage_from_string(storage_url)
        except ConfigurationError as exc:
            raise ValueError(f"invalid rate limit storage {storage_url!r}: {exc}") from exc
        self.limiter = MovingWindowRateLimiter(self.storage)
        #: Network storage blocks: its calls run on a worker thread.
        self.blocking = not isinstance(self.storage, MemoryStorage)
        self.policy = ", ".join(f"{item.amount};w={item.get_expiry()}" for item in self.items)

    def check(self, key: str) -> Verdict:
        """Count one request for ``key`` unless some limit is exhausted.

        A refused request counts against no limit, so a client that keeps retrying
        is let back in exactly when Retry-After said.
        """
        stats = [(item, self.limiter.get_window_stats(item, "v1", key)) for item in self.items]
        refused = [(item, window) for item, window in stats if window.remaining < 1]
        if not refused:
            lost = [item for item in self.items if not self.limiter.hit(item, "v1", key)]
            # Non-empty only when a concurrent request took the last slot meanwhile.
            refused = [(item, window) for item, window in stats if item in lost]
        now = time.time()  # after the storage's own reads, so a fresh window says w, not w+1
        if refused:
            # Served again once every exhausted window has freed a slot.
            item, window = max(refused, key=lambda pair: pair[1].reset_time)
            return Verdict(False, item, 0, max(1, math.ceil(window.reset_time - now)))
        item, window = min(stats, key=lambda pair: (pair[1].remaining, -pair[1].reset_time))
        return Verdict(True, item, max(0, window.remaining - 1),
                       max(0, math.ceil(window.reset_time - now)))


def rate_limit(rate: str, storage_url: str = "memory://") -> ApiRateLimit | None:
    """The limit a rate string and storage URL describe, or None when it is off.

    Raises ValueError for a bad rate or storage, so callers can refuse to start.
    """
    items = parse_rate(rate)
    return ApiRateLimit(items, storage_url) if items else None


def token_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def caller_key(scope: Scope) -> str:
    """The SHA-256 of the caller's token (its ``Authorization`` header), else its
    address. Not ``?token=``: the HTTP API refuses tokens in URLs, so one names no
    caller (and a new one in each request must not buy a fresh window)."""
    token = bearer_token(Headers(scope=scope).get("authorization"))
    if token:
        return token_key(token)
    client = scope.get("client")
    return f"ip:{client[0] if client else 'unknown'}"


class RateLimitMiddleware:
    """Applies :class:`ApiRateLimit` to HTTP requests under ``/v1/``, the Kernel
    Gateway's HTTP calls included; not to agents' ``/internal``, ops endpoints,
    the docs, or WebSockets (a kernel's channels are one long connection).

    Should the storage fail (Redis down), requests are let through: a rate limiter
    must not take the API down with it. ``exempt`` holds caller keys that are the
    platform's own (the cluster secret's: agents metering usage for a whole host).
    """

    def __init__(self, app: ASGIApp, limit: ApiRateLimit, prefix: str = "/v1/",
                 exempt: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.limit = limit
        self.prefix = prefix
        self.exempt = exempt
        self._last_warning = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        key = caller_key(scope)
        if key in self.exempt:
            await self.app(scope, receive, send)
            return
        try:
            if self.limit.blocking:
                verdict = await anyio.to_thread.run_sync(self.limit.check, key)
            else:
                verdict = self.limit.check(key)
        except Exception:
            self._warn_storage_down()
            await self.app(scope, receive, send)
            return
        headers = self._headers(verdict)
        if not verdict.allowed:
            item = verdict.item
            who = "this token" if not key.startswith("ip:") else "this address"
            response = problem(
                429, "Too many requests",
                f"rate limit {describe(item)} exceeded for {who}; "
                f"retry in {verdict.reset_s} s",
                scope["path"],
            )
            response.headers.update(headers)
            response.headers["Retry-After"] = str(verdict.reset_s)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(headers)
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _headers(self, verdict: Verdict) -> dict[str, str]:
        return {
            "RateLimit-Limit": str(verdict.item.amount),
            "RateLimit-Remaining": str(verdict.remaining),
            "RateLimit-Reset": str(verdict.reset_s),
            "RateLimit-Policy": self.limit.policy,
        }

    def _warn_storage_down(self) -> None:
        now = time.monotonic()
        if now - self._last_warning > 60:
            self._last_warning = now
            logger.warning("rate limit storage failed; letting requests through",
                           exc_info=True)
