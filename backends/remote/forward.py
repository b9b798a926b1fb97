"""What goes upstream: the client's validated request, re-encoded for one deployment.

The router decoded the body into a request Struct whose type is the core OpenAI fields plus
every plugin's fields; fields the client did not send hold their defaults, and the request base
sets ``omit_defaults``, so encoding leaves them out. On top of that, for a deployment:

- plugin fields ("extras") it does not list in ``forward_extras`` are dropped (a request that
  *uses* one never gets here: :func:`extras_used` makes it a 400 first);
- ``model`` becomes the deployment's ``upstream_model``;
- a stream always asks for ``stream_options.include_usage`` (the router counts tokens); the
  relay passes the usage chunk on only when the client asked for it;
- a model's ``max_tokens_limit`` is sent as ``max_tokens`` when the request names none;
- ``"type": "function"`` is written back where OpenAI requires it (``omit_defaults`` drops it,
  and strict upstreams want it).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.protocol import ChatCompletionRequest, CompletionRequest

from .deployment import Deployment

_CORE = (set(ChatCompletionRequest.__struct_fields__), set(CompletionRequest.__struct_fields__))
_plugin_fields: dict[type, tuple[tuple[str, Any], ...]] = {}
_encode = msgspec.json.Encoder().encode


def plugin_fields(request_type: type) -> tuple[tuple[str, Any], ...]:
    """``(name, default)`` of each field of a composed request type that a plugin declared."""
    fields = _plugin_fields.get(request_type)
    if fields is None:
        if not issubclass(request_type, (ChatCompletionRequest, CompletionRequest)):
            return ()  # a type no plugin composes into (embeddings): every field is its own
        core = _CORE[0] if issubclass(request_type, ChatCompletionRequest) else _CORE[1]
        names = request_type.__struct_fields__
        defaults = request_type.__struct_defaults__
        offset = len(names) - len(defaults)
        fields = tuple(
            (name, defaults[i - offset] if i >= offset else msgspec.NODEFAULT)
            for i, name in enumerate(names)
            if name not in core
        )
        _plugin_fields[request_type] = fields
    return fields


def extras_used(request: Any) -> list[str]:
    """The plugin fields this request set to something other than their default."""
    return [name for name, default in plugin_fields(type(request)) if getattr(request, name) != default]


def upstream_body(request: Any, deployment: Deployment, *, stream: bool,
                  max_tokens_cap: int | None = None) -> bytes:
    """The JSON body to send to ``deployment`` for ``request``. ``max_tokens_cap`` (the model's
    ``max_tokens_limit``) becomes ``max_tokens`` when the request names none."""
    body: dict[str, Any] = msgspec.to_builtins(request)
    if max_tokens_cap is not None and "max_tokens" not in body and "max_completion_tokens" not in body:
        if "messages" in body or max_tokens_cap < 16:  # completions default to 16 tokens
            body["max_tokens"] = max_tokens_cap
    for name, _ in plugin_fields(type(request)):
        if name in body and name not in deployment.forward_extras:
            del body[name]
    body["model"] = deployment.upstream_model
    if stream:
        options = body.get("stream_options") or {}
        options["include_usage"] = True
        body["stream_options"] = options
    _restore_function_types(body)
    return _encode(body)


def _restore_function_types(body: dict[str, Any]) -> None:
    for tool in body.get("tools") or ():
        tool["type"] = "function"
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice["type"] = "function"
    for message in body.get("messages") or ():
        for call in message.get("tool_calls") or ():
            call["type"] = "function"
