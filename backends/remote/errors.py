"""Every error shape an upstream answers in, turned into the router's one envelope.

Shapes seen in the wild:

- OpenAI, vLLM, llama.cpp's llama-server, this router:
  ``{"error": {"message", "type", "param", "code"}}`` (``code`` a string or the HTTP status);
- vLLM before 0.6 and TensorRT-LLM's trtllm-serve:
  ``{"object": "error", "message", "type", "param", "code": 400}``;
- TensorRT-LLM and older llama.cpp paths: ``{"error": "<string>"}``;
- FastAPI (llama-cpp-python's server, auth failures): ``{"detail": "<string>"}`` or
  ``{"detail": [{"loc": [...], "msg": "..."}]}``;
- ``{"message": "..."}`` from gateways, and plain text or HTML (a proxy's 502 page, an empty body).
"""

from __future__ import annotations

from typing import Any

import re

import msgspec

from router.errors import APIError, ErrorBody

_decode = msgspec.json.Decoder().decode
_SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")

STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}

RETRYABLE_4XX = frozenset({408, 429})
"""Client-error statuses that say "not now" rather than "not this request": fail over."""

MAX_TEXT = 500
"""How much of a non-JSON error body reaches the client."""


def _type_for(status: int | None) -> str:
    if status is None:
        return "server_error"
    if status in STATUS_TYPES:
        return STATUS_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def _type(value: Any, status: int | None) -> str:
    """OpenAI-style ``snake_case`` types pass; exception class names (``BadRequestError``,
    vLLM and TensorRT-LLM) become the type OpenAI uses for the status."""
    if isinstance(value, str) and _SNAKE.match(value):
        return value
    return _type_for(status)


def _code(value: Any) -> str | int | None:
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _param(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if value is None:
        return None
    return msgspec.json.encode(value).decode()


def _detail(detail: Any) -> str:
    """FastAPI's ``detail``: a string, or a list of pydantic errors."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(x) for x in item.get("loc", ()) if x != "body")
                msg = item.get("msg") or _text(item)
                parts.append(f"{loc}: {msg}" if loc else str(msg))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return _text(detail) or ""


def _body(message: str, fields: dict[str, Any], status: int | None) -> ErrorBody:
    code = _code(fields.get("code"))
    if status is None:
        status = _status(code)
    return ErrorBody(message, _type(fields.get("type"), status), _param(fields.get("param")), code)


def body_from_json(obj: Any, status: int | None) -> ErrorBody | None:
    """The error an already decoded upstream JSON value carries, or None if it is none."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        message = _text(err.get("message")) or _text(err.get("msg")) or _text(err) or ""
        return _body(message, err, status)
    if isinstance(err, str):
        return _body(err, obj, status)
    if obj.get("object") == "error" or ("message" in obj and "choices" not in obj):
        return _body(_text(obj.get("message")) or "", obj, status)
    if "detail" in obj:
        return ErrorBody(message=_detail(obj["detail"]), type=_type_for(status))
    return None


def error_body(status: int, content: bytes) -> ErrorBody:
    """The error in an upstream's non-2xx response body, whatever its shape."""
    try:
        obj = _decode(content) if content.strip() else None
    except msgspec.DecodeError:
        obj = None
    body = body_from_json(obj, status)
    if body is None:
        text = content.decode("utf-8", "replace").strip()
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT] + "..."
        body = ErrorBody(message=text or f"HTTP {status}", type=_type_for(status))
    if not body.message:
        body.message = f"HTTP {status}"
    return body


def client_error(status: int, body: ErrorBody) -> APIError:
    """An upstream's 4xx, relayed with the upstream's status, message, type, param and code."""
    return APIError(body.message, status=status, type=body.type, param=body.param, code=body.code)


def blames_request(status: int | None) -> bool:
    """True for a 4xx that is the request's fault: relayed to the client, never retried."""
    return status is not None and 400 <= status < 500 and status not in RETRYABLE_4XX


def status_of(body: ErrorBody) -> int | None:
    """The HTTP status an in-stream error names in its ``code`` (TensorRT-LLM, vLLM), if any."""
    return _status(body.code)


def _status(code: str | int | None) -> int | None:
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and 400 <= code <= 599:
        return code
    return None
