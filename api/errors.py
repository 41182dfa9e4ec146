"""The one error shape of the API: {"error": {"code", "message", "type"}} with a fitting HTTP status.

Device errors become HTTP errors through one table keyed by their machine-readable `code`, never by their
message text. Messages are written for clients: no tracebacks, no absolute paths.
"""
from __future__ import annotations

from flask import Response, jsonify

from cosyedge.device.errors import CosyedgeError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 414: "invalid_request_error",
          415: "invalid_request_error", 417: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error",
          500: "server_error", 503: "overloaded_error", 504: "timeout_error"}

# device error code -> (HTTP status, the API's error code). The API keeps its documented codes; only the
# generic `invalid_input` is answered as the API's long-standing `invalid_parameter`.
DEVICE_ERRORS: dict[str, tuple[int, str]] = {
    "error": (500, "internal_error"),
    "bundle_invalid": (500, "bundle_invalid"),
    "release_invalid": (500, "release_invalid"),
    "provider_unavailable": (503, "provider_unavailable"),
    "invalid_input": (400, "invalid_parameter"),
    "empty_text": (400, "empty_text"),
    "text_too_long": (413, "text_too_long"),
    "unknown_voice": (400, "unknown_voice"),
    "unknown_preset": (400, "unknown_preset"),
    "unknown_field": (400, "unknown_field"),
    "speed_out_of_range": (400, "speed_out_of_range"),
    "unknown_format": (400, "unknown_format"),
    "unsupported_sample_rate": (400, "unsupported_sample_rate"),
    "unknown_model": (400, "unknown_model"),
    "invalid_voice": (400, "invalid_voice"),
    "voice_name_reserved": (400, "voice_name_reserved"),
    "voice_exists": (409, "voice_exists"),
    "voice_not_found": (404, "voice_not_found"),
    "fixed_voices": (400, "fixed_voices"),
    "encoding_failed": (500, "encoding_failed"),
    "unsupported_option": (400, "unsupported_option"),
    "synthesis_failed": (500, "synthesis_failed"),
    "deadline_exceeded": (504, "deadline_exceeded"),
    "shutting_down": (503, "shutting_down"),
}


class ApiError(Exception):
    """Raised anywhere inside a request; the app turns it into the JSON error response."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after
        self.headers = dict(headers or {})

    @classmethod
    def from_device(cls, exc: CosyedgeError) -> "ApiError":
        """The HTTP answer to a device error, chosen by its class's code (unknown codes: 500, message hidden)."""
        status, code = DEVICE_ERRORS.get(type(exc).code, (500, "internal_error"))
        return cls(status, code, str(exc) if status < 500 or status == 503 else "internal error")

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "type": _TYPES.get(self.status, "server_error")}}

    def response(self) -> Response:
        response = jsonify(self.body())
        response.status_code = self.status
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        response.headers.update(self.headers)
        return response


class QueueFull(ApiError):
    def __init__(self, retry_after: int) -> None:
        super().__init__(503, "queue_full", "the synthesis queue is full; retry later", retry_after)


class NotReady(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "not_ready", "the voice is still loading; retry shortly", retry_after=2)


class ShuttingDown(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "shutting_down", "the service is stopping; retry shortly", retry_after=5)
