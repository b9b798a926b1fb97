"""Hermes-style tool calls (Qwen2.5, Hermes 2/3; our default for templates without tools).

The model writes each call as ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
possibly several, with text before or between them. Whitespace around the JSON is free. The text
outside the tags is content, less the whitespace that lays out the tags.

Malformed output: a call whose JSON breaks off (a closing tag inside unclosed braces, say) keeps
the arguments already sent, and everything up to the next ``</tool_call>`` is dropped. A last
call whose JSON is complete needs no closing tag. One cut off by max_tokens keeps the arguments
already sent (they are not valid JSON); if its name was not complete, it never became a call.
"""

from __future__ import annotations

from .base import ToolParser
from .grammar import call_object_rules, lark_literal, repeated
from .markers import partial_marker, split_content
from .scanner import CallScanner

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

# What the parser is reading.
_CONTENT, _CALL, _CLOSE, _SKIP = range(4)


class HermesParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks among plain text."""

    name = "hermes"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _CONTENT
        self._scanner = CallScanner()

    def _feed(self, final: bool) -> None:
        while self._buf:
            if self._state == _CONTENT:
                text, used, found = split_content(self._buf, OPEN, final)
                self._content(text, before_markup=found)
                self._buf = self._buf[used:]
                if not found:
                    return
                self._state, self._scanner = _CALL, CallScanner()
            elif self._state == _CALL:
                used = self._scanner.feed(self._buf)
                self._buf = self._buf[used:]
                self._drain(self._scanner)
                if self._scanner.done:
                    self._state = _CLOSE
                elif self._scanner.broken:
                    self._state = _SKIP
                else:
                    return
            elif self._state == _CLOSE:
                rest = self._buf.lstrip()
                if rest.startswith(CLOSE):
                    self._buf = rest[len(CLOSE):]
                elif CLOSE.startswith(rest):
                    # Maybe the closing tag; at the end a cut-off one is still markup.
                    self._buf = "" if final else rest
                    return
                else:
                    self._buf = rest  # no closing tag: what follows is content, or the next call
                self._end_markup()
                self._state = _CONTENT
            else:  # _SKIP: the call's JSON broke off; drop the rest of the block
                at = self._buf.find(CLOSE)
                if at < 0:
                    keep = 0 if final else partial_marker(self._buf, CLOSE)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._buf = self._buf[at + len(CLOSE):]
                self._end_markup()
                self._state = _CONTENT

    @classmethod
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool, control=None) -> str:
        # Exactly the layout Qwen2.5's chat template writes for the calls in its history.
        opening, closing = lark_literal(OPEN + "\n"), lark_literal("\n" + CLOSE)
        start = repeated("tool_call", "\n", parallel)
        rules = f"start: {start}\ntool_call: {opening} call_object {closing}\n"
        return rules + call_object_rules(tools, choice)
