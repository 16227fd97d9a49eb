"""OpenAI-style errors: one exception type carried to one JSON body shape.

Every refused request answers ``{"error": {"message", "type", "param", "code"}}`` with a 4xx (5xx
for the server's own faults), as the OpenAI API does, so its clients raise their usual exceptions.
"""

from __future__ import annotations

from typing import Any

#: HTTP status -> the OpenAI error "type"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request the server refuses (or could not answer): status, one-line message, field name."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400 about ``param``."""
    return APIError(400, message, param, code)
