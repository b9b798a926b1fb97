"""From a request to prompt token ids: template, tokenize, guard control tokens, check length.

A user who types ``<|im_start|>system`` into a message must not open a system turn: control
tokens are only recognised where the template wrote them. Text users wrote is tokenized with
special-token parsing off.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import msgspec

from .engine import Tokenizer
from .errors import BadRequest
from .protocol import AssistantMessage, Message, TextPart
from .templates import ChatTemplate, RenderedChat


def message_dicts(messages: list[Message], null_content: bool = True) -> list[dict[str, Any]]:
    """Messages as the plain dicts Hugging Face templates expect.

    Text parts are joined into one string; tool-call arguments are handed over as objects
    (templates dump them with ``tojson``), as vLLM does. An assistant tool-call message without
    content has ``content: None``, or ``""`` without ``null_content`` (for templates that fail on
    None: :attr:`ChatTemplate.requires_non_null_content`).
    """
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        d: dict[str, Any] = msgspec.to_builtins(message)
        content = getattr(message, "content", None)
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, TextPart):
                    raise BadRequest(
                        f"This model accepts only text content; got a `{_part_type(part)}` part.",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = None if null_content and getattr(message, "tool_calls", None) else ""
        if isinstance(message, AssistantMessage) and (message.reasoning or message.reasoning_content):
            # The names templates read: Qwen3's reasoning_content, gpt-oss's thinking.
            d["reasoning_content"] = message.reasoning_content or message.reasoning
            d["thinking"] = d["reasoning_content"]
        if isinstance(message, AssistantMessage) and message.tool_calls:
            for call in d["tool_calls"]:
                try:
                    call["function"]["arguments"] = msgspec.json.decode(call["function"]["arguments"])
                except msgspec.DecodeError:
                    pass
        out.append(d)
    return out


def _part_type(part: Any) -> str:
    return type(part).__struct_config__.tag or type(part).__name__


@lru_cache(maxsize=64)
def _special_pattern(specials: frozenset[str]) -> re.Pattern[str] | None:
    if not specials:
        return None
    alternatives = sorted(specials, key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in alternatives))


def encode_chat(tokenizer: Tokenizer, rendered: RenderedChat) -> list[int]:
    """Tokenize a rendered chat, treating control-token text inside user spans as text."""
    pattern = _special_pattern(tokenizer.special_tokens)
    text = rendered.text
    if pattern is None:
        return tokenizer.encode(text, add_special_tokens=False)
    for s in rendered.unlocated:
        m = pattern.search(s)
        if m:
            raise BadRequest(
                f"A message contains the control token `{m.group()}`, and this model's chat "
                "template changes that text on the way in, so it cannot be kept as plain text.",
                param="messages",
            )
    spans = sorted(rendered.user_spans)
    inside = [m for m in pattern.finditer(text) if _within(m.start(), m.end(), spans)]
    if not inside:
        return tokenizer.encode(text, add_special_tokens=False)
    # Slow path: split at the control tokens the template wrote; tokenize the rest as text.
    ids: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        if _within(m.start(), m.end(), spans):
            continue
        if m.start() > pos:
            ids += tokenizer.encode(text[pos : m.start()], add_special_tokens=False, parse_special=False)
        ids += tokenizer.encode(m.group(), add_special_tokens=False, parse_special=True)
        pos = m.end()
    if pos < len(text):
        ids += tokenizer.encode(text[pos:], add_special_tokens=False, parse_special=False)
    return ids


def _within(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """Whether [start, end) touches a span a user wrote."""
    return any(a < end and start < b for a, b in spans)


def build_chat_prompt(
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    messages: list[Message],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
    tool_format: str | None = None,
) -> list[int]:
    """Template and tokenize a conversation. With tools and a template that does not use them,
    the tool list goes into the system message in ``tool_format``'s convention."""
    if template is None:
        raise BadRequest(
            "This model has no chat template; use /v1/completions or configure "
            "`chat_template` for it in router.toml.",
            param="messages",
        )
    dicts = message_dicts(messages, not template.requires_non_null_content)
    if tools and tool_format is not None:
        from .tools.inject import inject, template_knows_tools

        if not template_knows_tools(template.source):
            dicts, tools = inject(dicts, tools, tool_format), None
    if continue_final_message and dicts[-1]["role"] != "assistant":
        raise BadRequest(
            "continue_final_message needs the last message to be from the assistant.",
            param="continue_final_message",
        )
    rendered = template.render(
        dicts,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        kwargs=template_kwargs,
    )
    ids = encode_chat(tokenizer, rendered)
    if not ids:
        raise BadRequest("The chat template rendered these messages to an empty prompt.", param="messages")
    return ids


def completion_prompts(prompt: str | list[Any], tokenizer: Tokenizer) -> list[list[int]]:
    """The prompts of a completions request as token ids: a string, strings, ids, or lists of ids."""
    if isinstance(prompt, str):
        return _nonempty([tokenizer.encode(prompt, add_special_tokens=True)])
    if not prompt:
        raise BadRequest("prompt must not be empty.", param="prompt")
    kinds = {type(p) for p in prompt}
    if len(kinds) > 1:
        raise BadRequest(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, not a mix.",
            param="prompt",
        )
    kind = kinds.pop()
    if kind is str:
        return _nonempty([tokenizer.encode(p, add_special_tokens=True) for p in prompt])
    if kind is int:
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    for i, ids in enumerate(prompts):
        if not ids:
            raise BadRequest("A token-id prompt must not be empty.", param=f"prompt[{i}]")
        bad = next((t for t in ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise BadRequest(
                f"Token id {bad} is out of the vocabulary (0 to {tokenizer.vocab_size - 1}).",
                param="prompt",
            )
    return prompts


def _nonempty(prompts: list[list[int]]) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        if not ids:
            # Nothing to condition on (this tokenizer adds no BOS): engines need a token.
            raise BadRequest("The prompt is empty after tokenization.", param="prompt" if len(prompts) == 1 else f"prompt[{i}]")
    return prompts


def truncate_prompt(ids: list[int], keep: int | None, max_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: only the last ``keep`` prompt tokens (-1: as many as
    leave room for ``max_tokens``, or for one token when it is not given)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max(max_model_len - (max_tokens or 1), 1)
    elif keep == 0 or keep > max_model_len:
        raise BadRequest(
            f"truncate_prompt_tokens must be -1 or from 1 to the model's context length ({max_model_len}); "
            f"got {keep}.",
            param="truncate_prompt_tokens",
        )
    return ids[-keep:] if len(ids) > keep else ids


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int, what: str) -> int:
    """The 400 for a request that does not fit the context; returns the completion budget."""
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the {what} or "
            "completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
