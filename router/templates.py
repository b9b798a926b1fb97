"""Chat templates, rendered the way Hugging Face renders them.

Sandboxed Jinja2 with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and
the ``{% generation %}`` tag, and HF's helpers: ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII text. Variables: ``messages``, ``tools``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and whatever ``chat_template_kwargs`` adds.

Rendering also records where each user-written string landed in the prompt, so that control-token
text a user typed can be tokenized as plain text (see :mod:`router.prompts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import BadRequest

# Variables a request's chat_template_kwargs may not replace.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt"})


class TemplateError(BadRequest):
    """The template refused the conversation (``raise_exception``) or failed on it."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text in HF templates;
    for rendering it is a no-op around its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(slots=True)
class RenderedChat:
    """A rendered prompt and the spans of it that users wrote."""

    text: str
    user_spans: list[tuple[int, int]] = field(default_factory=list)
    unlocated: list[str] = field(default_factory=list)
    """User strings the template changed on the way in (their spans could not be found)."""


def hf_chat_template(folder: str | Path, *, with_tools: bool = False) -> str | None:
    """A Hugging Face model folder's chat template: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates of which
    ``default`` is taken, or ``tool_use`` when asked for)."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("tool_use") if with_tools and "tool_use" in named else named.get("default")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """One model's compiled chat template."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._non_null_content: bool | None = None

    @property
    def requires_non_null_content(self) -> bool:
        """Whether the template fails on an assistant tool-call message whose content is null
        (what OpenAI clients send back), as gpt-oss's does (``"..." in message.content``). Found
        once, by rendering such a message (llama.cpp's minja probes templates the same way);
        such a template is then given ``""`` instead."""
        if self._non_null_content is None:
            call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}
            probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "y"}]
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            self._non_null_content = False
            try:
                self.render(probe, tools=tools)
            except BadRequest:
                try:
                    self.render([{**m, "content": m["content"] or ""} for m in probe], tools=tools)
                    self._non_null_content = True  # it is the null that fails, not the rest
                except BadRequest:
                    pass
        return self._non_null_content

    @classmethod
    def from_file(cls, path: str | Path, **tokens: str | None) -> "ChatTemplate":
        return cls(Path(path).read_text(encoding="utf-8"), **tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> RenderedChat:
        """Render a conversation (messages as plain dicts, HF style)."""
        variables: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        if kwargs:
            clash = RESERVED.intersection(kwargs)
            if clash:
                name = sorted(clash)[0]
                raise BadRequest(
                    f"chat_template_kwargs may not set `{name}`; use the request field instead.",
                    param=f"chat_template_kwargs.{name}",
                )
            variables.update(kwargs)
        variables.update(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
        try:
            text = self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"The chat template rejected the messages: {exc}", param="messages")
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise TemplateError(
                f"The chat template failed on these messages: {type(exc).__name__}: {exc}",
                param="messages",
            )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return _locate_user_text(text, messages, tools)


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """Keep the prompt up to the end of the final message, so the model continues it."""
    final = messages[-1].get("content") or ""
    if not isinstance(final, str):
        final = ""
    stripped = final.strip()
    if not stripped or stripped not in text:
        raise BadRequest(
            "continue_final_message is set but the final message does not appear in the "
            "rendered chat template.",
            param="continue_final_message",
        )
    if final in text:
        return text[: text.rindex(final) + len(final)]
    return text[: text.rindex(stripped) + len(stripped)]


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _locate_user_text(
    text: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> RenderedChat:
    out = RenderedChat(text)
    cursor = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and content:
            at = text.find(content, cursor)
            if at < 0 and content.strip():
                content = content.strip()
                at = text.find(content, cursor)
            if at >= 0:
                out.user_spans.append((at, at + len(content)))
                cursor = at + len(content)
            else:
                out.unlocated.append(content)
        others = {k: v for k, v in message.items() if k not in ("content", "role")}
        for s in _strings(others):
            _mark_all(text, s, out)
    for s in _strings(tools or []):
        _mark_all(text, s, out)
    return out


def _mark_all(text: str, s: str, out: RenderedChat) -> None:
    if not s:
        return
    at = text.find(s)
    found = False
    while at >= 0:
        found = True
        out.user_spans.append((at, at + len(s)))
        at = text.find(s, at + len(s))
    if not found:
        out.unlocated.append(s)
