"""API keys: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on every endpoint
but /health and /version.

``[server] api_keys`` may use every model; each ``[[keys]]`` entry only the models it lists (any
other model answers 404, as if it did not exist). Keys are compared in constant time, against
every configured key, so timing tells nothing about how much of a key was right.
"""

from __future__ import annotations

import hmac

from .config import RouterConfig, resolve_secret
from .errors import APIError

OPEN_PATHS = frozenset({"/health", "/version"})


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class Keyring:
    """The configured keys and what each may reach."""

    def __init__(self, config: RouterConfig) -> None:
        self._keys: list[tuple[bytes, frozenset[str] | None]] = [
            (resolve_secret(k).encode(), None) for k in config.server.api_keys
        ]
        self._keys += [(resolve_secret(k.key).encode(), frozenset(k.models)) for k in config.keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def models_for(self, authorization: str | None) -> frozenset[str] | None:
        """The models this caller may use (None: all). Raises 401 without a valid key."""
        if not authorization:
            raise Unauthorized("Missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("The Authorization header must be `Bearer <key>`.")
        given = token.strip().encode()
        found: frozenset[str] | None | bool = False
        for key, models in self._keys:
            # No early exit: every key is compared, whatever matched.
            if hmac.compare_digest(given, key):
                found = models
        if found is False:
            raise Unauthorized("Incorrect API key provided.")
        return found  # type: ignore[return-value]
