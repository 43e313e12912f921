"""Prometheus metrics shared by the control plane and agents, and the HTTP timer."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HTTP_SECONDS = Histogram(
    "nbfleet_http_request_duration_seconds",
    "HTTP request latency, by route template",
    ["app", "method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
WORKSPACE_TRANSITIONS = Counter(
    "nbfleet_workspace_transitions_total", "Workspace state changes", ["from_state", "to_state"]
)
CREDIT_BUDGET_ALERTS = Counter(
    "nbfleet_credit_budget_alerts_total", "Soft budget limits crossed", ["level"]
)
JOB_TRANSITIONS = Counter(
    "nbfleet_job_transitions_total", "Job state changes", ["from_state", "to_state"]
)
JOB_ATTEMPTS = Counter(
    "nbfleet_job_attempts_total", "Job attempts ended, by outcome", ["outcome"]
)
JOB_DISPATCH = Counter(
    "nbfleet_job_dispatch_total", "Dispatcher decisions", ["decision"]
)
JOB_INTAKE_BATCH = Histogram(
    "nbfleet_job_intake_batch_size", "Job submissions admitted per transaction",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
CREDIT_DECISIONS = Counter(
    "nbfleet_credit_decisions_total", "Credit ledger decisions", ["action", "outcome"]
)


def metrics_response() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


class TimingMiddleware:
    """Times each HTTP request under its route template (never the raw path, whose
    ids would make one time series per workspace)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.name = name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            HTTP_SECONDS.labels(self.name, scope["method"], route, str(status)).observe(
                time.perf_counter() - started
            )
