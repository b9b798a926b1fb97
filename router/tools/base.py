"""What a tool-call parser is: streamed model text in, message content and ``tool_calls`` out.

A parser is fed the model's text piece by piece, split anywhere, and answers each piece with the
content that is safe to show and the tool-call deltas that piece completed, in OpenAI's
streaming shape. Feeding the whole text at once gives the same content and calls as any split.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from .scanner import CallScanner


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of one call, as a ``choices[].delta.tool_calls[]`` entry carries it.

    A call's first delta has its ``id`` and ``name`` and empty ``arguments``; every later delta
    has only the index and the next fragment of the arguments JSON text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of model text turned into: content to show now, and call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    """A whole call, as a non-streaming ``message.tool_calls[]`` entry carries it."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """``call_`` and 24 random hex digits, the shape OpenAI's ids have."""
    return "call_" + secrets.token_hex(12)


def tool_names(tools: list[dict]) -> list[str]:
    """The function names of OpenAI ``tools`` entries, in order."""
    return [t.get("function", {}).get("name", "") for t in tools if isinstance(t, dict)]


class ToolParser:
    """Base of the per-format parsers: call bookkeeping and delta assembly.

    A subclass implements :meth:`_feed` (consume as much of ``self._buf`` as it can decide)
    and uses :meth:`_content`, :meth:`_drain` and :meth:`_end_markup` to report what it found.
    """

    name: ClassVar[str]
    reads_control_tokens: ClassVar[bool] = False
    """Whether the format's markers are control tokens, so the text read must spell them out."""

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self.tool_names = tool_names(tools)
        self._buf = ""  # pushed text not yet decided
        self._calls: list[ToolCall] = []
        self._args: list[list[str]] = []  # each call's fragments, joined only when asked
        self._out = ParsedDelta()
        self._trim_leading = False  # whitespace right after markup is not content
        self._gap = ""  # whitespace before the last markup, shown if more content follows it
        self._shown = False  # any content shown yet
        self._finished = False

    def push(self, text: str) -> ParsedDelta:
        """Feed the next piece of model text; return what can be shown and sent now."""
        if text and not self._finished:
            self._buf += text
            self._feed(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of generation: release held-back text. Never raises on malformed markup."""
        if not self._finished:
            self._finished = True
            self._feed(final=True)
            self._buf = ""
        return self._take()

    @property
    def calls(self) -> list[ToolCall]:
        """Every call started so far; ``arguments`` is the concatenation of its fragments."""
        return [ToolCall(c.id, c.name, "".join(parts)) for c, parts in zip(self._calls, self._args)]

    @classmethod
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool,
                control: Callable[[str], str] | None = None) -> str:
        """A Lark grammar for llguidance that forces one call (or, with ``parallel``, one or
        more) in this format, to one of ``tools`` (exactly ``choice`` when given), with
        arguments valid against that tool's ``parameters``. ``control``: how a marker that may be
        a control token is written (:func:`.grammar.control_markers`; None: quoted text),
        for the formats that read control tokens. ValueError on an unknown choice."""
        raise NotImplementedError

    # -- for subclasses ------------------------------------------------------------------------

    def _feed(self, final: bool) -> None:
        raise NotImplementedError

    def _content(self, text: str, before_markup: bool = False) -> None:
        """Show ``text`` as content. Whitespace between content and markup is the template's
        layout: it is dropped, except that content on both sides of markup stays separated by
        the whitespace that came before the markup."""
        body, gap = (text.rstrip(), text[len(text.rstrip()):]) if before_markup else (text, "")
        if self._trim_leading:
            body = body.lstrip()
        if body:
            if self._shown:
                self._out.content += self._gap
            self._out.content += body
            self._shown, self._trim_leading, self._gap = True, False, ""
        if not self._gap:  # between two calls, the gap before the first one counts
            self._gap = gap

    def _end_markup(self) -> None:
        """Markup just ended: whitespace that follows it is layout, not content."""
        self._trim_leading = True

    def _drain(self, scanner: CallScanner) -> None:
        """Report what ``scanner`` has learnt about its call since last asked: the call's first
        delta once the name is known, then each new fragment of its arguments."""
        if scanner.name is None:
            return  # arguments that came before the name wait in the scanner
        index = scanner.index
        if index is None:
            index = scanner.index = len(self._calls)
            call_id = new_call_id()
            self._calls.append(ToolCall(call_id, scanner.name, ""))
            self._args.append([])
            self._out.calls.append(ToolCallDelta(index, call_id, scanner.name, ""))
        fragment = scanner.take_arguments()
        if not fragment:
            return
        self._args[index].append(fragment)
        last = self._out.calls[-1] if self._out.calls else None
        if last is not None and last.index == index and last.id is None:
            last.arguments += fragment  # one fragment per call per push
        else:
            self._out.calls.append(ToolCallDelta(index, arguments=fragment))

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out
