"""Qwen3-Coder's tool calls: XML-like blocks, one parameter per element, values as plain text.

Qwen3-Coder's chat template asks for (and writes earlier calls back as)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

possibly several, with text before them. A value is the text between ``<parameter=name>`` and
``</parameter>``, less one line break at each end. Values are not JSON: each becomes JSON by the
type the tool's schema gives its parameter, as vLLM's ``qwen3_coder`` parser converts them: a
string as it is; an integer, a number or a boolean parsed where it is one (else kept as a
string); an object, an array or an untyped parameter parsed as JSON where it is JSON (else kept
as a string); ``null`` is null unless the parameter is a string. A parameter the schema does not
name is a string.

The call starts (its name is sent) once ``<function=name>`` is complete; its arguments are sent
a parameter at a time, as each ``</parameter>`` arrives, as the JSON object ``{"city": "Paris"}``
growing, and closed at ``</function>``. A block may also open with ``<function=`` alone (the
model dropping ``<tool_call>``). Malformed output: markup that is neither a parameter nor the
function's end closes the call's arguments and drops the rest of the block. A call cut off by
max_tokens keeps the parameters already complete, closed into a JSON object; one cut off before
its name is complete never became a call.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .base import ToolParser
from .grammar import chosen_tools, closed_schema, lark_literal, repeated
from .markers import partial_marker, split_content

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

# What the parser is reading.
_CONTENT, _FUNCTION, _NAME, _BODY, _PARAM_NAME, _VALUE, _CLOSE, _SKIP = range(8)


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


def parameter_types(tool: dict | None) -> dict[str, Any]:
    """Each parameter's ``type`` in the tool's schema (a name, a list of names, or None)."""
    params = ((tool or {}).get("function") or {}).get("parameters") or {}
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return {}
    return {k: v.get("type") if isinstance(v, dict) else None for k, v in props.items()}


def convert_value(text: str, kind: Any, known: bool = True) -> Any:
    """A parameter's text as the JSON value its schema type makes of it (see the module's text)."""
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)]
    if not known or "string" in kinds:
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
                value = json.loads(text.strip())
            except ValueError:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
        if k == "boolean" and text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
    if not kinds or any(k in ("object", "array") for k in kinds):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


class Qwen3CoderParser(ToolParser):
    """``<tool_call><function=name><parameter=key>value</parameter>...</function></tool_call>``
    blocks after plain text."""

    name = "qwen3_coder"

    def __init__(self, tools: list[dict]) -> None:
        super().__init__(tools)
        self._state = _CONTENT
        self._call: _XmlCall | None = None
        self._types: dict[str, Any] = {}
        self._param = ""
        self._wrapped = False  # the block opened with <tool_call> (so it may close with </tool_call>)

    def _feed(self, final: bool) -> None:
        self._read(final)
        if final:
            self._end_call()

    def _read(self, final: bool) -> None:
        while self._buf:
            state = self._state
            if state == _CONTENT:
                text, used, found = split_content(self._buf, (OPEN, FUNCTION), final)
                self._content(text, before_markup=found)
                marker = self._buf[len(text):used]
                self._buf = self._buf[used:]
                if not found:
                    return
                self._wrapped = marker == OPEN
                self._state = _FUNCTION if self._wrapped else _NAME
            elif state == _FUNCTION:  # after <tool_call>: layout, then <function=
                rest = self._buf.lstrip()
                if rest.startswith(FUNCTION):
                    self._buf, self._state = rest[len(FUNCTION):], _NAME
                elif FUNCTION.startswith(rest):
                    self._buf = rest
                    return
                else:
                    self._buf, self._state = rest, _SKIP
            elif state in (_NAME, _PARAM_NAME):
                at = self._buf.find(">")
                bad = next((i for i, c in enumerate(self._buf[: at if at >= 0 else None]) if c in "<\n"), -1)
                if at < 0 and not final and bad < 0:
                    return
                name = self._buf[:at].strip() if at >= 0 else ""
                if bad >= 0 or not name:  # a broken or empty name ends the block
                    self._end_call()  # none yet for a function's name
                    self._state = _SKIP
                    continue
                self._buf = self._buf[at + 1:]
                if state == _NAME:
                    self._start_call(name)
                else:
                    self._param, self._state = name, _VALUE
            elif state == _BODY:  # between parameters: layout, then a parameter or the end
                rest = self._buf.lstrip()
                if rest.startswith(PARAMETER):
                    self._buf, self._state = rest[len(PARAMETER):], _PARAM_NAME
                elif rest.startswith(FUNCTION_END):
                    self._buf = rest[len(FUNCTION_END):]
                    self._end_call()
                    self._state = _CLOSE if self._wrapped else _CONTENT
                    if not self._wrapped:
                        self._end_markup()
                elif not final and (PARAMETER.startswith(rest) or FUNCTION_END.startswith(rest)):
                    self._buf = rest
                    return
                else:
                    self._end_call()
                    self._buf, self._state = rest, _SKIP
            elif state == _VALUE:
                at = self._buf.find(PARAMETER_END)
                if at < 0:
                    if final:  # cut off inside the value: the parameter is lost, the others kept
                        self._buf = ""
                    return
                value = self._buf[:at]
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                self._buf = self._buf[at + len(PARAMETER_END):]
                assert self._call is not None
                self._call.add(self._param, convert_value(value, self._types.get(self._param), self._param in self._types))
                self._drain(self._call)
                self._state = _BODY
            elif state == _CLOSE:
                rest = self._buf.lstrip()
                if rest.startswith(CLOSE):
                    self._buf = rest[len(CLOSE):]
                elif CLOSE.startswith(rest):
                    self._buf = "" if final else rest  # maybe the closing tag; cut off, still markup
                    return
                else:
                    self._buf = rest  # no closing tag: what follows is content, or the next call
                self._end_markup()
                self._state = _CONTENT
            else:  # _SKIP: the block broke off; drop the rest of it
                ends = [(at, m) for m in ((CLOSE,) if self._wrapped else (CLOSE, FUNCTION_END)) if (at := self._buf.find(m)) >= 0]
                if not ends:
                    keep = 0 if final else max(partial_marker(self._buf, m) for m in (CLOSE, FUNCTION_END))
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                at, marker = min(ends)
                self._buf = self._buf[at + len(marker):]
                self._end_markup()
                self._state = _CONTENT

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
    def grammar(cls, tools: list[dict], choice: str | None, parallel: bool,
                control: Callable[[str], str] | None = None) -> str:
        # The layout Qwen3-Coder's chat template writes: each parameter of the tool's schema in
        # its order (the required ones always, the others optional), values typed by it.
        chosen = chosen_tools(tools, choice)
        start = repeated("tool_call", "\n", parallel)
        lines = [f"start: {start}", "tool_call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
        for i, tool in enumerate(chosen):
            head = f"{OPEN}\n{FUNCTION}{tool['function']['name']}>\n"
            lines.append(f"call_{i}: {lark_literal(head)} {_parameters_rule(tool, i, lines)}"
                         f"{lark_literal(FUNCTION_END + chr(10) + CLOSE)}")
        return "\n".join(lines) + "\n"


def _parameters_rule(tool: dict, i: int, lines: list[str]) -> str:
    """The parameters of tool ``i`` as a sequence of rules appended to ``lines``; its reference."""
    params = tool["function"].get("parameters") or {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ())
    parts = []
    for j, (key, schema) in enumerate(props.items()):
        rule = f"p_{i}_{j}"
        lines.append(f"{rule}: {_parameter(key, schema if isinstance(schema, dict) else {}, f'P_{i}_{j}', lines)}")
        parts.append(rule if key in required else f"{rule}?")
    return "".join(p + " " for p in parts)


def _parameter(key: str, schema: dict, terminal: str, lines: list[str]) -> str:
    """One ``<parameter=key>`` element and its line break. A string (a type naming "string") is
    its text: a terminal of its own holding no closing tag, of the schema's ``minLength`` to
    ``maxLength`` characters, matching its ``pattern`` (``format`` is not checked); an enum of
    strings one of them; any other value JSON valid against the parameter's schema (%json: an
    integer's range, say), as the parser reads them back."""
    opening, closing = f"{PARAMETER}{key}>\n", f"\n{PARAMETER_END}\n"
    kind = schema.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return " | ".join(lark_literal(opening + v + closing) for v in enum)
    if kind != "string" and not (isinstance(kind, list) and "string" in kind):
        return f"{lark_literal(opening)} %json {json.dumps(closed_schema(schema))} {lark_literal(closing)}"
    head, tail, end = _regex_literal(opening), _regex_literal(closing), _regex_literal(PARAMETER_END)
    low, high = schema.get("minLength"), schema.get("maxLength")
    length = f"{{{int(low) if isinstance(low, int) else 0},{int(high) if isinstance(high, int) else ''}}}"
    # Any text of that length that holds no closing tag (only the element's last one is).
    text = f"/{head}(?s:.{length}){tail}/ & ~/(?s:.*){end}(?s:.*){end}(?s:.*)/"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        anchored = pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")
        inner = pattern[1:-1] if anchored else f"(?s:.*)(?:{pattern})(?s:.*)"
        text += f" & /{head}(?:{inner.replace('/', chr(92) + '/')}){tail}/"
    lines.append(f"{terminal}: {text}")
    return terminal


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
