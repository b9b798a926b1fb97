"""The wire shapes: OpenAI requests (decoded strictly) and responses (encoded as is).

Request types here hold the core OpenAI fields only. The types the app actually decodes are
built once at startup by :func:`router.requests.compose` from these plus the fields that loaded
plugins declare, so an unknown field is rejected unless some plugin asked for it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType


class Strict(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every request-side type: unknown fields are an error. (msgspec's ``kw_only``
    is not inherited, so each subclass states it.)"""


# --- messages ------------------------------------------------------------------------------


class TextPart(Strict, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageURL(Strict, kw_only=True):
    url: str
    detail: str | None = None


class ImagePart(Strict, kw_only=True, tag_field="type", tag="image_url"):
    image_url: ImageURL


class AudioData(Strict, kw_only=True):
    data: str
    format: str


class AudioPart(Strict, kw_only=True, tag_field="type", tag="input_audio"):
    input_audio: AudioData


ContentPart = Union[TextPart, ImagePart, AudioPart]
Content = Union[str, list[ContentPart]]


class FunctionCall(Strict, kw_only=True):
    name: str
    arguments: str


class ToolCall(Strict, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Strict, kw_only=True, tag_field="role", tag="system"):
    content: Content
    name: str | None = None


class DeveloperMessage(Strict, kw_only=True, tag_field="role", tag="developer"):
    content: Content
    name: str | None = None


class UserMessage(Strict, kw_only=True, tag_field="role", tag="user"):
    content: Content
    name: str | None = None


class AssistantMessage(Strict, kw_only=True, tag_field="role", tag="assistant"):
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """What vLLM now calls ``reasoning_content`` (templates read that name; either is passed on)."""


class ToolMessage(Strict, kw_only=True, tag_field="role", tag="tool"):
    content: Content
    tool_call_id: str


Message = Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage]


# --- request options -----------------------------------------------------------------------


class FunctionDefinition(Strict, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(Strict, kw_only=True):
    name: str


class NamedToolChoice(Strict, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class JSONSchemaFormat(Strict, kw_only=True):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextFormat(Strict, kw_only=True, tag_field="type", tag="text"):
    pass


class JSONObjectFormat(Strict, kw_only=True, tag_field="type", tag="json_object"):
    pass


class JSONSchemaResponseFormat(Strict, kw_only=True, tag_field="type", tag="json_schema"):
    json_schema: JSONSchemaFormat


ResponseFormat = Union[TextFormat, JSONObjectFormat, JSONSchemaResponseFormat]


class StreamOptions(Strict, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Stop = Union[str, list[str]]


class SamplingFields(Strict, kw_only=True):
    """OpenAI fields shared by both generation endpoints."""

    model: str
    frequency_penalty: Penalty | None = 0.0
    presence_penalty: Penalty | None = 0.0
    logit_bias: dict[str, Bias] | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, Meta(ge=1)] | None = 1
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``: core OpenAI fields."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True


PromptItem = Union[str, int, list[int]]


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``: core OpenAI fields."""

    prompt: Union[str, list[PromptItem]]
    echo: bool | None = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None


class LoadLoraAdapterRequest(Strict, kw_only=True):
    """``POST /v1/load_lora_adapter`` (vLLM's shape; ``model`` names the base model where the
    router serves more than one that takes adapters)."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_path: Annotated[str, Meta(min_length=1)]
    model: str | None = None


class UnloadLoraAdapterRequest(Strict, kw_only=True):
    """``POST /v1/unload_lora_adapter`` (vLLM's shape; ``lora_int_id`` accepted and unused)."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_int_id: int | None = None


class TokenizeRequest(Strict, kw_only=True):
    """``POST /tokenize`` (vLLM's shape): either ``prompt`` or ``messages``."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict, kw_only=True):
    """``POST /detokenize``."""

    model: str
    tokens: list[Annotated[int, Meta(ge=0)]]


# --- responses -----------------------------------------------------------------------------
# Response types keep null fields (OpenAI clients expect e.g. "logprobs": null); fields that only
# some responses carry default to UNSET, which msgspec leaves out.


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(Struct):
    """A thinking model's reasoning tokens (models with a ``reasoning_parser``); Predicted
    Outputs: the prediction's tokens the model kept and refused as drafts."""

    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None


class PromptLogprob(Struct):
    """vLLM's ``prompt_logprobs`` entry (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ResponseToolCallFunction(Struct):
    name: str
    arguments: str


class ResponseToolCall(Struct):
    id: str
    function: ResponseToolCallFunction
    type: str = "function"


class ResponseMessage(Struct):
    role: str
    content: str | None
    tool_calls: list[ResponseToolCall] | UnsetType = UNSET
    reasoning: str | None | UnsetType = UNSET  # models with a reasoning_parser (vLLM's name)


class ChatChoice(Struct):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class DeltaToolCallFunction(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: DeltaToolCallFunction | UnsetType = UNSET


class Delta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


class Completion(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None
    backend: str | None = None
    ready: bool = True
    status: dict[str, Any] | None = None
    """llama-server router mode's: ``{"value": "loaded" | "loading" | "unloaded" | "failed"}``,
    with ``reason`` when failed and ``memory_bytes`` while it takes memory."""
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); null for a base model


class ModelName(Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /models/load`` and ``/models/unload``."""

    model: Annotated[str, Meta(min_length=1)]


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str
