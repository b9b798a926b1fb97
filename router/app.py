"""The Litestar app: routes, API keys, request ids, the error envelope, model lifecycle.

``create_app`` builds everything an app needs (plugin manager, request types, backends) and keeps
it on ``app.state.router``, so tests can build an app with exactly the plugins they name.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import msgspec
from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp, Receive, Scope, Send

from .anthropic.errors import envelope as anthropic_envelope
from .anthropic.errors import is_anthropic_path
from .config import RouterConfig
from .errors import APIError, ErrorBody, ErrorEnvelope, ServerError
from .gctune import tune_for_serving
from .plugins import Plugins, load_plugins
from .responses import json_response
from .routes import GENERATION_PATHS, ROUTES, generation_response, identify, request_state
from .state import RouterState

log = logging.getLogger("router.app")
_encoder = msgspec.json.Encoder()


async def _before_request(request: Request) -> None:
    """Request id and API key check (:func:`router.routes.identify`) for Litestar's own handlers;
    the generation endpoints, plain ASGI handlers, call it themselves."""
    identify(request.scope)


def _headers(request: Request, extra: dict[str, str] | None = None) -> dict[str, str]:
    rid = request_state(request).get("request_id")
    return {**(extra or {}), **({"x-request-id": rid} if rid else {})}


# --- errors ---------------------------------------------------------------------------------

_HTTP_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def _envelope(request: Request, status: int, type_: str, message: str, param: str | None = None,
              code: str | int | None = None) -> bytes:
    """OpenAI's error envelope, or Anthropic's on Anthropic's paths."""
    if is_anthropic_path(request.url.path):
        return anthropic_envelope(status, type_, message)
    return _encoder.encode(ErrorEnvelope(ErrorBody(message, type_, param, code)))


def _api_error(request: Request, exc: APIError) -> Response[bytes]:
    body = _envelope(request, exc.status, exc.type, exc.message, exc.param, exc.code)
    return json_response(body, exc.status, _headers(request, exc.headers))


def _http_error(request: Request, exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    if status >= 500:
        return _server_error(request, exc)
    message = exc.detail or "Bad request"
    if status == 404:
        message = f"Not found: {request.method} {request.url.path}"
    elif status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    elif status == 413:
        message = "The request body is too large."
    body = _envelope(request, status, _HTTP_TYPES.get(status, "invalid_request_error"), message)
    return json_response(body, status, _headers(request, dict(exc.headers or {})))


def _server_error(request: Request, exc: Exception) -> Response[bytes]:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _api_error(request, ServerError("Internal server error."))


_EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}


class GenerationLane:
    """The app's ASGI handler with a fast lane: a POST to a generation endpoint goes straight to
    :func:`router.routes.generation_response`; everything else (those paths with another method
    or spelling too) goes through Litestar's exception middleware and router as before.

    Litestar's layers between its entry and a raw ASGI handler (the exception middleware, which
    wraps every ``send``; path resolution; the route's dispatch) cost about 14% of the CPU time
    of a relayed request. The lane answers errors with the app's own exception handlers;
    one raised after the response started propagates to the server, as it would through
    Litestar (a stream reports its own errors in-band)."""

    def __init__(self, inner: ASGIApp) -> None:
        self._inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = GENERATION_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self._inner(scope, receive, send)
            return
        try:
            response = await generation_response(scope, receive, endpoint)
        except Exception as exc:  # noqa: BLE001 - answered like Litestar's middleware would
            response = _error_response(scope, receive, send, exc)
        await response(scope, receive, send)


def _error_response(scope: Scope, receive: Receive, send: Send, exc: Exception) -> ASGIResponse:
    handler = next(h for cls in type(exc).__mro__ if (h := _EXCEPTION_HANDLERS.get(cls)) is not None)
    request: Request = Request(scope, receive, send)
    return handler(request, exc).to_asgi_response(app=None, request=request)  # type: ignore[arg-type]


# --- factory --------------------------------------------------------------------------------


def create_app(config: RouterConfig, plugins: Plugins | None = None, *, tune_gc: bool = False) -> Litestar:
    """Build the app for ``config`` with ``plugins`` (default: every installed plugin).
    ``tune_gc``: once every model has loaded, tune the cyclic GC for serving
    (:mod:`router.gctune`); the CLI's server does, an app embedded in another process does not."""
    plugins = plugins or load_plugins()
    state = RouterState(config, plugins)

    async def tune_when_loaded() -> None:
        await state.wait_ready()
        tune_for_serving()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await state.start()
        tuning = asyncio.create_task(tune_when_loaded()) if tune_gc else None
        try:
            yield
        finally:
            if tuning is not None:
                tuning.cancel()
            await state.stop()

    app = Litestar(
        route_handlers=[*ROUTES, *plugins.routes()],
        before_request=_before_request,
        exception_handlers=dict(_EXCEPTION_HANDLERS),
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=None,  # ours is built from the msgspec types: router/openapi.py
        debug=False,
        logging_config=None,  # the CLI configures logging; no second set of handlers
    )
    app.state.router = state
    app.asgi_handler = GenerationLane(app.asgi_handler)
    return app
