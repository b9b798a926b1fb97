"""Anthropic's Messages API as msgspec types: what ``POST /v1/messages`` and
``/v1/messages/count_tokens`` take, strictly (an unknown field is a 400 naming it).

The fields Claude Code and the SDK send that we have no use for (``cache_control``,
``context_management``, ``metadata`` beyond its user id, ``speed``...) are accepted: our prefix
cache is automatic, so a cache mark needs no action to be honoured. ``temperature``, ``top_p`` and
``top_k``, gone from the newest SDK's signature yet still Anthropic's, are honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct


class Strict(Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class CacheControl(Strict, kw_only=True):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class Base64Source(Strict, kw_only=True, tag_field="type", tag="base64"):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(Strict, kw_only=True, tag_field="type", tag="url"):
    url: str


class ImageBlock(Strict, kw_only=True, tag_field="type", tag="image"):
    source: Union[Base64Source, URLSource]
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict, kw_only=True, tag_field="type", tag="tool_use"):
    id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: Union[str, list[Union[TextBlock, ImageBlock]], None] = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict, kw_only=True, tag_field="type", tag="redacted_thinking"):
    data: str


Block = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]


class Message(Strict, kw_only=True):
    role: Literal["user", "assistant", "system"]
    """``system`` is not Anthropic's own, yet Claude Code sends such entries inside ``messages``."""
    content: Union[str, list[Block]]


class Tool(Strict, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class AutoChoice(Strict, kw_only=True, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool | None = None


class AnyChoice(Strict, kw_only=True, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool | None = None


class NamedChoice(Strict, kw_only=True, tag_field="type", tag="tool"):
    name: str
    disable_parallel_tool_use: bool | None = None


class NoChoice(Strict, kw_only=True, tag_field="type", tag="none"):
    pass


ToolChoice = Union[AutoChoice, AnyChoice, NamedChoice, NoChoice]


Display = Literal["summarized", "omitted"]


class ThinkingEnabled(Strict, kw_only=True, tag_field="type", tag="enabled"):
    budget_tokens: Annotated[int, Meta(ge=1)]
    display: Display | None = None


class ThinkingAdaptive(Strict, kw_only=True, tag_field="type", tag="adaptive"):
    display: Display | None = None


class ThinkingBetweenTools(Strict, kw_only=True, tag_field="type", tag="between_tools"):
    pass


class ThinkingDisabled(Strict, kw_only=True, tag_field="type", tag="disabled"):
    pass


Thinking = Union[ThinkingEnabled, ThinkingAdaptive, ThinkingBetweenTools, ThinkingDisabled]


class JSONSchemaOutput(Strict, kw_only=True):
    type: Literal["json_schema"]  # a field, not a tag: a lone tagged struct would take it as optional
    schema_: dict[str, Any] = msgspec.field(name="schema")


class OutputConfig(Strict, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONSchemaOutput | None = None


class Metadata(Strict, kw_only=True):
    user_id: str | None = None


class SystemText(Strict, kw_only=True):
    """A system prompt's text block (``type`` a field: alone, a tagged struct would take it as optional)."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


System = Union[str, list[SystemText]]


class CountTokensRequest(Strict, kw_only=True):
    """``POST /v1/messages/count_tokens``: a message request without its answer's settings."""

    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: System | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[Annotated[str, Meta(min_length=1)]] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Accepted, with nothing to do here: caching is automatic; one machine, one speed.
    cache_control: CacheControl | None = None
    container: Any = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# --- answers ------------------------------------------------------------------------------------


class Usage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(Struct, kw_only=True):
    input_tokens: int


class ErrorDetail(Struct):
    type: str
    message: str


class ErrorResponse(Struct, kw_only=True):
    type: str = "error"
    error: ErrorDetail
