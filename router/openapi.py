"""The OpenAPI document, built from the same msgspec types the endpoints decode and encode.

Handlers read raw bodies (strict decoding is ours, not Litestar's), so Litestar cannot see the
request shapes; this module describes them from the composed request types (core fields plus the
loaded plugins' fields) and the response Structs. Served at ``/schema/openapi.json``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import __version__
from .anthropic.protocol import CountTokensRequest, CountTokensResponse, MessageResponse, MessagesRequest
from .anthropic.protocol import ErrorResponse as AnthropicError
from .embeddings import EmbeddingList, EmbeddingRequest
from .errors import ErrorEnvelope
from .protocol import (
    ChatCompletion,
    Completion,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoraAdapterRequest,
    ModelName,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
)
from .requests import RequestTypes

_ERRORS = {
    "400": "Invalid request: the field at fault is in `param`.",
    "401": "Missing or wrong API key (when keys are configured).",
    "403": "A key limited to some models may not do this.",
    "404": "Unknown model (or one this key may not use).",
    "409": "The model has requests running or waiting; unload it once they end.",
    "413": "Body too large.",
    "429": "The model's admission queue is full; see Retry-After.",
    "500": "Server error (no traceback, ever).",
    "503": "The model is loading or down; see Retry-After.",
}


_SSE_EVENT = {
    "type": "object",
    "description": "One Server-Sent Event: `data` is a JSON chunk (chat.completion.chunk or "
    "text_completion; `choices: []` plus `usage` for the usage chunk; or an error envelope), and "
    "the last event's `data` is `[DONE]`.",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


class Health(msgspec.Struct):
    models: dict[str, dict[str, Any]]
    status: str | msgspec.UnsetType = msgspec.UNSET
    error: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class Version(msgspec.Struct):
    version: str


def build(types: RequestTypes, model_names: list[str], lora_updates: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document for an app with these request types and models (and the LoRA
    load/unload endpoints when ``[server] runtime_lora_updating`` serves them)."""
    models = [
        types.chat, types.completions, TokenizeRequest, DetokenizeRequest,
        ChatCompletion, Completion, ModelList, ModelCard, TokenizeResponse, DetokenizeResponse,
        ErrorEnvelope, Health, Version, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, ModelName,
        MessagesRequest, MessageResponse, CountTokensRequest, CountTokensResponse, AnthropicError,
        EmbeddingRequest, EmbeddingList,
    ]
    (chat_req, comp_req, tok_req, detok_req, chat_resp, comp_resp, model_list, model_card, tok_resp,
     detok_resp, envelope, health, version, load_req, unload_req, model_name, messages_req, message_resp,
     count_req, count_resp, anthropic_envelope, embed_req, embed_resp), components = msgspec.json.schema_components(
        models, ref_template="#/components/schemas/{name}"
    )

    # `model` names one of the served models (any other name is a 404 model_not_found).
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest", "ModelName",
                 "MessagesRequest", "CountTokensRequest", "EmbeddingRequest"):
        if model_names:
            components[name]["properties"]["model"] = {"type": "string", "enum": list(model_names)}

    def errors(*codes: str, schema: dict = envelope) -> dict[str, Any]:
        return {
            code: {"description": _ERRORS[code], "content": {"application/json": {"schema": schema}}}
            for code in codes
        }

    def generation(request: dict, response: dict, summary: str, error: dict = envelope) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {
                        "description": "The answer; with `stream: true`, Server-Sent Events (`data: <chunk>` ... `data: [DONE]`).",
                        "content": {
                            "application/json": {"schema": response},
                            # OpenAPI 3.1: `schema` of an event stream describes one event.
                            "text/event-stream": {"schema": _SSE_EVENT},
                        },
                    },
                    **errors("400", "401", "404", "413", "429", "500", "503", schema=error),
                },
            }
        }

    def json_op(method: str, schema: dict, summary: str, *codes: str, body: dict | None = None,
                parameters: list | None = None) -> dict[str, Any]:
        op: dict[str, Any] = {
            "summary": summary,
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": schema}}},
                          **errors(*codes)},
        }
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        if parameters:
            op["parameters"] = parameters
        return {method: op}

    health_op = json_op("get", health, "Whether the router takes requests, and every model's state", "500")
    health_op["get"]["responses"]["503"] = {
        "description": "The models that start with the router are still starting; the body says which.",
        "content": {"application/json": {"schema": health}},
    }
    paths = {
        "/v1/chat/completions": generation(chat_req, chat_resp, "Chat completions (OpenAI)"),
        "/v1/completions": generation(comp_req, comp_resp, "Text completions (OpenAI)"),
        "/v1/messages": generation(messages_req, message_resp, "Messages (Anthropic; named events when streamed)",
                                   anthropic_envelope),
        "/v1/messages/count_tokens": {"post": {
            **json_op("post", count_resp, "A message request's input tokens (Anthropic)", body=count_req)["post"],
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": count_resp}}},
                          **errors("400", "401", "404", "413", "500", "503", schema=anthropic_envelope)}}},
        "/v1/embeddings": json_op("post", embed_resp, "Embeddings (OpenAI; models with task = \"embed\")",
                                  "400", "401", "404", "413", "429", "500", "503", body=embed_req),
        "/v1/models": json_op("get", model_list, "Models this caller may use", "401", "500"),
        "/v1/models/{model_id}": json_op(
            "get", model_card, "One model", "401", "404", "500",
            parameters=[{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        ),
        "/tokenize": json_op("post", tok_resp, "Prompt or chat to token ids (vLLM)", "400", "401", "404", "413", "500", "503", body=tok_req),
        "/detokenize": json_op("post", detok_resp, "Token ids to text (vLLM)", "400", "401", "404", "413", "500", "503", body=detok_req),
        "/models/load": json_op("post", model_card, "Load a local model now (llama-server's router mode)",
                                "400", "401", "403", "404", "413", "500", "503", body=model_name),
        "/models/unload": json_op("post", model_card, "Unload a local model: its worker process exits",
                                  "400", "401", "403", "404", "409", "413", "500", body=model_name),
        "/health": health_op,
        "/version": json_op("get", version, "The router's version", "500"),
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **errors("401", "500")}}},
    }
    if lora_updates:
        def plain(summary: str, body: dict) -> dict[str, Any]:
            return {"post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": {"200": {"description": "Success: a sentence saying so.",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **errors("400", "401", "403", "404", "500", "503")},
            }}

        paths["/v1/load_lora_adapter"] = plain("Load a LoRA adapter and serve it as a model (vLLM)", load_req)
        paths["/v1/unload_lora_adapter"] = plain("Stop serving a LoRA adapter (vLLM)", unload_req)
    else:
        for name in ("LoadLoraAdapterRequest", "UnloadLoraAdapterRequest"):
            components.pop(name, None)
    return {
        "openapi": "3.1.0",
        "info": {"title": "router", "version": __version__,
                 "description": "One OpenAI-compatible endpoint for many models."},
        "paths": paths,
        "components": {"schemas": components},
    }
