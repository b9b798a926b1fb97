"""The grammar pieces every format shares: one call object to one of the request's tools.

Each format's grammar wraps ``call_object`` in its own markup. The object is written in a fixed
shape, ``{"name": "f", "arguments": {...}}`` with ", " and ": " separators, so the name always
comes first (the parser can start the call at once) and a model has no free whitespace to spend
its tokens on. The arguments are an inline JSON schema (llguidance's ``%json``), closed with
``additionalProperties: false`` where the tool's schema does not say otherwise, so a small model
cannot invent keys forever.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

from ..constraints import ConstraintSpec
from .base import tool_names

if TYPE_CHECKING:
    from ..engine import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for the arguments: the separators ``json.dumps`` writes."""


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def control_markers(tok: "Tokenizer") -> Callable[[str], str]:
    """How a format's marker is written in its grammar for ``tok``'s vocabulary: as the control
    token itself (llguidance's ``<[id]>``) where the vocabulary has the marker as one, since a
    grammar's quoted text never matches a control token (router.constraints marks them apart);
    else as quoted text. For the formats whose parsers read control tokens
    (``reads_control_tokens``: Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, Granite's
    ``<|tool_call|>``)."""
    specials = tok.special_tokens

    def write(text: str) -> str:
        if text in specials:
            ids = tok.encode(text, add_special_tokens=False, parse_special=True)
            if len(ids) == 1:
                return f"<[{ids[0]}]>"
        return lark_literal(text)

    return write


def arguments_schema(tool: dict) -> dict:
    """The tool's ``parameters`` schema as the arguments must match it: an object (also when
    the schema is absent), closed where it does not say otherwise, with our JSON options."""
    params = tool.get("function", {}).get("parameters") or {}
    return closed_schema({"type": "object", **params})


def closed_schema(schema: dict) -> dict:
    """``schema`` closed where it does not say otherwise (objects take no other keys), with our
    JSON options; the request's own schema is left untouched."""
    schema = ConstraintSpec("json", schema, "tools").closed().value
    schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return schema


def chosen_tools(tools: list[dict], choice: str | None) -> list[dict]:
    """The tools a call may name: all of them, or the one ``choice`` names."""
    named = [t for t, name in zip(tools, tool_names(tools)) if name]
    if not named:
        raise ValueError("A tool-call grammar needs at least one tool with a function name.")
    if choice is None:
        return named
    picked = [t for t in named if t["function"]["name"] == choice]
    if not picked:
        known = ", ".join(t["function"]["name"] for t in named)
        raise ValueError(f"The tool choice `{choice}` is not one of the tools: {known}.")
    return picked[:1]


def call_object_rules(tools: list[dict], choice: str | None, arguments_key: str = "arguments") -> str:
    """Lark rules defining ``call_object``: ``{"name": "<tool>", "<arguments_key>": <args>}``
    for one of the chosen tools, the arguments valid against that tool's schema."""
    chosen = chosen_tools(tools, choice)
    lines = ["call_object: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
    for i, tool in enumerate(chosen):
        head = '{"name": ' + json.dumps(tool["function"]["name"]) + ", " + json.dumps(arguments_key) + ": "
        lines.append(f'call_{i}: {lark_literal(head)} arguments_{i} "}}"')
        lines.append(f"arguments_{i}: %json {json.dumps(arguments_schema(tool))}")
    return "\n".join(lines) + "\n"


def repeated(item: str, separator: str, parallel: bool) -> str:
    """Lark for one ``item``, or with ``parallel`` one or more joined by ``separator``."""
    if not parallel:
        return item
    return f"{item} ({lark_literal(separator)} {item})*"
