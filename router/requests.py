"""Request types composed at startup, strict decoding, and the core fields' meaning.

The types clients' bodies are decoded into are the core OpenAI types (:mod:`router.protocol`)
extended with every field the loaded plugins declared, built once with ``msgspec.defstruct``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import msgspec

from .engine import SamplingParams
from .errors import BadRequest, from_validation_error
from .config import Limits
from .hookspecs import RequestField
from .params import GenerationParams
from .protocol import ChatCompletionRequest, CompletionRequest

CORE = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


class FieldConflict(Exception):
    """Two plugins (or a plugin and the core) declared the same request field."""


@dataclass(frozen=True)
class RequestTypes:
    """The decoders for one app: core fields plus those of its plugins."""

    chat: type[ChatCompletionRequest]
    completions: type[CompletionRequest]
    fields: dict[str, tuple[str, RequestField]]  # name -> (plugin, field)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_chat_decoder", msgspec.json.Decoder(self.chat))
        object.__setattr__(self, "_completions_decoder", msgspec.json.Decoder(self.completions))

    def decode_chat(self, body: bytes) -> ChatCompletionRequest:
        return decode_body(self._chat_decoder, body)  # type: ignore[attr-defined]

    def decode_completions(self, body: bytes) -> CompletionRequest:
        return decode_body(self._completions_decoder, body)  # type: ignore[attr-defined]


def decode_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """Decode a request body strictly; every failure is a 400 naming the field."""
    if not body.strip():
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise BadRequest("The request body nests JSON too deeply.") from None


def compose(declared: Iterable[tuple[str, RequestField]]) -> RequestTypes:
    """Build the request types from ``(plugin name, field)`` pairs."""
    owners: dict[str, tuple[str, RequestField]] = {}
    per_endpoint: dict[str, list[tuple[str, Any, Any]]] = {"chat": [], "completions": []}
    for plugin, f in declared:
        if f.name in owners:
            raise FieldConflict(
                f"request field `{f.name}` is declared by both plugin `{owners[f.name][0]}` "
                f"and plugin `{plugin}`"
            )
        for endpoint in f.endpoints:
            if f.name in CORE[endpoint].__struct_fields__:
                raise FieldConflict(
                    f"plugin `{plugin}` declares request field `{f.name}`, which is a core field"
                )
            per_endpoint[endpoint].append((f.name, f.type, f.default))
        owners[f.name] = (plugin, f)
    types = {
        endpoint: msgspec.defstruct(
            CORE[endpoint].__name__,
            fields,
            bases=(CORE[endpoint],),
            kw_only=True,
            forbid_unknown_fields=True,
            module=__name__,
        )
        for endpoint, fields in per_endpoint.items()
    }
    return RequestTypes(chat=types["chat"], completions=types["completions"], fields=owners)


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(stops):
        if not s:
            raise BadRequest("Stop strings must not be empty.", param="stop" if isinstance(stop, str) else f"stop[{i}]")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise BadRequest(
                f"logit_bias keys must be token ids written as strings; got `{key}`.",
                param="logit_bias",
            ) from None
    return out


def _common(request: Any) -> GenerationParams:
    """The OpenAI fields both endpoints share, checked across fields."""
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options is only allowed when stream is true.", param="stream_options")
    sampling = SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias),
        seed=request.seed,
    )
    opts = request.stream_options
    return GenerationParams(
        sampling=sampling,
        n=request.n or 1,
        max_tokens=request.max_tokens,
        stop=_stops(request.stop),
        stream=bool(request.stream),
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
    )


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded value, counting no further than ``limit + 1``."""
    if isinstance(value, msgspec.Struct):
        children = (getattr(value, f) for f in value.__struct_fields__)
    elif isinstance(value, dict):
        children = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return 0
    if limit < 0:
        return 1
    deepest = 0
    for child in children:
        if isinstance(child, (msgspec.Struct, dict, list, tuple)):
            deepest = max(deepest, json_depth(child, limit - 1))
            if deepest > limit:
                break
    return deepest + 1


def check_limits(request: Any, params: GenerationParams, limits: Limits, body: bytes | None = None) -> None:
    """The operator's bounds (``[server.limits]``): each breach is a 400 naming the field.
    ``body``, the request's bytes, lets the nesting check skip requests too small to breach it."""

    def over(param: str, what: str, value: int, limit: int) -> None:
        if value > limit:
            raise BadRequest(f"{what} is {value}; at most {limit} allowed.", param=param)

    messages = getattr(request, "messages", None)
    if messages is not None:
        over("messages", "The number of messages", len(messages), limits.max_messages)
    over("n", "n", params.n, limits.max_n)
    over("stop", "The number of stop strings", len(params.stop), limits.max_stop)
    for i, s in enumerate(params.stop):
        over(f"stop[{i}]", "The stop string's length", len(s), limits.max_stop_length)
    bias = params.sampling.logit_bias
    over("logit_bias", "The number of logit_bias entries", len(bias or ()), limits.max_logit_bias)
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        over("prompt", "The number of prompts", len(prompt), limits.max_prompts)
    # The request's own structure takes a few levels (body, messages, content part...).
    limit = limits.max_json_depth + 4
    if body is not None and body.count(b"{") + body.count(b"[") <= limit:
        return  # cannot nest deeper than it has brackets
    if json_depth(request, limit) > limit:
        raise BadRequest(f"The request nests JSON deeper than {limits.max_json_depth} levels.")


def chat_params(request: ChatCompletionRequest) -> GenerationParams:
    params = _common(request)
    if request.max_completion_tokens is not None:
        params.max_tokens = request.max_completion_tokens
    if request.top_logprobs is not None and not request.logprobs:
        raise BadRequest("top_logprobs needs logprobs set to true.", param="top_logprobs")
    if request.logprobs:
        params.sampling.logprobs = request.top_logprobs or 0
        params.require("logprobs", "logprobs")
    if request.tool_choice is not None and not request.tools:
        raise BadRequest("tool_choice is only allowed when tools are given.", param="tool_choice")
    if request.tools:
        names = [t.function.name for t in request.tools]
        choice = request.tool_choice
        if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
            raise BadRequest(
                f"tool_choice names the function `{choice.function.name}`, which is not in tools.",
                param="tool_choice",
            )
        if choice not in (None, "none", "auto"):
            params.require("tool_choice", "tool_choice")
        if choice != "none":
            params.tools = [msgspec.to_builtins(t) for t in request.tools]
            params.tool_choice = choice if isinstance(choice, str) or choice is None else choice.function.name
            params.parallel_tool_calls = request.parallel_tool_calls is not False
    return params


def completion_params(request: CompletionRequest) -> GenerationParams:
    params = _common(request)
    if request.logprobs is not None:
        params.sampling.logprobs = request.logprobs
        params.require("logprobs", "logprobs")
    params.echo = bool(request.echo)
    if params.echo and request.logprobs is not None:
        params.prompt_logprobs = params.prompt_logprobs_field = request.logprobs
    return params
