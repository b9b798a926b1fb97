"""The one error envelope every failure reaches a client in.

OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``. Code anywhere in the
router raises :class:`APIError` (or a subclass) with the field at fault; the app maps it, and
every other exception, onto this envelope, so no traceback ever reaches a client.
"""

from __future__ import annotations

import re

import msgspec


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class APIError(Exception):
    """An error a client can act on: an HTTP status, a message, the offending field."""

    status: int = 400
    type: str = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = headers or {}

    def envelope(self) -> ErrorEnvelope:
        return ErrorEnvelope(ErrorBody(self.message, self.type, self.param, self.code))

    def to_json(self) -> bytes:
        return _encoder.encode(self.envelope())


class BadRequest(APIError):
    status = 400


class ModelNotFound(APIError):
    status = 404

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


class Unavailable(APIError):
    """The model cannot take the request now: queue full, still loading, or down."""

    status = 503
    type = "service_unavailable"


class ServerError(APIError):
    status = 500
    type = "server_error"


_encoder = msgspec.json.Encoder()

# msgspec reports the path of a bad value as "- at `$.messages[0].role`".
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`")


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> BadRequest:
    """Turn a msgspec decode error into a 400 that names the field.

    An unknown field gets OpenAI's wording, ``Unrecognized request argument supplied: x``.
    """
    text = str(exc)
    path = None
    m = _PATH.search(text)
    if m:
        # Dict values show as "[...]": name the dict itself.
        path = m.group("path").replace("[...]", "") or None
        text = text[: m.start()]
    unknown = _UNKNOWN.match(text)
    if unknown:
        name = unknown.group("name")
        param = f"{path}.{name}" if path else name
        return BadRequest(f"Unrecognized request argument supplied: {param}", param=param)
    missing = _MISSING.match(text)
    if missing:  # the field that is not there is the one at fault
        name = missing.group("name")
        param = f"{path}.{name}" if path else name
        return BadRequest(f"Missing required field: {param}", param=param)
    if isinstance(exc, msgspec.ValidationError):
        where = f" at `{path}`" if path else ""
        return BadRequest(f"Invalid value{where}: {text}", param=path)
    return BadRequest(f"The request body is not valid JSON: {text}", param=None)
