"""The one error shape of the API: {"error": {"code", "message", "type"}} with a fitting HTTP status.

Messages are written for clients: no tracebacks, no absolute paths.
"""
from __future__ import annotations

from flask import Response, jsonify

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "overloaded_error", 504: "timeout_error"}


class ApiError(Exception):
    """Raised anywhere inside a request; the app turns it into the JSON error response."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "type": _TYPES.get(self.status, "server_error")}}

    def response(self) -> Response:
        response = jsonify(self.body())
        response.status_code = self.status
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        return response


class QueueFull(ApiError):
    def __init__(self, retry_after: int) -> None:
        super().__init__(503, "queue_full", "the synthesis queue is full; retry later", retry_after)


class DeadlineExceeded(ApiError):
    def __init__(self) -> None:
        super().__init__(504, "deadline_exceeded", "the request waited longer than its deadline before work could start")


class NotReady(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "not_ready", "the voice is still loading; retry shortly", retry_after=2)


class ShuttingDown(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "shutting_down", "the service is stopping; retry shortly", retry_after=5)
