"""Mistral tool calls.

Two forms, as vLLM's ``mistral`` parser reads them. Mistral-7B-Instruct-v0.3, Mixtral and
Mistral-Nemo write ``[TOOL_CALLS]`` and then a JSON array of ``{"name": "f", "arguments": {...}}``
objects (a bare object is accepted too). The models of Mistral's tokenizers from v11 on (Mistral
Small 3.2, Magistral, Devstral, Ministral 3) write each call as ``[TOOL_CALLS]f[ARGS]{...}``: the
name, then the arguments alone, a call after another (``[CALL_ID]id`` may come between the name
and ``[ARGS]``; the id is not kept). Text before a marker is content. ``[TOOL_CALLS]``,
``[ARGS]`` and ``[CALL_ID]`` are control tokens in Mistral's tokenizers, so the detokenizer must
keep them in the text this parser reads.

Malformed output: if what follows the marker is not an array of call objects nor a name and
``[ARGS]``, or a call's JSON breaks off, the calls already started keep the arguments already
sent and the rest of the reply is dropped. A call cut off by max_tokens keeps the arguments
already sent too; one cut off before its ``[ARGS]`` was never a call.
"""

from __future__ import annotations

import re
from typing import Callable, ClassVar

from .base import ToolParser
from .grammar import call_object_rules, chosen_tools, lark_literal, repeated
from .markers import split_content
from .scanner import CallScanner

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[^\[\n]*")  # a name runs to the next marker (vLLM splits on [ARGS]); any tool name
_CALL_ID = re.compile(r"[A-Za-z0-9]*")

# What the parser is reading.
_CONTENT, _OPEN, _ITEM, _CALL, _AFTER_ITEM, _DISCARD, _NAMED = range(7)


class MistralParser(ToolParser):
    """Content, then ``[TOOL_CALLS]`` and a JSON array of call objects."""

    name = "mistral"
    reads_control_tokens = True  # [TOOL_CALLS]
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    """What opens the calls; the first is what the grammar writes."""
    named_calls: ClassVar[bool] = True
    """Whether ``marker name[ARGS]{...}`` calls are read (and allowed by the grammar) too."""

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _CONTENT
        self._scanner = CallScanner()
        self._bare = False  # the calls are one object, not an array

    def _feed(self, final: bool) -> None:
        while True:
            state = self._state
            if state == _CONTENT:
                if not self._buf:
                    return
                text, used, found = split_content(self._buf, self.markers, final)
                self._content(text, before_markup=found)
                self._buf = self._buf[used:]
                if not found:
                    return
                self._state = _OPEN
            elif state == _CALL:
                used = self._scanner.feed(self._buf)
                self._buf = self._buf[used:]
                self._drain(self._scanner)
                if self._scanner.done:
                    self._state = _AFTER_ITEM
                elif self._scanner.broken:
                    self._state = _DISCARD
                else:
                    return
            elif state == _NAMED:
                if not self._named_call(final):
                    return
            elif state == _DISCARD:
                self._buf = ""
                return
            else:
                rest = self._buf.lstrip()
                if not rest:
                    self._buf = ""  # whitespace inside the markup is layout
                    return
                self._buf = rest
                self._punctuation(state, rest[0])

    def _named_call(self, final: bool) -> bool:
        """Read ``name([CALL_ID]id)?[ARGS]`` off the buffer and start the call (True); False
        while more text may still complete it; the rest is dropped when it cannot."""
        written = _NAME.match(self._buf).group()
        rest, name = self._buf[len(written):], written.strip()
        with_id = rest.startswith(CALL_ID)
        if with_id:
            rest = rest[len(CALL_ID):]
            rest = rest[_CALL_ID.match(rest).end():]
        if name and rest.startswith(ARGS):
            self._buf = rest[len(ARGS):]
            self._bare, self._state, self._scanner = True, _CALL, CallScanner.arguments_of(name)
            return True
        may_come = ARGS.startswith(rest) or (not with_id and CALL_ID.startswith(rest))
        if final or not may_come:
            self._state = _DISCARD
            return True
        return False

    def _punctuation(self, state: int, c: str) -> None:
        """Move on past the array's brackets and commas (``c`` is the next character)."""
        if state == _OPEN and self.named_calls and c not in "[{\n":  # v11: [TOOL_CALLS]name[ARGS]{...}
            self._state = _NAMED
        elif state != _AFTER_ITEM and c == "{":
            self._bare = state == _OPEN
            self._state, self._scanner = _CALL, CallScanner()
        elif state == _OPEN and c == "[":
            self._buf, self._state = self._buf[1:], _ITEM
        elif state == _AFTER_ITEM and self._bare:
            self._end_calls()  # what follows a bare object is content (or another marker)
        elif state == _AFTER_ITEM and c == ",":
            self._buf, self._state = self._buf[1:], _ITEM
        elif state != _OPEN and c == "]":
            self._buf = self._buf[1:]
            self._end_calls()
        else:
            self._state = _DISCARD

    def _end_calls(self) -> None:
        self._state = _CONTENT
        self._end_markup()

    @classmethod
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool,
                control: Callable[[str], str] | None = None) -> str:
        # Either form, as the model prefers: json.dumps's layout of the list, as mistral-common
        # writes calls in the history of the older tokenizers, or v11's named calls. The markers
        # as the control tokens they are in the model's vocabulary (control_markers).
        control = control or lark_literal
        marker = control(cls.markers[0])
        calls = repeated("call_object", ", ", parallel)
        if not cls.named_calls:
            return f'start: {marker} "[" {calls} "]"\n' + call_object_rules(tools, choice)
        named = "named_call (" + marker + " named_call)*" if parallel else "named_call"
        chosen = chosen_tools(tools, choice)
        rules = [f'start: {marker} ("[" {calls} "]" | {named})',
                 "named_call: " + " | ".join(f"named_{i}" for i in range(len(chosen)))]
        args = control(ARGS)
        rules += [f"named_{i}: {lark_literal(t['function']['name'])} {args} arguments_{i}" for i, t in enumerate(chosen)]
        return "\n".join(rules) + "\n" + call_object_rules(tools, choice)
