"""Anthropic's messages in, chat completions' pipeline through, Anthropic's message out.

A Messages request becomes the chat request it means (:func:`chat_request`): the system prompt
first, each ``tool_result`` block a tool message, each ``tool_use`` block an assistant's tool
call, ``thinking`` blocks the assistant's reasoning. It then runs as any chat request does (and a
remote model gets it as chat completions upstream). The chat answer becomes Anthropic's
(:func:`message`): content blocks, ``stop_reason``, and usage with the prompt tokens our prefix
cache held as ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ..errors import BadRequest, from_validation_error
from .protocol import (
    AnyChoice,
    Base64Source,
    CountTokensRequest,
    ImageBlock,
    MessageResponse,
    MessagesRequest,
    NamedChoice,
    NoChoice,
    RedactedThinkingBlock,
    SystemText,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)

EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
"""Anthropic's ``output_config.effort`` as OpenAI's ``reasoning_effort``."""


def chat_request(req: CountTokensRequest, chat_type: type, fields: set[str], thinks: bool, *,
                 stream_usage: bool = True) -> Any:
    """The chat request (of the app's composed ``chat_type``) ``req`` means. ``fields``: the
    plugin fields ``chat_type`` has; ``thinks``: the model has a reasoning parser (``thinking``
    and ``effort`` reach it; otherwise they are accepted and ignored)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                              **({"description": t.description} if t.description else {})}}
            for t in req.tools
        ]
        _tool_choice(req, body)
    elif req.tool_choice is not None and not isinstance(req.tool_choice, NoChoice):
        raise BadRequest("tool_choice is only allowed when tools are given.", param="tool_choice")
    effort = req.output_config.effort if req.output_config is not None else None
    if thinks and effort is not None and "reasoning_effort" in fields:
        body["reasoning_effort"] = EFFORT[effort]
    if thinks and isinstance(req.thinking, ThinkingDisabled):
        if "include_reasoning" in fields:
            body["include_reasoning"] = False
        if "chat_template_kwargs" in fields:
            body["chat_template_kwargs"] = {"enable_thinking": False}  # Qwen3's switch; others ignore it
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p)):
            if value is not None:
                body[name] = value
        if req.top_k is not None:
            if "top_k" not in fields:
                raise BadRequest("top_k needs the sampling plugin, which is not loaded.", param="top_k")
            body["top_k"] = req.top_k
        if req.metadata is not None and req.metadata.user_id is not None:
            body["user"] = req.metadata.user_id
        if req.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": stream_usage}
    try:
        return msgspec.convert(body, chat_type)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None


def _tool_choice(req: CountTokensRequest, body: dict[str, Any]) -> None:
    choice = req.tool_choice
    if choice is None:
        return
    if isinstance(choice, NoChoice):
        body["tool_choice"] = "none"
        return
    if isinstance(choice, NamedChoice):
        if choice.name not in {t.name for t in req.tools or ()}:
            raise BadRequest(f"tool_choice names the tool `{choice.name}`, which is not in tools.",
                             param="tool_choice.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = "required" if isinstance(choice, AnyChoice) else "auto"
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False


def _system_text(system: str | list[SystemText]) -> str:
    return system if isinstance(system, str) else "\n".join(b.text for b in system)


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _system_text(req.system)})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content, i))
        else:
            out += _user(m.role, m.content, i)
    return out


def _assistant(blocks: list[Any], i: int) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thinking.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif not isinstance(b, RedactedThinkingBlock):  # another model's sealed reasoning: not ours to read
            raise BadRequest(f"An assistant message cannot hold a `{_kind(b)}` block.",
                             param=f"messages[{i}].content[{j}].type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(role: str, blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """A user (or system) turn: its tool results as tool messages, in order, around its text."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            out.append({"role": role, "content": _content(parts)})
            parts.clear()

    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock) and role == "user":
            parts.append(_image(b))
        elif isinstance(b, ToolResultBlock) and role == "user":
            flush()
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_result(b)})
        else:
            raise BadRequest(f"A {role} message cannot hold a `{_kind(b)}` block.",
                             param=f"messages[{i}].content[{j}].type")
    flush()
    return out


def _content(parts: list[dict[str, Any]]) -> Any:
    """Text alone as one string (every chat template reads that), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return list(parts)


def _image(b: ImageBlock) -> dict[str, Any]:
    src = b.source
    url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64Source) else src.url
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(b: ToolResultBlock) -> Any:
    if b.content is None or isinstance(b.content, str):
        content: Any = b.content or ""
    else:
        content = _content([{"type": "text", "text": c.text} if isinstance(c, TextBlock) else _image(c)
                            for c in b.content]) if b.content else ""
    if b.is_error and isinstance(content, str):
        content = f"Error: {content}"
    return content


def _kind(block: Any) -> str:
    return type(block).__struct_config__.tag


# --- the answer ---------------------------------------------------------------------------------

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def stop_reason(finish_reason: str | None, stopped_by: Any) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat choice's ``finish_reason`` and
    ``stop_reason`` (the stop string that ended it, where one did)."""
    if finish_reason == "stop" and isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return STOP_REASONS.get(finish_reason or "", "end_turn"), None


def usage(chat_usage: dict[str, Any] | None) -> Usage:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens the prefix cache did not hold."""
    if not chat_usage:
        return Usage(input_tokens=0, output_tokens=0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Usage(input_tokens=chat_usage["prompt_tokens"] - cached, output_tokens=chat_usage["completion_tokens"],
                 cache_read_input_tokens=cached)


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.rpartition("-")[2]


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object (arguments that are no JSON object: kept
    whole under ``arguments``, rather than lost)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message(reply: bytes) -> MessageResponse:
    """A chat completion (JSON) as Anthropic's message."""
    chat = msgspec.json.decode(reply)
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    return MessageResponse(id=message_id(chat["id"]), content=content, model=chat["model"],
                           stop_reason=reason, stop_sequence=sequence, usage=usage(chat.get("usage")))
