"""IBM Granite 3 tool calls.

Granite's chat template asks for ``<|tool_call|>`` and then a JSON array of ``{"name": "f",
"arguments": {...}}`` objects, as its template writes earlier calls back; some replies spell the
marker ``<tool_call>`` instead, which vLLM's ``granite`` parser takes too. Apart from the marker
this is Mistral's format, read the same way (:mod:`.mistral`): text before the marker is
content, a bare object after it is a call too, and malformed or cut-off output keeps the
arguments already sent. ``<|tool_call|>`` is an added token of Granite's vocabulary, which may be
a control token, so the detokenizer keeps control tokens in the text this parser reads.
"""

from __future__ import annotations

from .mistral import MistralParser

TOOL_CALL = "<|tool_call|>"
SPELLED_OUT = "<tool_call>"


class GraniteParser(MistralParser):
    """Content, then ``<|tool_call|>`` (or ``<tool_call>``) and a JSON array of call objects."""

    name = "granite"
    markers = (TOOL_CALL, SPELLED_OUT)
    named_calls = False  # Mistral's v11 form is Mistral's own
