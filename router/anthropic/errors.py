"""Anthropic's error envelope, on its paths only:
``{"type": "error", "error": {"type": "invalid_request_error" | ..., "message": ...}}``."""

from __future__ import annotations

import msgspec

from .protocol import ErrorDetail, ErrorResponse

PATH_PREFIX = "/v1/messages"
"""The paths whose errors take Anthropic's envelope (``/v1/messages`` and its ``count_tokens``)."""

BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
BY_OPENAI_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "service_unavailable": "overloaded_error",
    "server_error": "api_error",
}

_encode = msgspec.json.Encoder().encode


def error_type(status: int | None, openai_type: str | None) -> str:
    """Anthropic's error type for an HTTP status (where known) or our OpenAI-shaped error's type."""
    if status is not None and status in BY_STATUS:
        return BY_STATUS[status]
    return BY_OPENAI_TYPE.get(openai_type or "", "api_error")


def envelope(status: int, openai_type: str | None, message: str) -> bytes:
    return _encode(ErrorResponse(error=ErrorDetail(error_type(status, openai_type), message)))


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")
