"""Domain errors. The API maps each kind to one HTTP status in one place."""

from __future__ import annotations


class DomainError(Exception):
    status = 400
    code = "invalid_request"

    def __init__(
        self, message: str, *, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.headers = headers  # extra response headers (Retry-After)


class ValidationFailed(DomainError):
    status = 400
    code = "validation_error"


class NotFound(DomainError):
    status = 404
    code = "not_found"


class Conflict(DomainError):
    status = 409
    code = "conflict"


class QuotaExceeded(Conflict):
    """A tenant's quota (N2) refuses the change; ``field`` names the quota."""

    code = "quota_exceeded"


class Unauthorized(DomainError):
    status = 401
    code = "unauthorized"


class Forbidden(DomainError):
    status = 403
    code = "forbidden"


class PayloadTooLarge(DomainError):
    status = 413
    code = "payload_too_large"


class TooManyRequests(DomainError):
    """Refused for now (login throttling); ``retry_after_s`` goes out as Retry-After."""

    status = 429
    code = "too_many_requests"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s
