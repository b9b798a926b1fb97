"""The raw ASGI request, read directly: one header, the request's own state, the body.

The generation endpoints are plain ASGI handlers (see :mod:`router.routes`); these are the few
things they need from the connection, each cheaper than building Litestar's ``Request`` and
``Headers`` for it.
"""

from __future__ import annotations

from typing import Any

from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.types import Receive, Scope

from .responses import ClientGone


def header(scope: Scope, name: bytes) -> str | None:
    """One request header, ``name`` in lower case (ASGI servers give names in lower case)."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def scope_state(scope: Scope) -> dict[str, Any]:
    """This request's own state (what ``request.state`` wraps) as the plain dict: Litestar builds
    a new ``State``, lock included, on every ``request.state``."""
    try:
        return scope["state"]  # type: ignore[typeddict-item]
    except KeyError:  # no lifespan state from the server
        state: dict[str, Any] = {}
        scope["state"] = state  # type: ignore[typeddict-unknown-key]
        return state


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body. 413 when it is announced (``Content-Length``) or turns out to be
    longer than ``limit`` bytes, before more of it is read; :class:`ClientGone` when the client
    leaves before sending all of it."""
    length = header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestEntityTooLarge()
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestEntityTooLarge()
        if not message.get("more_body", False):
            # The usual case: the whole body in one message.
            return b"".join((*chunks, chunk)) if chunks else chunk
        chunks.append(chunk)
