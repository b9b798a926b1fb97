"""Llama 3.1/3.2 JSON tool calls.

The whole reply is one JSON object, ``{"name": "f", "parameters": {...}}`` (``"arguments"`` is
accepted too), optionally after ``<|python_tag|>``; several calls are separated by ``; ``. A
reply that does not start, after whitespace, with ``{`` or ``<|python_tag|>`` is content.

Without ``<|python_tag|>`` a leading ``{`` may also be a plain JSON answer, so the first object is
held back until its name is known: it is a call only when the name is one of the tools (none
are, when the request has no tools); otherwise the whole reply is content, as written.

Malformed output: text after a call that is neither ``;`` nor another call is content. A call
whose JSON breaks off keeps the arguments already sent and the rest of the reply is dropped; one
cut off by max_tokens keeps them too. A first object cut off before its name was complete was
never known to be a call, so it is content.
"""

from __future__ import annotations

from .base import ToolParser
from .grammar import call_object_rules, repeated
from .scanner import CallScanner

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")

# What the parser is reading.
_START, _FIRST, _CALL, _SEPARATOR, _NEXT, _CONTENT, _DISCARD = range(7)


class Llama3JsonParser(ToolParser):
    """A reply that is a JSON call object, or several joined by ``;``, else plain text."""

    name = "llama3_json"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _START
        self._scanner = CallScanner(ARGUMENT_KEYS)
        self._raw = ""  # the first object's text while it may still be a plain JSON answer

    def _feed(self, final: bool) -> None:
        while True:
            state = self._state
            if state == _START:
                rest = self._buf.lstrip()
                if rest.startswith(PYTHON_TAG):
                    self._buf, self._state = rest[len(PYTHON_TAG):], _NEXT
                elif rest.startswith("{"):
                    self._state = _FIRST
                elif not final and PYTHON_TAG.startswith(rest):
                    return  # only whitespace yet, or maybe the tag
                else:
                    self._state = _CONTENT
            elif state == _FIRST:
                used = self._scanner.feed(self._buf)
                self._raw += self._buf[:used]
                self._buf = self._buf[used:]
                name = self._scanner.name
                if name is not None and name in self.tool_names:
                    self._raw, self._state = "", _CALL
                elif name is not None or self._scanner.done or self._scanner.broken or final:
                    # Not a call: the reply is a plain answer that happens to be JSON.
                    self._buf, self._raw, self._state = self._raw + self._buf, "", _CONTENT
                else:
                    return
            elif state == _CALL:
                used = self._scanner.feed(self._buf)
                self._buf = self._buf[used:]
                self._drain(self._scanner)
                if self._scanner.done:
                    self._state = _SEPARATOR
                elif self._scanner.broken:
                    self._state = _DISCARD
                else:
                    return
            elif state == _SEPARATOR or state == _NEXT:
                rest = self._buf.lstrip()
                if not rest:
                    self._buf = ""  # whitespace between calls is layout
                    return
                if state == _SEPARATOR and rest[0] == ";":
                    self._buf, self._state = rest[1:], _NEXT
                elif state == _NEXT and rest[0] == "{":
                    self._buf, self._state = rest, _CALL
                    self._scanner = CallScanner(ARGUMENT_KEYS)
                else:
                    self._buf, self._state = rest, _CONTENT
                    self._end_markup()
            elif state == _CONTENT:
                self._content(self._buf)
                self._buf = ""
                return
            else:  # _DISCARD
                self._buf = ""
                return

    @classmethod
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool, control=None) -> str:
        # "parameters", as Llama 3.1's own chat template describes the call to the model.
        start = repeated("call_object", "; ", parallel)
        return f"start: {start}\n" + call_object_rules(tools, choice, "parameters")
