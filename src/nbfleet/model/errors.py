"""Domain errors. The API layer maps each one to an RFC 9457 problem."""

from __future__ import annotations


class DomainError(Exception):
    """Base class: ``status`` and ``title`` say how the API should answer."""

    status = 400
    title = "Bad request"

    def __init__(self, detail: str, **extra: object) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class NotFound(DomainError):
    status = 404
    title = "Not found"


class Conflict(DomainError):
    status = 409
    title = "Conflict"


class InvalidInput(DomainError):
    status = 422
    title = "Unprocessable content"


class ContentTooLarge(DomainError):
    """A request body, or a file, is larger than its route allows (RFC 9110's 413)."""

    status = 413
    title = "Content too large"


class Unauthorized(DomainError):
    status = 401
    title = "Unauthorized"


class Forbidden(DomainError):
    status = 403
    title = "Forbidden"


class Unavailable(DomainError):
    status = 503
    title = "Service unavailable"


class SuspendFailed(Unavailable):
    """A suspend could not save the workspace's state; the runtime is still running."""

    title = "Suspend failed"


class PaymentRequired(DomainError):
    """Credits or a budget refuse the work; ``reason`` in the problem says which."""

    status = 402
    title = "Payment required"
