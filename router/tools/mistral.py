"""Mistral tool calls (Mistral-7B-Instruct-v0.3, Mixtral, Mistral-Nemo).

The model writes ``[TOOL_CALLS]`` and then a JSON array of ``{"name": "f", "arguments": {...}}``
objects; text before the marker is content. A bare object after the marker (no array) is
accepted too. ``[TOOL_CALLS]`` is a control token in Mistral's tokenizers, so the detokenizer
must keep it in the text this parser reads.

Malformed output: if what follows the marker is not an array of call objects, or a call's JSON
breaks off, the calls already started keep the arguments already sent and the rest of the reply
is dropped. A call cut off by max_tokens keeps the arguments already sent too.
"""

from __future__ import annotations

from typing import ClassVar

from .base import ToolParser
from .grammar import call_object_rules, lark_literal, repeated
from .markers import split_content
from .scanner import CallScanner

TOOL_CALLS = "[TOOL_CALLS]"

# What the parser is reading.
_CONTENT, _OPEN, _ITEM, _CALL, _AFTER_ITEM, _DISCARD = range(6)


class MistralParser(ToolParser):
    """Content, then ``[TOOL_CALLS]`` and a JSON array of call objects."""

    name = "mistral"
    reads_control_tokens = True  # [TOOL_CALLS]
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    """What opens the calls; the first is what the grammar writes."""

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

    def _punctuation(self, state: int, c: str) -> None:
        """Move on past the array's brackets and commas (``c`` is the next character)."""
        if state != _AFTER_ITEM and c == "{":
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
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool) -> str:
        # json.dumps's layout of the list, as mistral-common writes calls in the history.
        calls = repeated("call_object", ", ", parallel)
        return f'start: {lark_literal(cls.markers[0] + "[")} {calls} "]"\n' + call_object_rules(tools, choice)
