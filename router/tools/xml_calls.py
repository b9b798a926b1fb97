"""Tool calls as XML-like elements, one per parameter, values as plain text: Qwen3-Coder's,
Seed-OSS's, GLM-4.5's and MiniMax-M2's formats. Their chat templates ask for (and write earlier
calls back as), for ``get_weather(city="Paris")``::

    qwen3_coder   <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>
    seed_oss      <seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>
    glm45         <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>
    minimax_m2    <minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>

possibly several (MiniMax-M2's in one block), after plain text. The parser is one state machine;
each format is its markers (:class:`XmlLayout`). Whitespace between elements is free (GLM-4.7
writes none); a value is the text between its tags less one line break at each end. Values are
not JSON: each becomes JSON by the type the tool's schema gives its parameter, as vLLM's parsers
for these formats convert them: a string as it is; an integer, a number or a boolean parsed
where it is one (else kept as a string); an object, an array or an untyped parameter parsed as
JSON where it is JSON (else kept as a string); ``null`` is null unless the parameter is a
string. A parameter the schema does not name is a string.

A call starts (its name is sent) once its name is complete; its arguments are sent a parameter
at a time, as each value's closing tag arrives, as the JSON object ``{"city": "Paris"}``
growing, and closed at the call's end. Qwen3-Coder's block may also open with ``<function=``
alone (the model dropping ``<tool_call>``). Malformed output: markup that is neither a parameter
nor the call's end closes the call's arguments and drops the rest of the block. A call cut off
by max_tokens keeps the parameters already complete, closed into a JSON object; one cut off
before its name is complete never became a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from .base import ToolParser
from .grammar import chosen_tools, closed_schema, lark_literal, repeated
from .markers import partial_marker, split_content


@dataclass(frozen=True)
class XmlLayout:
    """One format's markers, and the layout its template writes (which a forced call's grammar
    writes)."""

    block_open: str
    block_close: str
    call_open: str  # before the function's name; "" where the name follows the block's opening (GLM)
    name_ends: tuple[tuple[str, bool], ...]  # what may end the name, and whether it is consumed with it
    key_open: str
    key_close: str
    value_open: str  # "" where the value follows the key's closing tag
    value_close: str
    call_close: str | None  # None: the block's closing tag ends the call (GLM)
    calls_per_block: bool = False  # several calls in one block (MiniMax-M2; Qwen3-Coder's may too)
    strip_values: bool = False  # a value loses all whitespace at its ends (GLM, MiniMax-M2), not one line break
    bare_calls: bool = False  # a call may open without the block (Qwen3-Coder's <function= alone)
    # The template's layout: around each call (its name in {name}), each parameter, the calls.
    call_head: str = ""
    call_tail: str = ""
    param_head: str = ""  # its key in {key}
    param_tail: str = ""
    block_head: str = ""  # once around all the calls (MiniMax-M2)
    block_tail: str = ""
    separator: str = "\n"  # between calls


# What the parser is reading.
_CONTENT, _BLOCK, _NAME, _BODY, _KEY, _VALUE_OPEN, _VALUE, _AFTER_CALL, _SKIP = range(9)


class _XmlCall:
    """One call being read: what :meth:`ToolParser._drain` asks of a scanner."""

    __slots__ = ("index", "name", "_parts", "_count")

    def __init__(self, name: str) -> None:
        self.index: int | None = None
        self.name = name
        self._parts: list[str] = []
        self._count = 0  # parameters written

    def add(self, key: str, value: Any) -> None:
        self._parts.append(("{" if not self._count else ", ") + json.dumps(key, ensure_ascii=False) + ": "
                           + json.dumps(value, ensure_ascii=False))
        self._count += 1

    def close(self) -> None:
        self._parts.append("}" if self._count else "{}")

    def take_arguments(self) -> str:
        out = "".join(self._parts)
        self._parts.clear()
        return out


_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array",
               dict: "object"}


def schema_types(schema: Any, defs: dict | None = None, depth: int = 0) -> list[str]:
    """The JSON types a parameter's schema allows: its ``type``, those of its ``anyOf`` / ``oneOf``
    / ``allOf`` branches and ``$ref`` targets (in ``defs``, the tool's ``$defs``), and of its
    ``enum`` or ``const`` values; empty where it names none."""
    if not isinstance(schema, dict) or depth > 16:
        return []
    out: list[str] = []
    kind = schema.get("type")
    out += [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    if defs:
        out += schema_types(_ref_target(schema, defs), defs, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or ():
            out += schema_types(branch, defs, depth + 1)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    out += [_JSON_TYPES.get(type(v), "string") for v in values]
    return list(dict.fromkeys(out))


def _ref_target(schema: dict, defs: dict) -> Any:
    """What ``schema``'s ``$ref`` into the tool's ``$defs`` (or ``definitions``) names; None."""
    ref = schema.get("$ref")
    return defs.get(ref.rsplit("/", 1)[1]) if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")) else None


def _defs(params: Any) -> dict:
    """A tool's parameters' ``$defs`` (or ``definitions``), which its properties' ``$ref`` name."""
    if not isinstance(params, dict):
        return {}
    found = params.get("$defs") or params.get("definitions")
    return found if isinstance(found, dict) else {}


def parameter_types(tool: dict | None) -> dict[str, list[str]]:
    """Each parameter's JSON types in the tool's schema (:func:`schema_types`)."""
    params = ((tool or {}).get("function") or {}).get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return {}
    defs = _defs(params)
    return {k: schema_types(v, defs) for k, v in props.items()}


def _finite(text: str) -> Any:
    """``text`` as JSON, refusing NaN and the infinities (which are no JSON)."""
    def refuse(token: str) -> Any:
        raise ValueError(token)

    def number(token: str) -> float:
        value = float(token)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(token)
        return value

    return json.loads(text, parse_constant=refuse, parse_float=number)


def convert_value(text: str, kinds: list[str] | None, known: bool = True) -> Any:
    """A parameter's text as the JSON value its schema's types make of it (see the module's
    text): the text itself where a string is allowed, or the schema names no type."""
    kinds = kinds or []
    if not known or not kinds or "string" in kinds:
        if "null" in kinds and text.strip().lower() == "null":
            return None
        return text
    if text.strip().lower() == "null":
        return None
    for k in kinds:
        if k == "integer":
            try:
                return int(text.strip())
            except ValueError:
                continue
        if k == "number":
            try:
                value = _finite(text.strip())
            except ValueError:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
        if k == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
    if any(k in ("object", "array") for k in kinds):
        try:
            return _finite(text)
        except ValueError:
            pass
    return text


class XmlCallParser(ToolParser):
    """The state machine every XML-like format shares; a subclass gives its :attr:`layout`."""

    layout: ClassVar[XmlLayout]

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _CONTENT
        self._call: _XmlCall | None = None
        self._types: dict[str, Any] = {}
        self._param = ""
        self._in_block = False  # the call opened inside a block (so the block's closing tag may follow)
        self._dangling = False  # a block left for content without its closing tag, which is still markup
        self._searched = 0  # how far the value being read was searched for its closing tag

    def _feed(self, final: bool) -> None:
        self._read(final)
        if final:
            self._end_call()

    def _read(self, final: bool) -> None:
        lay = self.layout
        while self._buf:
            state = self._state
            if state == _CONTENT:
                openers = (lay.block_open, lay.call_open) if lay.bare_calls else (lay.block_open,)
                text, used, found = split_content(self._buf, openers + (lay.block_close,) * self._dangling, final)
                self._content(text, before_markup=found)
                marker = self._buf[len(text):used]
                self._buf = self._buf[used:]
                if not found:
                    return
                if marker == lay.block_close:  # the closing tag of a block whose calls ended before it
                    self._dangling = False
                    self._end_markup()
                    continue
                self._in_block = marker == lay.block_open
                self._state = _BLOCK if self._in_block else _NAME
            elif state == _BLOCK:  # inside a block: a call, or (between calls) the block's end
                if not lay.call_open:
                    self._buf = self._buf.lstrip()
                    if not self._buf and not final:
                        return  # the name comes after the layout
                    self._state = _NAME
                    continue
                if self._expect((lay.call_open, _NAME), (lay.block_close, _CONTENT), final=final) is None:
                    return
            elif state == _NAME:
                if not self._read_name(final):
                    return
            elif state == _BODY:  # between parameters: a parameter or the call's end
                end = (lay.call_close, _AFTER_CALL) if lay.call_close else (lay.block_close, _CONTENT)
                if self._expect((lay.key_open, _KEY), end, final=final) is None:
                    return
            elif state == _KEY:
                at = self._buf.find(lay.key_close)
                held = 0 if at >= 0 or final else partial_marker(self._buf, lay.key_close)  # GLM's "</arg_"
                bad = any(c in "<\n" for c in self._buf[: at if at >= 0 else len(self._buf) - held])
                if at < 0 and not bad and not final:
                    return
                key = self._buf[:at].strip() if at >= 0 and not bad else ""
                if not key:  # a broken or empty key ends the call
                    self._go(_SKIP)
                    continue
                self._param, self._buf = key, self._buf[at + len(lay.key_close):]
                self._state = _VALUE_OPEN if lay.value_open else _VALUE
            elif state == _VALUE_OPEN:
                if self._expect((lay.value_open, _VALUE), final=final) is None:
                    return
            elif state == _VALUE:
                at = self._buf.find(lay.value_close, self._searched)
                if at < 0:
                    self._searched = max(0, len(self._buf) - len(lay.value_close) + 1)  # a long value: not again
                    if final:  # cut off inside the value: the parameter is lost, the others kept
                        self._buf = ""
                    return
                self._searched = 0
                value = self._buf[:at]
                if lay.strip_values:
                    value = value.strip()
                else:
                    value = value[1:] if value.startswith("\n") else value
                    value = value[:-1] if value.endswith("\n") else value
                self._buf = self._buf[at + len(lay.value_close):]
                assert self._call is not None
                self._call.add(self._param, convert_value(value, self._types.get(self._param), self._param in self._types))
                self._drain(self._call)
                self._state = _BODY
            elif state == _AFTER_CALL:  # the block's end (a bare call's too), or the next call in it
                nexts = ((lay.call_open, _NAME),) if lay.calls_per_block else ()
                found = self._expect((lay.block_close, _CONTENT), *nexts, final=final, otherwise=_CONTENT)
                if found is None:
                    return
                # Content after the call without the block's closing tag: that tag, should it
                # come later, is still markup (a bare call has none).
                self._dangling = self._in_block and not found
            else:  # _SKIP: the block broke off; drop the rest of it
                closers = (lay.block_close,) if self._in_block else tuple(m for m in (lay.call_close, lay.block_close) if m)
                ends = [(at, m) for m in closers if (at := self._buf.find(m)) >= 0]
                if not ends:
                    keep = 0 if final else max(partial_marker(self._buf, m) for m in closers)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                at, marker = min(ends)
                self._buf = self._buf[at + len(marker):]
                self._go(_CONTENT)

    def _expect(self, *options: tuple[str, int], final: bool, otherwise: int = _SKIP) -> str | None:
        """After layout whitespace, one of ``options`` (a marker and the state it leads to;
        leaving for after the call or for content ends the call): the marker found. None: wait
        for more text. Anything else ends the call and goes ``otherwise`` (""): _SKIP
        (malformed: the rest of the block is dropped) or _CONTENT (text after a call)."""
        rest = self._buf.lstrip()
        for marker, state in options:
            if rest.startswith(marker):
                self._buf = rest[len(marker):]
                self._go(state)
                return marker
        partial = any(marker.startswith(rest) for marker, _ in options)
        if partial and not final:
            self._buf = rest  # maybe a marker
            return None
        self._buf = "" if partial else rest  # cut off at the end: still markup
        self._go(otherwise)
        return ""

    def _go(self, state: int) -> None:
        if state in (_AFTER_CALL, _CONTENT, _SKIP):
            self._end_call()
        if state == _CONTENT:
            self._end_markup()
        self._state = state

    def _read_name(self, final: bool) -> bool:
        """The function's name, up to the first of the layout's name ends; False: wait."""
        ends = self.layout.name_ends
        found = [(at, m, consumed) for m, consumed in ends if (at := self._buf.find(m)) >= 0]
        at, marker, consumed = min(found) if found else (-1, "", False)
        # Without an end yet, the buffer's last characters may be one's beginning (GLM's "<arg_").
        held = 0 if at >= 0 or final else max(partial_marker(self._buf, m) for m, _ in ends)
        head = self._buf[: at if at >= 0 else len(self._buf) - held]
        bad = any(c in "<\n" for c in head.strip())
        if at < 0 and not bad and not final:
            return False
        name = head.strip() if at >= 0 else ""
        if bad or not name:  # a broken or empty name ends the block
            self._go(_SKIP)
            return True
        self._buf = self._buf[at + (len(marker) if consumed else 0):]
        self._start_call(name)
        return True

    def _start_call(self, name: str) -> None:
        self._call = _XmlCall(name)
        tool = next((t for t, n in zip(self.tools, self.tool_names) if n == name), None)
        self._types = parameter_types(tool)
        self._drain(self._call)
        self._state = _BODY

    def _end_call(self) -> None:
        """Close the call being read (if any): its arguments end as a JSON object."""
        if self._call is not None:
            self._call.close()
            self._drain(self._call)
            self._call = None

    @classmethod
    def write_calls(cls, calls: list[tuple[str, dict]]) -> str:
        """Calls (name, arguments) written as the format's chat template writes them: a string
        value as it is, any other as JSON."""
        lay = cls.layout
        body = lay.separator.join(
            lay.call_head.format(name=name) + "".join(
                lay.param_head.format(key=key) + (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                + lay.param_tail for key, value in args.items())
            + lay.call_tail for name, args in calls)
        return lay.block_head + body + lay.block_tail

    @classmethod
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool,
                control: Callable[[str], str] | None = None) -> str:
        # The layout the format's chat template writes: each parameter of the tool's schema in
        # its order (the required ones always, the others optional), values typed by it.
        # Markers are written as the control tokens they may be (``control``); a string value's
        # terminal runs up to the first of them after it.
        write = _Writer(cls.layout, control, cls.name)
        lay = cls.layout
        chosen = chosen_tools(tools, choice)
        calls = repeated("tool_call", lay.separator, parallel) if lay.separator or not parallel else "tool_call+"
        lines = [f"start: {write.items(lay.block_head)}{calls}{write.items(lay.block_tail, before=True)}",
                 "tool_call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
        for i, tool in enumerate(chosen):
            head = write.items(lay.call_head.format(name=tool["function"]["name"]))
            lines.append(f"call_{i}: {head}{_parameters_rule(tool, i, write, lines)}{write.items(lay.call_tail).rstrip()}")
        return "\n".join(lines) + "\n"


class Qwen3CoderParser(XmlCallParser):
    """Qwen3-Coder: ``<tool_call>`` ``<function=name>`` ``<parameter=key>`` value
    ``</parameter>`` ... ``</function>`` ``</tool_call>``; ``<function=`` may open a call alone."""

    name = "qwen3_coder"
    layout = XmlLayout(
        block_open="<tool_call>", block_close="</tool_call>", call_open="<function=", name_ends=((">", True),),
        key_open="<parameter=", key_close=">", value_open="", value_close="</parameter>", call_close="</function>",
        bare_calls=True, calls_per_block=True, call_head="<tool_call>\n<function={name}>\n", call_tail="</function>\n</tool_call>",
        param_head="<parameter={key}>\n", param_tail="\n</parameter>\n",
    )


class SeedOssParser(XmlCallParser):
    """Seed-OSS: Qwen3-Coder's elements in ``<seed:tool_call>`` blocks, values without line breaks
    around them."""

    name = "seed_oss"
    reads_control_tokens = True
    layout = XmlLayout(
        block_open="<seed:tool_call>", block_close="</seed:tool_call>", call_open="<function=",
        name_ends=((">", True),), key_open="<parameter=", key_close=">", value_open="", value_close="</parameter>",
        call_close="</function>", calls_per_block=True, call_head="<seed:tool_call>\n<function={name}>\n",
        call_tail="</function>\n</seed:tool_call>", param_head="<parameter={key}>", param_tail="</parameter>\n",
    )


class Glm45Parser(XmlCallParser):
    """GLM-4.5, 4.6 and 4.7: ``<tool_call>name`` then ``<arg_key>key</arg_key><arg_value>value
    </arg_value>`` pairs, ``</tool_call>``."""

    name = "glm45"
    reads_control_tokens = True
    layout = XmlLayout(
        block_open="<tool_call>", block_close="</tool_call>", call_open="",
        name_ends=(("\n", True), ("<arg_key>", False), ("</tool_call>", False)), key_open="<arg_key>",
        key_close="</arg_key>", value_open="<arg_value>", value_close="</arg_value>", call_close=None, strip_values=True,
        call_head="<tool_call>{name}\n", call_tail="</tool_call>",
        param_head="<arg_key>{key}</arg_key>\n<arg_value>", param_tail="</arg_value>\n",
    )


class MiniMaxM2Parser(XmlCallParser):
    """MiniMax-M2: one ``<minimax:tool_call>`` block of ``<invoke name="...">`` calls, each of
    ``<parameter name="...">`` values."""

    name = "minimax_m2"
    reads_control_tokens = True
    layout = XmlLayout(
        block_open="<minimax:tool_call>", block_close="</minimax:tool_call>", call_open='<invoke name="',
        name_ends=(('">', True),), key_open='<parameter name="', key_close='">', value_open="",
        value_close="</parameter>", call_close="</invoke>", calls_per_block=True, strip_values=True,
        call_head='<invoke name="{name}">\n', call_tail="</invoke>\n", param_head='<parameter name="{key}">',
        param_tail="</parameter>\n", block_head="<minimax:tool_call>\n", block_tail="</minimax:tool_call>", separator="",
    )


class _Writer:
    """A layout's text as grammar items: its markers through ``control`` (the control token a
    marker may be), the rest quoted."""

    def __init__(self, layout: XmlLayout, control: Callable[[str], str] | None, format: str) -> None:
        self.layout, self.format = layout, format
        self.control = control or lark_literal
        markers = {layout.block_open, layout.block_close, layout.call_open, layout.call_close, layout.key_open,
                   layout.key_close, layout.value_open, layout.value_close}
        self.markers = sorted((m for m in markers if m), key=len, reverse=True)

    def pieces(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut at its markers: (piece, whether it is a marker written as a control token)."""
        out: list[tuple[str, bool]] = []
        while text:
            at, marker = min(((text.find(m), m) for m in self.markers if m in text), default=(-1, ""))
            if at < 0:
                out.append((text, False))
                break
            if at:
                out.append((text[:at], False))
            out.append((marker, self.control(marker).startswith("<[")))
            text = text[at + len(marker):]
        return out

    def items(self, text: str, before: bool = False) -> str:
        """Grammar items for ``text``, each followed by a space (``before``: preceded by one)."""
        written = [self.control(p) if special else lark_literal(p) for p, special in self.pieces(text)]
        joined = " ".join(written)
        return "" if not joined else f" {joined}" if before else f"{joined} "


def _parameters_rule(tool: dict, i: int, write: _Writer, lines: list[str]) -> str:
    """The parameters of tool ``i`` as a sequence of rules appended to ``lines``; its reference.
    ValueError for a schema the format cannot write: a name holding its markup, a required
    parameter that is not among the properties."""
    lay = write.layout
    name = tool["function"]["name"]
    if any(c in name for c in "<>\n\"") or any(m in name for m, _ in lay.name_ends):
        raise ValueError(f"The tool name `{name}` cannot be written in the {write.format} format.")
    params = tool["function"].get("parameters") or {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = [k for k in params.get("required") or () if isinstance(k, str)]
    missing = [k for k in required if k not in props]
    if missing:
        raise ValueError(f"The tool `{name}` requires `{missing[0]}`, which its parameters' properties do not list.")
    defs = _defs(params)
    parts = []
    for j, (key, schema) in enumerate(props.items()):
        if not key or any(c in key for c in "<>\n\"") or key != key.strip():
            raise ValueError(f"The parameter name `{key}` of `{name}` cannot be written in the {write.format} format.")
        rule = f"p_{i}_{j}"
        element = _parameter(write, lay.param_head.format(key=key), lay.param_tail,
                             schema if isinstance(schema, dict) else {}, defs, f"P_{i}_{j}", lines)
        lines.append(f"{rule}: {element}")
        parts.append(rule if key in required else f"{rule}?")
    return "".join(p + " " for p in parts)


LONGEST_CHECKED = 1000
"""A string's ``minLength`` and ``maxLength`` above this are not checked: llguidance's matcher
runs out of fuel on counted repetitions much longer."""


def _parameter(write: _Writer, opening: str, closing: str, schema: dict, defs: dict, terminal: str,
               lines: list[str]) -> str:
    """One parameter's element: ``opening``, its value, ``closing``, typed as the parser reads it
    back (:func:`schema_types`). An enum's or a const's values are the only texts (a string as
    it is, the others as JSON). A string (or a schema naming no type) is its text: a terminal of
    its own, of the schema's ``minLength`` to ``maxLength`` characters, matching its ``pattern``
    where llguidance's regexes can (``format`` is not checked), holding no closing tag of a
    value nor (where the parser strips them) whitespace or line breaks at its ends, and taking
    ``closing``'s text up to its first control token with it (so that the lexer's longest match
    ends the value where the tag begins). Any other value: JSON valid against the parameter's
    schema (%json: an integer's range, say; the tool's ``$defs`` with it)."""
    head, tail_items = write.items(opening), write.items(closing, before=True)
    schema = _resolved(schema, defs)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    if values:
        texts = dict.fromkeys(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values)
        return f"{head}({' | '.join(lark_literal(t) for t in texts)}){tail_items}"
    kinds = schema_types(schema, defs)
    if kinds and "string" not in kinds:
        with_defs = {**schema, "$defs": defs} if defs and "$defs" not in schema else schema
        return f"{head}%json {json.dumps(closed_schema(with_defs))}{tail_items}"
    pieces = write.pieces(closing)
    text_end = next((n for n, (_, special) in enumerate(pieces) if special), len(pieces))
    tail = _regex_literal("".join(p for p, _ in pieces[:text_end]))
    rest = " ".join(write.control(p) if special else lark_literal(p) for p, special in pieces[text_end:])
    close = _regex_literal(write.layout.value_close)
    low, high = (v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= LONGEST_CHECKED else None
                 for v in (schema.get("minLength"), schema.get("maxLength")))
    length = f"{{{low or 0},{'' if high is None else high}}}"
    # Any text of that length, then the closing text: the value's closing tag only there.
    value = f"/(?s:.{length}){tail}/ & ~/(?s:.*){close}(?s:.*){close}(?s:.*)/" if tail else (
        f"/(?s:.{length})/ & ~/(?s:.*){close}(?s:.*)/")
    # (Whitespace the parser strips off a value's ends, GLM's and MiniMax-M2's, or the line break
    # Seed-OSS's loses, is not kept out here: one more intersection puts llguidance's lexer past
    # its limit on the schemas of real tools. A value written so comes back without it.)
    pattern = _pattern_regex(schema.get("pattern"))
    if pattern is not None:
        value += f" & /{pattern}{tail}/"
    lines.append(f"{terminal}: {value}")
    return f"{head}{terminal}{' ' + rest if rest else ''}"


def _resolved(schema: dict, defs: dict) -> dict:
    """``schema`` with a ``$ref`` to the tool's ``$defs`` replaced by what it names (its own other
    keys kept)."""
    for _ in range(16):
        target = _ref_target(schema, defs)
        if not isinstance(target, dict):
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _pattern_regex(pattern: Any) -> str | None:
    """A JSON schema ``pattern`` (a search, anchored where it says ^ or $ at its ends) as a
    whole-text regex inside Lark's ``/.../``; None where it is none, or holds anchors elsewhere
    (``^a$|^b$``), which llguidance's regexes do not take (the pattern is then not checked)."""
    if not isinstance(pattern, str):
        return None
    inner, start, end = pattern, pattern.startswith("^"), False
    if start:
        inner = inner[1:]
    if inner.endswith("$") and not _escaped(inner, len(inner) - 1):
        inner, end = inner[:-1], True
    if any(c in "^$" and not _escaped(inner, n) and not _in_class(inner, n) for n, c in enumerate(inner)):
        return None
    inner = "".join("\\/" if c == "/" and not _escaped(inner, n) else c for n, c in enumerate(inner))
    return f"{'' if start else '(?s:.*)'}(?:{inner}){'' if end else '(?s:.*)'}"


def _escaped(text: str, at: int) -> bool:
    """Whether the character at ``at`` follows an odd number of backslashes."""
    n = at
    while n > 0 and text[n - 1] == "\\":
        n -= 1
    return (at - n) % 2 == 1


def _in_class(text: str, at: int) -> bool:
    """Whether ``at`` is inside a bracketed character class (``[^a]``'s ``^``)."""
    depth = False
    for n, c in enumerate(text[:at]):
        if c == "[" and not _escaped(text, n):
            depth = True
        elif c == "]" and depth and not _escaped(text, n):
            depth = False
    return depth


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching it exactly, inside Lark's ``/.../``."""
    out = []
    for c in text:
        if c == "\n":
            out.append("\\n")
        elif c == "/":
            out.append("\\/")
        elif c in ".^$*+?()[]{}|\\-&~":
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)
