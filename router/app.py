"""The Litestar app: routes, the error envelope, model lifecycle.

``create_app`` builds everything an app needs (plugin manager, request types, backends) and keeps
it on ``app.state.router``, so tests can build an app with exactly the plugins they name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable

import msgspec

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse

from . import __version__, sse
from .backend import Backend, Reply
from .config import RouterConfig
from .errors import APIError, ErrorBody, ErrorEnvelope, ModelNotFound, ServerError
from .plugins import Plugins, load_plugins
from .protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from .requests import RequestTypes, chat_params, completion_params, compose, decode_body

log = logging.getLogger("router.app")


class RouterState:
    """Everything one app serves: config, plugins, request types and the models."""

    def __init__(self, config: RouterConfig, plugins: Plugins) -> None:
        self.config = config
        self.plugins = plugins
        self.types: RequestTypes = compose(plugins.request_fields())
        self.models: dict[str, Backend] = {
            m.name: plugins.backends[m.backend](m, config.base_dir) for m in config.models
        }
        self.created = int(time.time())
        self._loading: list[asyncio.Task[None]] = []

    def model(self, name: str) -> Backend:
        backend = self.models.get(name)
        if backend is None:
            raise ModelNotFound(name)
        return backend

    async def start(self) -> None:
        """Start loading every model in the background; /health says when they are ready."""
        for backend in self.models.values():
            self._loading.append(asyncio.create_task(self._start(backend)))

    async def _start(self, backend: Backend) -> None:
        t0 = time.monotonic()
        try:
            await backend.start()
        except Exception as exc:  # noqa: BLE001 - one broken model must not stop the others
            backend.state = "failed"
            backend.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to load: %s", backend.name, backend.error)
        else:
            log.info("model %s (%s) ready in %.1fs", backend.name, backend.config.backend, time.monotonic() - t0)

    async def wait_ready(self) -> None:
        await asyncio.gather(*self._loading, return_exceptions=True)

    async def stop(self) -> None:
        for task in self._loading:
            task.cancel()
        await asyncio.gather(*self._loading, return_exceptions=True)
        for backend in self.models.values():
            try:
                await backend.stop()
            except Exception:  # noqa: BLE001
                log.exception("model %s did not stop cleanly", backend.name)


def _state(request: Request) -> RouterState:
    return request.app.state.router


# --- responses ------------------------------------------------------------------------------


class _ClosingStreamingResponse(ASGIStreamingResponse):
    """Closes the event iterator as soon as the response ends, disconnects included, so the
    engine frees the request at once rather than whenever the generator is collected."""

    __slots__ = ()

    async def send_body(self, send: Any, receive: Any) -> None:
        try:
            await super().send_body(send, receive)
        finally:
            aclose = getattr(self.iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class EventStream(Stream):
    """``text/event-stream`` of pre-framed ``data: ...`` events."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type=sse.MEDIA_TYPE, headers=dict(sse.HEADERS))

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIStreamingResponse:
        response = super().to_asgi_response(*args, **kwargs)
        response.__class__ = _ClosingStreamingResponse
        return response


def _json(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(content=body, status_code=status, media_type="application/json", headers=headers)


def _reply(reply: Reply) -> Response[Any]:
    if isinstance(reply, bytes):
        return _json(reply)
    return EventStream(reply)


async def _unless_disconnected(request: Request, work: Awaitable[Reply]) -> Reply:
    """Run a non-streaming request, abandoning it (and its engine work) if the client leaves."""
    task = asyncio.ensure_future(work)
    receive = request.receive

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise APIError("Client disconnected.", status=499, type="client_closed_request")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


# --- handlers -------------------------------------------------------------------------------


async def _generate(request: Request, endpoint: str) -> Response[Any]:
    state = _state(request)
    body = await request.body()
    if endpoint == "chat":
        req = state.types.decode_chat(body)
        params = chat_params(req)
    else:
        req = state.types.decode_completions(body)
        params = completion_params(req)
    backend = state.model(req.model)
    backend.check_ready()
    state.plugins.pm.hook.prepare_request(
        request=req, model=backend.info, params=params, endpoint=endpoint
    )
    _check_response_format(req, params)
    params.check_capabilities(backend.name, backend.config.backend, backend.capabilities)
    call = backend.chat if endpoint == "chat" else backend.complete
    if params.stream:
        return _reply(await call(req, params))
    return _reply(await _unless_disconnected(request, call(req, params)))


def _check_response_format(req: Any, params: Any) -> None:
    """A JSON response_format is only honoured through a structured-outputs plugin; without
    one loaded it must not be silently ignored."""
    fmt = getattr(req, "response_format", None)
    if fmt is not None and type(fmt).__struct_config__.tag != "text" and params.constraint is None:
        raise APIError(
            "response_format other than `text` needs the structured_outputs plugin, which is not loaded.",
            param="response_format",
        )


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response[Any]:
    """OpenAI chat completions, streamed (SSE) or not."""
    return await _generate(request, "chat")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response[Any]:
    """OpenAI (legacy) text completions, streamed (SSE) or not."""
    return await _generate(request, "completions")


def _card(state: RouterState, backend: Backend) -> ModelCard:
    return ModelCard(
        id=backend.name,
        created=state.created,
        owned_by=backend.config.owned_by,
        max_model_len=backend.max_model_len,
        backend=backend.config.backend,
        ready=backend.ready,
    )


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def _vocabulary(request: Request, decoder: msgspec.json.Decoder, method: str) -> Response[bytes]:
    req = decode_body(decoder, await request.body())
    backend = _state(request).model(req.model)
    backend.check_ready()
    return _json(await getattr(backend, method)(req))


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> Response[bytes]:
    """vLLM's ``/tokenize``: the token ids (and strings) a prompt or chat becomes."""
    return await _vocabulary(request, _tokenize_decoder, "tokenize")


@post("/detokenize", status_code=200)
async def detokenize(request: Request) -> Response[bytes]:
    """vLLM's ``/detokenize``: token ids back to text."""
    return await _vocabulary(request, _detokenize_decoder, "detokenize")


@get("/v1/models")
async def list_models(request: Request) -> Response[bytes]:
    """Every configured model, ready or not (see ``ready``)."""
    state = _state(request)
    return _json(_encoder.encode(ModelList(data=[_card(state, b) for b in state.models.values()])))


@get("/v1/models/{model_id:path}")
async def get_model(request: Request) -> Response[bytes]:
    """One model's card (model ids may contain slashes)."""
    state = _state(request)
    model_id = str(request.path_params["model_id"]).lstrip("/")
    return _json(_encoder.encode(_card(state, state.model(model_id))))


@get("/health")
async def health(request: Request) -> Response[bytes]:
    """200 once every model is ready; 503 naming each model that is not, and why."""
    state = _state(request)
    models = {b.name: b.status() for b in state.models.values()}
    waiting = [f"{n} ({m['state']}{': ' + m['error'] if 'error' in m else ''})" for n, m in models.items() if m["state"] != "ready"]
    if not waiting:
        return _json(_encoder.encode({"status": "ok", "models": models}))
    error = ErrorBody(
        message="Not ready: " + "; ".join(waiting), type="service_unavailable", code="not_ready"
    )
    return _json(_encoder.encode({"error": error, "models": models}), status=503)


@get("/version")
async def version() -> Response[bytes]:
    """The router's version."""
    return _json(_encoder.encode({"version": __version__}))


# --- errors ---------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()

_HTTP_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def _api_error(request: Request, exc: APIError) -> Response[bytes]:
    return _json(exc.to_json(), exc.status, exc.headers or None)


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
    body = ErrorEnvelope(ErrorBody(message, _HTTP_TYPES.get(status, "invalid_request_error")))
    return _json(_encoder.encode(body), status, dict(exc.headers or {}) or None)


def _server_error(request: Request, exc: Exception) -> Response[bytes]:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(ServerError("Internal server error.").to_json(), 500)


# --- factory --------------------------------------------------------------------------------


def create_app(config: RouterConfig, plugins: Plugins | None = None) -> Litestar:
    """Build the app for ``config`` with ``plugins`` (default: every installed plugin)."""
    plugins = plugins or load_plugins()
    state = RouterState(config, plugins)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = Litestar(
        route_handlers=[
            chat_completions, completions, tokenize, detokenize,
            list_models, get_model, health, version, *plugins.routes(),
        ],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        lifespan=[lifespan],
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="router", version=__version__, path="/schema"),
        debug=False,
        logging_config=None,  # the CLI configures logging; no second set of handlers
    )
    app.state.router = state
    return app
