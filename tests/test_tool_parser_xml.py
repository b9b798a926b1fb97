"""The XML-like tool-call formats (Qwen3-Coder's, Seed-OSS's, GLM-4.5's, MiniMax-M2's): values
typed by the tool's schema, streaming a parameter at a time, malformed and cut-off replies,
random well-formed replies round-tripping, the forced-call grammar (typed values, string
constraints, no closing tag inside a value), and forced calls over HTTP.

The shared samples (whole text, any split, cut anywhere, grammar round trips, control-token
markers) are in test_tool_parsers.py beside the other formats'."""

from __future__ import annotations

import json
import random

import pytest

from router.tools.xml_calls import convert_value, parameter_types
import test_tool_parsers
from test_tool_parsers import (
    TOOLS, XML_FORMATS, accepts, chars, matcher, random_splits, run, same_for_every_split, whole, xml_calls_of,
)

FMT = "qwen3_coder"
TYPED = {
    "type": "function",
    "function": {
        "name": "configure",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "count": {"type": "integer", "minimum": 0, "maximum": 99},
                "ratio": {"type": "number"},
                "on": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "extra": {"type": "object", "properties": {"k": {"type": "integer"}}},
                "note": {"type": ["string", "null"]},
                "mode": {"enum": ["fast", "slow"]},
                "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
            },
            "required": ["name", "count"],
        },
    },
}
ALL_TOOLS = [*TOOLS, TYPED]


def xml(function: str, fmt: str = FMT, **params: str) -> str:
    """One call in ``fmt``'s layout, its values the text given."""
    return xml_calls_of(fmt, json.dumps({"name": function, "arguments": params}))


@pytest.mark.parametrize("text,kind,value", [
    ("Paris", "string", "Paris"),
    ("42", "string", "42"),  # a string stays a string, whatever it looks like
    ("null", "string", "null"),
    ("null", ["string", "null"], None),
    ("42", "integer", 42),
    (" -7 ", "integer", -7),
    ("4.5", "integer", "4.5"),  # not an integer: kept as written
    ("4.5", "number", 4.5),
    ("1e3", "number", 1000.0),
    ("12", "number", 12),
    ("abc", "number", "abc"),
    ("True", "boolean", True),
    ("false", "boolean", False),
    ("yes", "boolean", "yes"),
    ("null", "integer", None),
    ('{"a": [1, 2]}', "object", {"a": [1, 2]}),
    ("[1, 2]", "array", [1, 2]),
    ("{not json", "object", "{not json"),
    ('{"a": 1}', None, '{"a": 1}'),  # untyped: the text (as vLLM takes it)
    ("plain words", None, "plain words"),
    ("3", ["integer", "string"], "3"),  # a string among the types wins: the text as it is
    ("NaN", "number", "NaN"),  # no JSON: kept as text
    ("1e999", "number", "1e999"),
    ("[Infinity]", "array", "[Infinity]"),
    ('{"x": NaN}', "object", '{"x": NaN}'),
])
def test_values_take_their_schema_type(text, kind, value):
    got = convert_value(text, kind if isinstance(kind, list) else [kind] if kind else [])
    assert got == value and json.loads(json.dumps(got, allow_nan=False)) == value


def test_a_parameter_the_schema_does_not_name_is_a_string():
    assert convert_value("42", ["integer"], known=False) == "42"
    types = parameter_types(TYPED)
    assert types["count"] == ["integer"] and types["mode"] == ["string"] and parameter_types(None) == {}


def test_types_come_from_branches_references_and_enums():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"Color": {"enum": ["red", "blue"]}, "N": {"type": "integer"}},
        "properties": {
            "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # Pydantic's Optional[str]
            "color": {"$ref": "#/$defs/Color"}, "n": {"allOf": [{"$ref": "#/$defs/N"}]},
            "flag": {"const": True}, "mixed": {"enum": ["1", None]}, "nums": {"oneOf": [{"type": "integer"}, {"type": "array"}]},
        }}}}
    types = parameter_types(tool)
    assert types == {"maybe": ["string", "null"], "color": ["string"], "n": ["integer"], "flag": ["boolean"],
                     "mixed": ["string", "null"], "nums": ["integer", "array"]}
    r = whole(FMT, xml("f", maybe="42", color="red", n="7", flag="true", mixed="1", nums="[1]"), [tool])
    assert json.loads(r.pairs[0][1]) == {"maybe": "42", "color": "red", "n": 7, "flag": True, "mixed": "1", "nums": [1]}
    assert json.loads(whole(FMT, xml("f", maybe="null", mixed="null"), [tool]).pairs[0][1]) == {"maybe": None,
                                                                                                "mixed": None}
    r = whole(FMT, xml("get_weather", city="7", country="42"), ALL_TOOLS)
    assert r.pairs == [("get_weather", '{"city": "7", "country": "42"}')]


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_every_type_in_one_call(fmt):
    text = xml("configure", fmt, name="ab", count="3", ratio="0.5", on="true", tags='["x", "y"]', extra='{"k": 1}',
               note="null", mode="fast")
    r = run(fmt, chars(text), ALL_TOOLS)
    assert [(n, json.loads(a)) for n, a in r.pairs] == [("configure", {
        "name": "ab", "count": 3, "ratio": 0.5, "on": True, "tags": ["x", "y"], "extra": {"k": 1}, "note": None,
        "mode": "fast"})]


def test_arguments_stream_a_parameter_at_a_time():
    parser_deltas = []
    from router.tools import get_parser

    parser = get_parser(FMT)(TOOLS)
    text = xml("get_weather", city="Paris", unit="celsius")
    for piece in ("<tool_call>\n<function=get_", "weather>\n<parameter=city>\nPar", "is\n</parameter>\n",
                  "<parameter=unit>\ncelsius\n</parameter>\n</function>", "\n</tool_call>"):
        parser_deltas.append([(c.index, c.name, c.arguments) for c in parser.push(piece).calls])
    assert "".join(text) == text
    assert parser_deltas == [
        [],  # the name is not complete
        [(0, "get_weather", "")],  # the name, as soon as it is complete
        [(0, None, '{"city": "Paris"')],  # a parameter once its closing tag came
        [(0, None, ', "unit": "celsius"}')],  # the next, and the object's end at </function>
        [],
    ]
    assert parser.finish().calls == []


@pytest.mark.parametrize("text,content,pairs", [
    # Cut off inside a value: the parameters already complete, closed into an object.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncel", "",
     [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\n<function=get_time>\n", "", [("get_time", "{}")]),
    ("<tool_call>\n<function=get_ti", "", []),  # the name never completed: no call
    ("Sure.\n<tool_call>\n", "Sure.", []),
    # Markup that is neither a parameter nor the end: the call ends there, the block is dropped.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<oops>\n</tool_call>After",
     "After", [("get_weather", '{"city": "Paris"}')]),
    ("<tool_call>\nno function here\n</tool_call>Then text.", "Then text.", []),
    ("<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>", "", []),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "", []),
    ("<tool_call>\n<function=get_weather>\n<parameter=>\nx\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", "{}")]),
    # No closing </tool_call>: what follows is content.
    ("<tool_call>\n<function=get_time>\n</function>\nDone.", "Done.", [("get_time", "{}")]),
    # A value keeps its inner line breaks and markup other than its closing tag.
    (xml("search", q="line 1\n<b>two</b>\n\nthree"), "", [("search", '{"q": "line 1\\n<b>two</b>\\n\\nthree"}')]),
])
def test_malformed_and_cut_off_replies(text, content, pairs):
    r = whole(FMT, text)
    assert (r.content, r.pairs) == (content, pairs)
    same_for_every_split(FMT, text, len(text))


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(["a", " ", "\n", "<", ">", "{", "}", '"', "ü", "🌧", "<tool_call>", "</function>", "x=1",
                               "<arg_key>", "</invoke>", '">'])
                   for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_random_replies_round_trip(fmt):
    """Random calls to the typed tool written as the chat template writes them, read back in
    random splits: the same values (strings as written, the others as typed)."""
    from router.tools import get_parser

    rng = random.Random(fmt)
    strips = get_parser(fmt).layout.strip_values
    for i in range(200):
        calls = []
        for _ in range(rng.randint(1, 3)):
            # GLM's and MiniMax-M2's values lose the whitespace at their ends, the others a line break
            name = random_text(rng).strip() if strips else random_text(rng).strip("\n")
            args = {"name": name or "n", "count": rng.randint(0, 99)}
            if rng.random() < 0.5:
                args["on"] = rng.random() < 0.5
            if rng.random() < 0.5:
                args["tags"] = [random_text(rng) for _ in range(rng.randint(0, 2))]
            if rng.random() < 0.5:
                args["ratio"] = rng.choice([0.25, -3, 1e-5])
            calls.append(args)
        body = xml_calls_of(fmt, *(json.dumps({"name": "configure", "arguments": c}) for c in calls))
        text = rng.choice(["", "Let me set that up.\n\n"]) + body
        r = run(fmt, random_splits(text, i), ALL_TOOLS)
        assert [json.loads(a) for _, a in r.pairs] == calls, text
        assert r.content in ("", "Let me set that up.")


# -- the forced-call grammar ------------------------------------------------------------------------


ll_tokenizer = test_tool_parsers.ll_tokenizer  # the byte tokenizer's, as a fixture here too


CALLS = [  # the parameters of a call to "configure", each value's text; whether the grammar takes it
    ({"name": "ab", "count": "3"}, True),
    ({"name": "ab", "count": "3", "ratio": "-0.5e2", "on": "false", "tags": '["x", "y"]', "extra": '{"k": 2}',
      "note": "anything\nat all", "mode": "slow", "email": "bob@mail.com"}, True),
    ({"count": "3", "name": "ab"}, False),  # the schema's order
    ({"name": "ab"}, False),  # count is required
    ({"name": "ab", "count": "100"}, False),  # above its maximum
    ({"name": "ab", "count": "x"}, False),
    ({"name": "a" * 13, "count": "3"}, False),  # longer than maxLength
    ({"name": "ab", "count": "3", "note": "a{close}b"}, False),  # the value's closing tag inside it
    ({"name": "ab", "count": "3", "on": "yes"}, False),
    ({"name": "ab", "count": "3", "mode": "medium"}, False),  # not in the enum
    ({"name": "ab", "count": "3", "email": "Bob@mail.com"}, False),  # not the pattern
    ({"name": "ab", "count": "3", "extra": '{"k": 1, "j": 2}'}, False),  # closed objects
    ({"name": "ab", "count": "3", "tags": "[1]"}, False),
    ({"name": "ab", "count": "3", "other": "x"}, False),
    ({"name": "", "count": "0"}, True),
]


@pytest.mark.parametrize("params,ok", CALLS)
@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_grammar_types_the_values(ll_tokenizer, fmt, params, ok):
    from router.tools import get_parser

    close = get_parser(fmt).layout.value_close
    text = xml("configure", fmt, **{k: v.format(close=close) if k == "note" else v for k, v in params.items()})
    assert accepts(matcher(ll_tokenizer, fmt, tools=ALL_TOOLS, choice="configure"), text) == ok
    if ok:  # and the parser reads back what the grammar allowed, typed
        (pair,) = whole(fmt, text, ALL_TOOLS).pairs
        assert json.loads(pair[1])["count"] == int(params["count"])


def test_the_grammar_writes_the_wrapper(ll_tokenizer):
    bare = "<function=configure>\n<parameter=name>\nab\n</parameter>\n<parameter=count>\n3\n</parameter>\n</function>"
    assert whole(FMT, bare, ALL_TOOLS).pairs == [("configure", '{"name": "ab", "count": 3}')]  # read, not written
    assert not accepts(matcher(ll_tokenizer, FMT, tools=ALL_TOOLS, choice="configure"), bare)


def test_grammar_text_for_one_tool():
    from router.tools import get_parser

    grammar = get_parser(FMT).grammar(TOOLS, "get_weather", False)
    assert grammar.splitlines()[:2] == ["start: tool_call", "tool_call: call_0"]
    assert ('call_0: "<tool_call>" "\\n" "<function=" "get_weather" ">" "\\n" p_0_0 p_0_1? "</function>" "\\n" '
            '"</tool_call>"') in grammar
    assert 'p_0_1: "<parameter=" "unit" ">" "\\n" ("celsius" | "fahrenheit") "\\n" "</parameter>" "\\n"' in grammar
    assert r"P_0_0: /(?s:.{0,})\n<\/parameter>\n/ & ~/(?s:.*)<\/parameter>(?s:.*)<\/parameter>(?s:.*)/" in grammar


# -- over HTTP: forced calls from the bundled model in this format ---------------------------------


@pytest.fixture(scope="module")
def xml_sdk(tmp_path_factory):
    import openai

    from server import RouterProcess, llamacpp_config

    config = "".join(llamacpp_config(fmt, extra=f'tool_parser = "{fmt}"') for fmt in XML_FORMATS)
    router = RouterProcess(config, tmp_path_factory.mktemp("xml"))
    yield openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=300)
    router.stop()


@pytest.mark.parametrize("fmt,name", [(FMT, "get_weather"), (FMT, "add"),
                                      *((fmt, "send_email") for fmt in XML_FORMATS)])
def test_a_forced_call_is_written_in_xml_and_read_back_typed(xml_sdk, fmt, name):
    """SmolLM2 (whose template knows no tools: the instructions ask for the format) forced to
    call a tool: the grammar makes it write the format's layout, values typed by the schema (an
    integer range, an enum, a pattern, a boolean, a length), and the parser gives OpenAI's
    tool_calls, valid against the tool's schema; streamed, the same call."""
    from test_tools_e2e import assert_forced_call_streams_the_same

    assert not assert_forced_call_streams_the_same(xml_sdk, fmt, name, 150).content


# -- schemas as clients write them (Pydantic's among them), and what a format cannot write ------------

PYDANTIC = {"type": "function", "function": {"name": "paint", "parameters": {
    "type": "object", "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"},
                                "Size": {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]}},
    "properties": {
        "color": {"$ref": "#/$defs/Color"},
        "size": {"$ref": "#/$defs/Size"},
        "label": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "path": {"type": "string", "pattern": "^a\\/b$"},
        "word": {"type": "string", "pattern": "^[a-z]+$|^[0-9]+$"},  # anchors inside: not checked
        "long": {"type": "string", "maxLength": 5000},
        "mode": {"enum": ["fast", None]},
        "fixed": {"const": 3},
    },
    "required": ["color", "size"]}}}


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_grammars_of_pydantic_schemas_compile_and_type_the_values(ll_tokenizer, fmt):
    ok = xml("paint", fmt, color="blue", size='{"w": 2}', label="null", path="a/b", word="x9", long="z" * 40,
             mode="null", fixed="3")
    m = matcher(ll_tokenizer, fmt, tools=[PYDANTIC], choice="paint")
    assert accepts(m, ok)
    (pair,) = whole(fmt, ok, [PYDANTIC]).pairs
    assert json.loads(pair[1]) == {"color": "blue", "size": {"w": 2}, "label": None, "path": "a/b", "word": "x9",
                                   "long": "z" * 40, "mode": None, "fixed": 3}
    for bad in (dict(color="green", size='{"w": 2}'), dict(color="red", size='{"w": "2"}'),
                dict(color="red", size='{"w": 2}', path="a/c"), dict(color="red", size='{"w": 2}', mode="slow"),
                dict(color="red", size='{"w": 2}', fixed="4")):
        assert not accepts(matcher(ll_tokenizer, fmt, tools=[PYDANTIC], choice="paint"), xml("paint", fmt, **bad)), bad


@pytest.mark.parametrize("fmt,value,read", [
    ("glm45", " ab\n", "ab"), ("minimax_m2", "\nab ", "ab"),  # stripped, as vLLM strips them
    ("seed_oss", "\nab\n", "ab"), ("seed_oss", " a\nb ", " a\nb "),  # one line break at each end
    ("qwen3_coder", "\nab", "\nab"),  # its layout's own line breaks come first: read back as written
])
def test_a_string_values_ends_as_each_format_reads_them(ll_tokenizer, fmt, value, read):
    # The grammars do not keep those ends out (one more regex intersection per value put
    # llguidance's lexer past its limit on real tools' schemas): a value so written reads back
    # without them.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}
    text = xml("f", fmt, s=value)
    assert accepts(matcher(ll_tokenizer, fmt, tools=[tool], choice="f"), text)
    assert whole(fmt, text, [tool]).pairs == [("f", json.dumps({"s": read}))]


@pytest.mark.parametrize("fmt", XML_FORMATS)
@pytest.mark.parametrize("tool,why", [
    ({"name": "ns>get", "parameters": {}}, "tool name `ns>get` cannot be written"),
    ({"name": "f", "parameters": {"properties": {"a>b": {}}}}, "parameter name `a>b` of `f` cannot be written"),
    ({"name": "f", "parameters": {"properties": {"a\nb": {}}}}, "cannot be written in the"),
    ({"name": "f", "parameters": {"properties": {"a": {}}, "required": ["a", "b"]}},
     "requires `b`, which its parameters' properties do not list"),
])
def test_what_a_format_cannot_write_is_a_value_error(fmt, tool, why):
    from router.tools import get_parser

    with pytest.raises(ValueError, match=why):
        get_parser(fmt).grammar([{"type": "function", "function": tool}], None, False)


@pytest.mark.parametrize("fmt,text,content,pairs", [
    # Two functions in one Qwen3-Coder block (vLLM reads both); a bare call's stray closing tag.
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n</function>\n</tool_call>", "", [("get_time", "{}"), ("get_weather", '{"city": "Paris"}')]),
    ("qwen3_coder", "<function=get_time>\n</function>\n</tool_call>", "", [("get_time", "{}")]),
    # Words inside the block after its call: content, and the block's late closing tag still markup.
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\nsome words\n</tool_call>", "some words",
     [("get_time", "{}")]),
    ("glm45", "<tool_call>\n\nget_time\n</tool_call>", "", [("get_time", "{}")]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>  Paris \n</arg_value></tool_call>", "",
     [("get_weather", '{"city": "Paris"}')]),  # GLM's values stripped, as vLLM strips them
])
def test_layout_variants_in_any_split(fmt, text, content, pairs):
    r = whole(fmt, text)
    assert (r.content, r.pairs) == (content, pairs)
    same_for_every_split(fmt, text, 5)
    for cut in range(1, len(text)):
        assert (run(fmt, [text[:cut], text[cut:]]).pairs, run(fmt, [text[:cut], text[cut:]]).content) == (pairs, content)


def test_a_long_value_is_searched_for_its_closing_tag_once():
    """Each piece of a long value is searched for the closing tag once, not the whole value
    again each time (a 400 KB value in 4-character pieces took 7.5 s of searching so)."""
    from router.tools import get_parser

    parser = get_parser(FMT)(TOOLS)
    parser.push("<tool_call>\n<function=search>\n<parameter=q>\n")
    for _ in range(1000):
        parser.push("xxxx")
        assert parser._searched >= len(parser._buf) - len("</parameter>") + 1  # where the next search starts
    parser.push("\n</parameter>\n</function>\n</tool_call>")
    assert parser.finish() is not None and parser.calls[0].arguments == json.dumps({"q": "x" * 4000})


@pytest.mark.parametrize("fmt", XML_FORMATS)
def test_grammars_walk_through_a_real_vocabulary(fmt):
    """SmolLM2's vocabulary (multi-character tokens across the markup): every token of a
    well-formed call, as the tokenizer cuts it, is allowed when it comes, the matcher never fails
    (llguidance's lexer has a limit on how large the value regexes may grow), and the call
    completes the grammar."""
    from backends.torch.loader import load_checkpoint
    from router.constraints import ConstraintSpec, GrammarCompiler
    from router.tools import get_parser
    from router.tools.grammar import control_markers
    from test_tools_e2e import TOOLS as E2E_TOOLS
    from torch_models import smollm2_folder

    tok = load_checkpoint(smollm2_folder()).tokenizer
    compiler = GrammarCompiler(tok)
    calls = [("send_email", dict(to="bob@mail\\.com", subject="The meeting moved to 3pm", urgent="false"), E2E_TOOLS),
             ("add", dict(a="-17", b="25"), E2E_TOOLS),
             ("paint", dict(color="red", size='{"w": 2}', label="Sunset </b>", path="a/b", long="z" * 300), [PYDANTIC])]
    for name, params, tools in calls:
        grammar = get_parser(fmt).grammar(tools, name, False, control_markers(tok))
        text = xml(name, fmt, **params)
        constraint = compiler.constraint(ConstraintSpec("grammar", grammar, "tool_choice"))
        for token in tok.encode(text, add_special_tokens=False):
            assert constraint.allowed()[token] and not constraint.error, (name, constraint.error)
            constraint.advance(token)
        assert constraint.done and not constraint.error, (name, constraint.error)
