"""The HTTP endpoints: small handlers over :class:`router.state.RouterState`."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator

import msgspec
from litestar import Request, Response, asgi, get, post
from litestar.exceptions import MethodNotAllowedException
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Scope, Send

from . import __version__, sse
from .anthropic.door import MessagesDoor
from .anthropic.protocol import CountTokensResponse
from .auth import OPEN_PATHS
from .backend import AdapterModel, Backend
from .connection import header, read_body, scope_state
from .embeddings import EmbeddingRequest
from .errors import APIError, BadRequest, ErrorBody
from .protocol import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    ModelName,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from .requests import chat_params, check_limits, completion_params, decode_body
from .responses import DisconnectWatch, Relay, event_stream, json_reply, json_response, unless_disconnected
from .state import RouterState
from .telemetry import RequestRecord, new_request_id, request_id

_encoder = msgspec.json.Encoder()


def router_state(scope: Scope) -> RouterState:
    # Item access: Litestar's ``State`` serves attributes from ``__getattr__``, which runs only
    # after a failed normal lookup (an AttributeError built and dropped: 1.7 us against 0.2).
    return scope["litestar_app"].state["router"]


def state_of(request: Request) -> RouterState:
    return router_state(request.scope)


def request_state(request: Request) -> dict[str, Any]:
    return scope_state(request.scope)


def identify(scope: Scope, state: RouterState | None = None) -> None:
    """The first step of every request: its id (``X-Request-Id`` honoured) into every log line;
    the API key check (401 without a valid key; the models the key may use otherwise)."""
    rid = new_request_id(header(scope, b"x-request-id"))
    own = scope_state(scope)
    own["request_id"] = rid
    request_id.set(rid)
    keyring = (state or router_state(scope)).keyring
    if keyring.enabled and scope["path"] not in OPEN_PATHS:
        given = header(scope, b"authorization")
        if given is None and (key := header(scope, b"x-api-key")):  # Anthropic's clients' header
            given = f"Bearer {key}"
        own["allowed_models"] = keyring.models_for(given)


def _allowed(request: Request) -> frozenset[str] | None:
    return request_state(request).get("allowed_models")


def _rid_header(request: Request) -> dict[str, str]:
    return {"x-request-id": request_state(request)["request_id"]}


# --- generation -----------------------------------------------------------------------------


async def _generation_endpoint(scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
    """A generation endpoint as a raw ASGI handler inside Litestar's routing and exception
    handling: Litestar's own handler machinery (request object, signature model, response
    conversion, hooks) cost about 120 us a request, a quarter of a relayed request's time."""
    if scope["method"] != "POST":
        if scope["method"] == "OPTIONS":  # what Litestar answers on its own routes
            await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", b"OPTIONS, POST")]})
            await send({"type": "http.response.body", "body": b""})
            return
        raise MethodNotAllowedException(headers={"Allow": "POST, OPTIONS"})
    response = await generation_response(scope, receive, endpoint)
    await response(scope, receive, send)


async def generation_response(scope: Scope, receive: Receive, endpoint: str) -> ASGIResponse:
    """The response to a POST to a generation endpoint (``chat`` or ``completions``): an error
    before anything is sent raises (:class:`APIError` or Litestar's ``HTTPException``)."""
    state = router_state(scope)
    identify(scope, state)
    return await _generate(state, scope, receive, endpoint)


async def _generate(state: RouterState, scope: Scope, receive: Receive, endpoint: str) -> ASGIResponse:
    server = state.config.server
    own = scope_state(scope)
    rid = own["request_id"]
    door = MessagesDoor(state, own.get("allowed_models")) if endpoint == "messages" else None
    record = RequestRecord(state.metrics, rid, endpoint, log_content=server.log_content)
    body = b""
    lease = None
    try:
        body = await read_body(scope, receive, server.max_body_bytes)
        if door is not None:  # another API's request, as the chat request it means
            req, params = door.decode(body)
            endpoint = "chat"
        elif endpoint == "chat":
            req = state.types.decode_chat(body)
            params = chat_params(req)
        else:
            req = state.types.decode_completions(body)
            params = completion_params(req)
        record.model, record.stream = req.model, params.stream
        check_limits(req, params, server.limits, body)
        backend = state.model(req.model, own.get("allowed_models"))
        record.backend = backend.config.backend
        _check_task(backend, "generate")
        watch = DisconnectWatch(receive)  # one for the whole request: load, queue, backend, stream
        lease = state.fleet.lease_now(backend)
        if lease is None:  # the model must load first
            loading = asyncio.ensure_future(state.fleet.lease(backend))
            try:
                if params.stream:
                    await unless_disconnected(watch, asyncio.wait([loading], timeout=STREAM_LOAD_GRACE))
                    if not loading.done():
                        return _loading_stream(state, req, params, backend, endpoint, record, body, watch, loading,
                                               door)
                lease = await unless_disconnected(watch, loading)
            except BaseException:
                _let_go(loading)
                raise
        _prepare(state, req, params, backend, endpoint, record)
        queue = state.queues[backend.name]
        ticket = queue.try_acquire() or await unless_disconnected(watch, queue.acquire(params.priority))
    except BaseException as exc:
        if lease is not None:
            lease.release()
        if isinstance(exc, Exception):
            record.close(exc.status if isinstance(exc, APIError) else 500, _prompt_text(record, body))
        raise
    call = backend.chat if endpoint == "chat" else backend.complete
    try:
        if params.stream:
            # A backend may wait for its upstream's first event before answering: a client
            # that leaves meanwhile must not keep that work going.
            events = await unless_disconnected(watch, call(req, params))

            def done(completed: bool) -> None:
                ticket.release()
                lease.release()
                record.close(200 if completed else 499, _prompt_text(record, body))

            if door is not None:
                events = door.stream(events)
            return event_stream(Relay(events, done), {"x-request-id": rid}, watch)
        reply = await unless_disconnected(watch, call(req, params))
        if door is not None:
            reply = door.reply(reply)
    except BaseException as exc:
        ticket.release()
        lease.release()
        record.close(exc.status if isinstance(exc, APIError) else 500, _prompt_text(record, body))
        raise
    ticket.release()
    lease.release()
    record.close(200, _prompt_text(record, body))
    return json_reply(reply, {"x-request-id": rid})


_ENDPOINTS = {"generate": "/v1/chat/completions, /v1/completions or /v1/messages", "embed": "/v1/embeddings"}


def _check_task(backend: Backend, wanted: str) -> None:
    """A 400 for a request to a model of the other task (an embedding model asked to chat)."""
    task = backend.config.task
    if task != wanted:
        raise BadRequest(f"Model `{backend.name}` has task `{task}`: send its requests to {_ENDPOINTS[task]}.",
                         param="model", code="wrong_task")


def _prepare(state: RouterState, req: Any, params: Any, backend: Backend, endpoint: str, record: RequestRecord) -> None:
    """What needs the model loaded (its capabilities): the plugins' parameters, their checks."""
    state.plugins.pm.hook.prepare_request(request=req, model=backend.info, params=params, endpoint=endpoint)
    _check_response_format(req, params)
    params.check_capabilities(backend.name, backend.config.backend, backend.capabilities)
    _cap_max_tokens(params, backend)
    params.record = record


STREAM_LOAD_GRACE = 1.0
"""Seconds a stream waits for its model to load before its response starts (a quick load
keeps every status code a stream can answer with)."""
LOADING_COMMENT_INTERVAL = 2.0
"""Seconds between two SSE comment lines while a stream waits for its model to load."""


def _let_go(loading: "asyncio.Future[Any]") -> None:
    """Stop waiting for a load (which goes on): a lease it gave, or gives yet, is released."""

    def release(done: "asyncio.Future[Any]") -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().release()

    loading.cancel()
    loading.add_done_callback(release)


def _loading_stream(state: RouterState, req: Any, params: Any, backend: Backend, endpoint: str,
                    record: RequestRecord, body: bytes, watch: DisconnectWatch,
                    loading: "asyncio.Future[Any]", door: MessagesDoor | None = None) -> ASGIResponse:
    """A stream whose model is still loading after :data:`STREAM_LOAD_GRACE`: the response
    starts and SSE comment lines keep the connection alive while the model loads; the answer
    follows as usual. What would have been an error status (a 503 for a model that cannot load,
    a 400 the loaded model's checks find) comes in-band, ``data: {"error": ...}`` then
    ``data: [DONE]``. ``loading``: the lease being waited for (this stream's now); ``door``:
    the other API whose events these become, if any."""
    held: dict[str, Any] = {"status": 499}

    async def events() -> AsyncIterator[bytes]:
        yield b": loading model " + backend.name.encode() + b"\n\n"
        try:
            while True:
                finished, _ = await asyncio.wait([loading], timeout=LOADING_COMMENT_INTERVAL)
                if finished:
                    break
                yield b": loading\n\n"
            held["lease"] = loading.result()
            _prepare(state, req, params, backend, endpoint, record)
            queue = state.queues[backend.name]
            held["ticket"] = queue.try_acquire() or await queue.acquire(params.priority)
            call = backend.chat if endpoint == "chat" else backend.complete
            async with aclosing(await call(req, params)) as answer:
                async for chunk in answer:
                    yield chunk
            held["status"] = 200
        except APIError as exc:
            held["status"] = exc.status
            yield sse.event(exc.to_json())
            yield sse.DONE

    def done(completed: bool) -> None:
        # Exactly once, however the stream ended (even never started): what it holds goes.
        if "ticket" in held:
            held["ticket"].release()
        if "lease" in held:
            held["lease"].release()
        else:
            _let_go(loading)
        record.close(held["status"] if completed else 499, _prompt_text(record, body))

    answer = events() if door is None else door.stream(events())
    return event_stream(Relay(answer, done), {"x-request-id": record.request_id}, watch)


def _prompt_text(record: RequestRecord, body: bytes) -> str | None:
    return body.decode("utf-8", "replace")[:20000] if record.log_content else None


def _cap_max_tokens(params: Any, backend: Backend) -> None:
    limit = backend.config.max_tokens_limit
    if limit is None:
        return
    if params.max_tokens is not None and params.max_tokens > limit:
        if params.fit_max_tokens:
            params.max_tokens = limit
            return
        raise BadRequest(
            f"max_tokens is {params.max_tokens}; model `{backend.name}` allows at most {limit}.",
            param="max_tokens",
        )
    params.max_tokens_cap = limit


def _check_response_format(req: Any, params: Any) -> None:
    """A JSON response_format is only honoured through a structured-outputs plugin; without
    one loaded it must not be silently ignored."""
    fmt = getattr(req, "response_format", None)
    if fmt is not None and type(fmt).__struct_config__.tag != "text" and params.constraint is None:
        raise BadRequest(
            "response_format other than `text` needs the structured_outputs plugin, which is not loaded.",
            param="response_format",
        )


# The generation endpoints' paths; a POST to one of them usually arrives through the app's fast
# lane (:class:`router.app.GenerationLane`), everything else through these handlers.
GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}


@asgi("/v1/chat/completions", copy_scope=False)
async def chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
    """OpenAI chat completions, streamed (SSE) or not."""
    await _generation_endpoint(scope, receive, send, "chat")


@asgi("/v1/messages", copy_scope=False)
async def messages(scope: Scope, receive: Receive, send: Send) -> None:
    """Anthropic's Messages API, streamed (named SSE events) or not, through the chat pipeline."""
    await _generation_endpoint(scope, receive, send, "messages")


@asgi("/v1/completions", copy_scope=False)
async def completions(scope: Scope, receive: Receive, send: Send) -> None:
    """OpenAI (legacy) text completions, streamed (SSE) or not."""
    await _generation_endpoint(scope, receive, send, "completions")


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request) -> Response[bytes]:
    """Anthropic's token count: the input tokens the same ``/v1/messages`` request's usage reports."""
    state = state_of(request)
    req, params = MessagesDoor(state, _allowed(request)).decode(await request.body(), counting=True)
    check_limits(req, params, state.config.server.limits)
    backend = state.model(req.model, _allowed(request))
    _check_task(backend, "generate")
    record = RequestRecord(state.metrics, request_state(request)["request_id"], "count_tokens",
                           model=req.model, backend=backend.config.backend)
    status = 500
    lease = await state.fleet.lease(backend)  # the tokenizer (and template) come with the model
    try:
        _prepare(state, req, params, backend, "chat", record)
        count = await backend.count_prompt_tokens(req, params)
        status = 200
    except APIError as exc:
        status = exc.status
        raise
    finally:
        lease.release()
        record.close(status)
    return json_response(_encoder.encode(CountTokensResponse(input_tokens=count)), headers=_rid_header(request))


_embeddings_decoder = msgspec.json.Decoder(EmbeddingRequest)


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request) -> Response[bytes]:
    """OpenAI's embeddings, on models with ``task = "embed"``; concurrent requests share the
    engine's forward passes."""
    state = state_of(request)
    req = decode_body(_embeddings_decoder, await request.body())
    backend = state.model(req.model, _allowed(request))
    _check_task(backend, "embed")
    record = RequestRecord(state.metrics, request_state(request)["request_id"], "embeddings",
                           model=req.model, backend=backend.config.backend)
    status, lease, ticket = 500, None, None
    try:
        lease = await state.fleet.lease(backend)
        queue = state.queues[backend.name]
        ticket = queue.try_acquire() or await queue.acquire(0)
        body, used = await backend.embed(req)
        record.usage(used, 0)
        status = 200
    except APIError as exc:
        status = exc.status
        raise
    finally:
        if ticket is not None:
            ticket.release()
        if lease is not None:
            lease.release()
        record.close(status)
    return json_response(body, headers=_rid_header(request))


# --- vocabulary -----------------------------------------------------------------------------

_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def _vocabulary(request: Request, decoder: msgspec.json.Decoder, method: str) -> Response[bytes]:
    req = decode_body(decoder, await request.body())
    state = state_of(request)
    backend = state.model(req.model, _allowed(request))
    lease = await state.fleet.lease(backend)  # the tokenizer comes with the loaded model
    try:
        return json_response(await getattr(backend, method)(req), headers=_rid_header(request))
    finally:
        lease.release()


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> Response[bytes]:
    """vLLM's ``/tokenize``: the token ids (and strings) a prompt or chat becomes."""
    return await _vocabulary(request, _tokenize_decoder, "tokenize")


@post("/detokenize", status_code=200)
async def detokenize(request: Request) -> Response[bytes]:
    """vLLM's ``/detokenize``: token ids back to text."""
    return await _vocabulary(request, _detokenize_decoder, "detokenize")


# --- models, health, metrics ----------------------------------------------------------------


def _card(state: RouterState, backend: Backend) -> ModelCard:
    return ModelCard(
        id=backend.name,
        created=state.created,
        owned_by=backend.config.owned_by,
        max_model_len=backend.max_model_len,
        backend=backend.config.backend,
        ready=backend.ready,
        status=state.fleet.status_of(backend),
        parent=backend.parent.name if isinstance(backend, AdapterModel) else None,
    )


@get("/v1/models")
async def list_models(request: Request) -> Response[bytes]:
    """Every model this caller may use, loaded or not (see ``status``)."""
    state = state_of(request)
    cards = [_card(state, b) for b in state.visible(_allowed(request))]
    return json_response(_encoder.encode(ModelList(data=cards)))


@get("/v1/models/{model_id:path}")
async def get_model(request: Request) -> Response[bytes]:
    """One model's card (model ids may contain slashes)."""
    state = state_of(request)
    model_id = str(request.path_params["model_id"]).lstrip("/")
    return json_response(_encoder.encode(_card(state, state.model(model_id, _allowed(request)))))


@get("/health")
async def health(request: Request) -> Response[bytes]:
    """200 while the router takes requests: once the models that start with it (remote ones,
    local ones that preload) have started or failed; 503 before, naming those still loading.
    A model that is unloaded, or failed, is the router's normal business: each model's state is
    in the body, and in ``/v1/models``."""
    state = state_of(request)
    models = {b.name: {**b.status(), "queued": state.queues[b.name].waiting} for b in state.models.values()}
    if not state.preloading:
        return json_response(_encoder.encode({"status": "ok", "models": models}))
    waiting = [f"{n} ({m['state']})" for n, m in models.items() if m["state"] == "loading"]
    error = ErrorBody(message="Not ready: " + "; ".join(waiting or ["starting"]), type="service_unavailable",
                      code="not_ready")
    return json_response(_encoder.encode({"error": error, "models": models}), status=503)


@get("/version")
async def version() -> Response[bytes]:
    """The router's version."""
    return json_response(_encoder.encode({"version": __version__}))


@get("/metrics")
async def metrics(request: Request) -> Response[str]:
    """Prometheus text format (docs/metrics.md)."""
    return Response(
        content=state_of(request).metrics.render(),
        media_type="text/plain; version=0.0.4; charset=utf-8",
    )


@get("/schema/openapi.json")
async def openapi(request: Request) -> Response[bytes]:
    """This API's OpenAPI document (request types include the loaded plugins' fields)."""
    state = state_of(request)
    if state.openapi is None:
        from .openapi import build

        names = [b.name for b in state.visible(None)]
        state.openapi = _encoder.encode(build(state.types, names, state.config.server.runtime_lora_updating))
    return json_response(state.openapi)


# --- LoRA adapters at run time ------------------------------------------------------------

_load_lora_decoder = msgspec.json.Decoder(LoadLoraAdapterRequest)
_unload_lora_decoder = msgspec.json.Decoder(UnloadLoraAdapterRequest)


# --- loading and unloading models (llama-server's router mode) --------------------------------

_model_name_decoder = msgspec.json.Decoder(ModelName)


def _admin(request: Request) -> RouterState:
    """The state, if the caller's key may use every model (else 403)."""
    if _allowed(request) is not None:
        raise APIError("Loading and unloading models needs a key that may use every model.",
                       status=403, type="permission_error", code="forbidden")
    return state_of(request)


@post("/models/load", status_code=200)
async def load_model(request: Request) -> Response[bytes]:
    """Load a model now (waiting for it, room made first); 200 with its model object. A failed
    model tries again at once."""
    state = _admin(request)
    req = decode_body(_model_name_decoder, await request.body())
    backend = state.model(req.model)
    await state.fleet.load(backend)
    return json_response(_encoder.encode(_card(state, backend)), headers=_rid_header(request))


@post("/models/unload", status_code=200)
async def unload_model(request: Request) -> Response[bytes]:
    """Unload a model now (its worker exits); 409 while requests hold it."""
    state = _admin(request)
    req = decode_body(_model_name_decoder, await request.body())
    backend = state.model(req.model)
    if isinstance(backend, AdapterModel):
        raise BadRequest(f"`{backend.name}` is a LoRA adapter of `{backend.parent.name}`; unload that model.",
                         param="model")
    await state.fleet.unload(backend)
    return json_response(_encoder.encode(_card(state, backend)), headers=_rid_header(request))


def _lora_updates_allowed(request: Request) -> RouterState:
    """The state, if ``[server] runtime_lora_updating`` is on (else 404, as an unknown path) and
    the caller's key may use every model (else 403)."""
    state = state_of(request)
    if not state.config.server.runtime_lora_updating:
        raise APIError("Not Found", status=404, code="not_found")
    if _allowed(request) is not None:
        raise APIError("Loading and unloading LoRA adapters needs a key that may use every model.",
                       status=403, type="permission_error", code="forbidden")
    return state


def _plain(text: str, request: Request) -> Response[str]:
    return Response(content=text, media_type="text/plain; charset=utf-8", headers=_rid_header(request))


@post("/v1/load_lora_adapter", status_code=200)
async def load_lora_adapter(request: Request) -> Response[str]:
    """vLLM's: load a LoRA adapter from the server's file system and serve it as a model."""
    state = _lora_updates_allowed(request)
    req = decode_body(_load_lora_decoder, await request.body())
    await state.load_adapter(req.lora_name, req.lora_path, req.model)
    return _plain(f"Success: LoRA adapter '{req.lora_name}' added successfully.", request)


@post("/v1/unload_lora_adapter", status_code=200)
async def unload_lora_adapter(request: Request) -> Response[str]:
    """vLLM's: stop serving a LoRA adapter (refused while requests generate with it)."""
    state = _lora_updates_allowed(request)
    req = decode_body(_unload_lora_decoder, await request.body())
    await state.unload_adapter(req.lora_name)
    return _plain(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", request)


ROUTES = [chat_completions, completions, messages, count_tokens, embeddings, tokenize, detokenize, list_models, get_model, health, version, metrics, openapi,
          load_model, unload_model, load_lora_adapter, unload_lora_adapter]
