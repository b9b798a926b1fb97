"""``cache_salt`` (vLLM's name): a request's prefix-cache entries are shared only with requests
carrying the same salt.

A shared prefix cache answers a repeated prompt faster, and that difference in time tells a
client whether someone else sent the same prefix before. With a salt, a request neither finds nor
leaves cache entries that a request without it (or with another) can find. vLLM advises a random,
secret salt of about 256 bits (43 base64 characters) per user or tenant.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("cache_salt", Annotated[str, Meta(min_length=1)] | None, None,
                     description="Share prefix-cache entries only with requests carrying the same salt."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    if request.cache_salt is not None:
        params.cache_salt = request.cache_salt
        params.require("cache_salt", "cache_salt")
