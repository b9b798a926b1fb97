"""Tools for chat templates that know nothing of tools: a documented system-prompt injection.

Templates that use ``tools`` (Qwen2.5, Llama 3.1, Mistral, Hermes...) get the tool list as Hugging
Face passes it. For the others (SmolLM2's ChatML among them) the router adds the tool list and the
calling convention of the model's tool parser to the system message, and writes earlier assistant
tool calls back as text in that convention, so the conversation the model sees is complete.
"""

from __future__ import annotations

import json
import re
from typing import Any

INSTRUCTIONS = (
    "You can call functions. The available functions are listed below as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one or more blocks of exactly this form and nothing else:\n"
    "{example}"
)

EXAMPLES = {
    "hermes": '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>',
    "llama3_json": '{"name": "<function name>", "parameters": {<arguments as JSON>}}',
    "mistral": '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as JSON>}}]',
    "granite": '<|tool_call|>[{"name": "<function name>", "arguments": {<arguments as JSON>}}]',
}
"""The JSON formats' examples; the XML-like formats write theirs (:func:`_xml_format`)."""

SEPARATORS = {"llama3_json": "; "}
"""What joins several calls of one message, where a format's parser needs more than a line break."""

_USES_TOOLS = re.compile(r"\btools\b")


def template_knows_tools(source: str | None) -> bool:
    return bool(source and _USES_TOOLS.search(source))


def call_as_text(call: dict[str, Any], parser: str) -> str:
    """One earlier assistant tool call, written the way the model is asked to write them."""
    function = call.get("function", {})
    arguments = function.get("arguments", {})
    if parser == "llama3_json":
        return json.dumps({"name": function.get("name"), "parameters": arguments}, ensure_ascii=False)
    if (xml := _xml_format(parser)) is not None:
        return xml.write_calls([(function.get("name"), arguments if isinstance(arguments, dict) else {})])
    if parser in ("mistral", "granite"):
        marker = "[TOOL_CALLS]" if parser == "mistral" else "<|tool_call|>"
        return marker + json.dumps([{"name": function.get("name"), "arguments": arguments}], ensure_ascii=False)
    return "<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _xml_format(parser: str) -> Any:
    """The parser class of an XML-like format (:mod:`.xml_calls`), else None."""
    from . import PARSERS
    from .xml_calls import XmlCallParser

    cls = PARSERS.get(parser)
    return cls if cls is not None and issubclass(cls, XmlCallParser) else None


def inject(messages: list[dict[str, Any]], tools: list[dict[str, Any]], parser: str) -> list[dict[str, Any]]:
    """The conversation with the tool list in its system message and tool calls as text."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    xml = _xml_format(parser)
    example = xml.write_calls([("<function name>", {"<argument name>": "<argument value>"})]) if xml else EXAMPLES.get(
        parser, EXAMPLES["hermes"])
    text = INSTRUCTIONS.format(tools=listing, example=example)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
        out[0]["content"] = out[0]["content"].rstrip() + "\n\n" + text
    else:
        out.insert(0, {"role": "system", "content": text})
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = SEPARATORS.get(parser, "\n").join(call_as_text(c, parser) for c in m["tool_calls"])
            m["content"] = ((m.get("content") or "") + "\n" + calls).strip()
            del m["tool_calls"]
    return out
