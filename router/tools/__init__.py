"""Tool calling: turn a model's streamed text into OpenAI ``tool_calls``, and the grammars that
force a well-formed call when the request requires one.

Each chat format has its parser (one module each; the XML-like formats share one state machine,
each its markers: :mod:`.xml_calls`); the registry maps the format names a model's config can
name to the parser classes. A parser is one generation's state: make a new one per choice.

The parsers read the markers as text: ``<|python_tag|>`` (Llama) and ``[TOOL_CALLS]`` (Mistral)
are control tokens, and ``<|tool_call|>`` (Granite) may be one, so the text fed to a parser must
spell them out. A parser whose format needs that says so (``reads_control_tokens``: Mistral's,
Granite's, GLM-4.5's, Seed-OSS's and MiniMax-M2's), and the choice's detokenizer keeps control
tokens; Llama's parser reads the text without them (its tag-less fallback).
"""

from __future__ import annotations

from .base import ParsedDelta, ToolCall, ToolCallDelta, ToolParser
from .granite import GraniteParser
from .hermes import HermesParser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .xml_calls import Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser, SeedOssParser, XmlCallParser

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, GraniteParser, Qwen3CoderParser,
                                       SeedOssParser, Glm45Parser, MiniMaxM2Parser)
}
"""Tool-call formats by name."""


def get_parser(name: str) -> type[ToolParser]:
    """The parser class for a format name; ValueError naming the known formats otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"Unknown tool-call format `{name}`; known formats: {known}.") from None


__all__ = [
    "PARSERS",
    "Glm45Parser",
    "GraniteParser",
    "HermesParser",
    "Llama3JsonParser",
    "MiniMaxM2Parser",
    "MistralParser",
    "ParsedDelta",
    "Qwen3CoderParser",
    "SeedOssParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "XmlCallParser",
    "get_parser",
]
