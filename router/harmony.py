"""gpt-oss's harmony format: a reply's analysis as ``reasoning``, its final answer as ``content``,
its calls to the request's functions as ``tool_calls`` (vLLM's ``openai_gptoss`` reasoning parser
and ``openai`` tool parser, read here in one pass).

A gpt-oss prompt ends with ``<|start|>assistant``; the model then writes messages of the form::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

or, answering, ``...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>``.
The recipient (``to=...``) may also stand in the role part, before ``<|channel|>``. Every
marker is a control token, so the text this parser reads must spell them out (the choice's
detokenizer keeps control tokens; :attr:`HarmonyParser.reads_control_tokens`). ``<|return|>``
and ``<|call|>`` end generation as gpt-oss's end tokens, so they are seldom seen here; ``<|end|>``
closes a message and the next one follows.

Where each message's text goes:

- channel ``analysis`` (without a recipient): reasoning;
- recipient ``functions.NAME``: a tool call to NAME, its text the arguments, when the request has
  tools (without them there is no call to make, and the text is dropped);
- another recipient (gpt-oss's built-in ``browser`` and ``python`` tools, which this router does
  not run): dropped;
- anything else (``final``, a ``commentary`` preamble without a recipient, an unknown channel):
  content.

Two messages' texts in the same field are joined by a newline, as vLLM joins its analysis
messages. Text the model writes with no header at all (an output a grammar constrained, which
starts with no marker) is content. The parser is one choice's state, fed text piece by piece,
split anywhere; any split gives the same reasoning, content and calls as the whole at once.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from .reasoning import ReasoningDelta, ReplySplitter
from .thinking_gate import EndMarker
from .tools.base import ToolCall, ToolCallDelta, new_call_id
from .tools.grammar import arguments_schema, chosen_tools, lark_literal
from .tools.markers import partial_marker

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_BODY_ENDS = (END, CALL, RETURN, START)  # a <|start|> with no <|end|> before it ends the body too
_HEADER_ENDS = (END, CALL, RETURN)  # a header broken off by one of these is dropped

# How the first message's header may begin (the prompt wrote its <|start|>assistant).
_HEADER_OPENINGS = (CHANNEL, CONSTRAIN, " to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."

# What the parser is reading.
_OPENING, _BETWEEN, _HEADER, _BODY = range(4)


def _held(text: str) -> int:
    """Length of the end of ``text`` that may be the beginning of a marker."""
    return max(partial_marker(text, m) for m in MARKERS)


class HarmonyParser(ReplySplitter):
    """Splits one gpt-oss generation into reasoning, content and tool calls (module docstring).

    ``tools``: the request's tools (None or empty: calls to functions are dropped).
    """

    name: ClassVar[str] = "openai_gptoss"
    reads_control_tokens: ClassVar[bool] = True
    answer_marker: ClassVar[EndMarker] = EndMarker(
        re.compile(rb"<\|channel\|>final[^<]{0,32}(?:<\|constrain\|>[^<]{0,32})?<\|message\|>"),
        len(CHANNEL + "final" + CONSTRAIN + MESSAGE) + 64,
    )
    """Where the answer begins: an output constraint (structured outputs) applies after it. The
    final message's header, ``<|channel|>final`` to ``<|message|>``, may name a content type
    between them (``<|channel|>final <|constrain|>json<|message|>``), as vLLM allows for too."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__()
        self._tools = bool(tools)
        self._state = _OPENING
        self._to: str | None = None  # where the body being read goes: reasoning, content, call, None
        self._fresh = True  # nothing of this message's body sent yet
        self._said = {"reasoning": False, "content": False}  # the field has text from a message
        self._calls: list[ToolCall] = []
        self._args: list[list[str]] = []

    @property
    def thinking(self) -> bool:
        if self._state == _HEADER:  # an analysis message's header (held until <|message|>)
            return self._destination(self._buf) == "reasoning"
        return self._state == _BODY and self._to == "reasoning"

    @property
    def calls(self) -> list[ToolCall]:
        """Every call started so far, its arguments the text its message had."""
        return [ToolCall(c.id, c.name, "".join(parts)) for c, parts in zip(self._calls, self._args)]

    def _feed(self, out: ReasoningDelta, final: bool) -> None:
        while self._buf:
            if self._state in (_OPENING, _BETWEEN):
                opening = _HEADER_OPENINGS if self._state == _OPENING else (START,)
                if self._buf.startswith(START):
                    self._buf, self._state = self._buf[len(START) :], _HEADER
                elif any(self._buf.startswith(o) for o in opening):
                    self._state = _HEADER
                elif not final and any(o.startswith(self._buf) for o in (START, *opening)):
                    return  # may still become a header
                else:
                    self._open("content")  # text with no header: content
            elif self._state == _HEADER:
                at = self._buf.find(MESSAGE)
                broken = min((i for i in (self._buf.find(e) for e in _HEADER_ENDS) if i >= 0), default=-1)
                if broken >= 0 and (at < 0 or broken < at):
                    end = next(e for e in _HEADER_ENDS if self._buf.startswith(e, broken))
                    self._buf, self._state = self._buf[broken + len(end) :], _BETWEEN
                elif at >= 0:
                    header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE) :]
                    self._open(self._destination(header))
                    self._send(out, "")  # a call exists from its header on
                else:
                    return  # the header goes on in the next piece (dropped if there is none)
            else:
                at, end = min(((self._buf.find(e), e) for e in _BODY_ENDS if e in self._buf), default=(-1, ""))
                if at >= 0:
                    self._send(out, self._buf[:at])
                    self._buf = self._buf[at + len(end) :]
                    self._state = _HEADER if end == START else _BETWEEN
                    continue
                keep = 0 if final else _held(self._buf)
                self._send(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return

    def _destination(self, header: str) -> str | None:
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            to = recipient.group(1)
            return "call:" + to[len(FUNCTIONS) :] if to.startswith(FUNCTIONS) and self._tools else None
        channel = _CHANNEL.search(header)
        return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _open(self, to: str | None) -> None:
        self._state, self._to, self._fresh = _BODY, to, True

    def _send(self, out: ReasoningDelta, text: str) -> None:
        to = self._to
        if to is None:
            return
        if to.startswith("call:"):
            if self._fresh:
                self._fresh = False
                call_id = new_call_id()
                self._calls.append(ToolCall(call_id, to[len("call:") :], ""))
                self._args.append([])
                out.calls.append(ToolCallDelta(len(self._calls) - 1, call_id, to[len("call:") :], ""))
            if text:
                self._args[-1].append(text)
                last = out.calls[-1] if out.calls else None
                if last is not None and last.index == len(self._calls) - 1:
                    last.arguments += text
                else:
                    out.calls.append(ToolCallDelta(len(self._calls) - 1, arguments=text))
            return
        if not text:
            return
        if self._fresh:
            self._fresh = False
            if self._said[to]:
                text = "\n" + text  # a later message of the same field
            self._said[to] = True
        if to == "reasoning":
            out.reasoning += text
            self.reasoning_parts.append(text)
        else:
            out.content += text

    @classmethod
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool, control=None) -> str:
        """A Lark grammar for llguidance forcing one call in harmony's shape, as OpenAI's harmony
        guide shows the model writing one (the recipient in the channel's part; gpt-oss's
        template puts it in the role's part of calls in the history, which the parser reads
        too): the markers as the control tokens themselves (a ``<|name|>`` outside quotes), the
        arguments valid JSON for the tool. One call only, even with ``parallel``: ``<|call|>``
        ends the generation. Before it the model may reason, as it was trained to: one analysis
        message of any text (no control token), ended by ``<|end|>`` and followed by the call's
        ``<|start|>assistant``. Like a thinking model's reasoning before its constrained answer,
        it may take all of ``max_tokens``; one message, not several, so that a model cannot
        keep starting new ones instead of calling. ValueError on an unknown choice."""
        chosen = chosen_tools(tools, choice)
        rules = [
            "start: analysis? (" + " | ".join(f"call_{i}" for i in range(len(chosen))) + ")",
            'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
            "THOUGHT: /(?s:.+)/",
        ]
        for i, tool in enumerate(chosen):
            head = lark_literal(f"commentary to={FUNCTIONS}{tool['function']['name']} ")
            rules.append(f'call_{i}: <|channel|> {head} <|constrain|> "json" <|message|> arguments_{i} <|call|>')
            rules.append(f"arguments_{i}: %json {json.dumps(arguments_schema(tool))}")
        return "\n".join(rules) + "\n"
