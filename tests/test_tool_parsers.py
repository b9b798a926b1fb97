"""Tool-call parsers: streamed model text to content and ``tool_calls``, and their grammars.

The samples are written the way the models write them (Qwen2.5-7B-Instruct for hermes,
Llama-3.1-8B-Instruct for llama3_json, Mistral-7B-Instruct-v0.3 for mistral, granite-3 chat
templates for granite). Every sample is
also fed in random splits and one character at a time: the result must not depend on the split,
which with content only ever growing also means no piece of markup was ever shown.
"""

import json
import random
import re

import pytest

from fakes import ByteTokenizer
from router.tools import PARSERS, ParsedDelta, ToolCall, ToolCallDelta, get_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web {like this}.",
        "parameters": {
            "type": "object",
            "properties": {
                "q": {"type": "string"},
                "filters": {"type": "object", "properties": {"site": {"type": "string"}}},
            },
            "required": ["q"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
TOOLS = [WEATHER, SEARCH, TIME]

ID = re.compile(r"call_[0-9a-f]{24}")


class Result:
    """Everything one run of a parser produced."""

    def __init__(self, parser, deltas: list[ParsedDelta]) -> None:
        self.deltas = deltas
        self.content = "".join(d.content for d in deltas)
        self.call_deltas = [c for d in deltas for c in d.calls]
        self.calls = parser.calls

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(c.name, c.arguments) for c in self.calls]


def run(fmt: str, pieces, tools=TOOLS) -> Result:
    parser = get_parser(fmt)(tools)
    deltas = [parser.push(p) for p in pieces]
    deltas.append(parser.finish())
    result = Result(parser, deltas)
    check_delta_shape(result)
    return result


def whole(fmt: str, text: str, tools=TOOLS) -> Result:
    return run(fmt, [text], tools)


def chars(text: str) -> list[str]:
    return list(text)


def random_splits(text: str, seed: int) -> list[str]:
    """``text`` cut at 1 to 12 random places."""
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(text)), max(0, min(len(text) - 1, rng.randint(1, 12))))
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check_delta_shape(result: Result) -> None:
    """OpenAI's streaming shape: a first delta (id, name, no arguments) per call, in index order,
    then fragments only, which concatenate to the call's arguments."""
    seen: dict[int, list[str]] = {}
    for d in result.call_deltas:
        if d.index not in seen:
            assert d.index == len(seen)
            assert d.id is not None and ID.fullmatch(d.id) and d.name and d.arguments == ""
            seen[d.index] = []
        else:
            assert d.id is None and d.name is None and d.arguments
            seen[d.index].append(d.arguments)
    assert len(seen) == len(result.calls)
    for i, call in enumerate(result.calls):
        first = next(d for d in result.call_deltas if d.index == i)
        assert (call.id, call.name) == (first.id, first.name)
        assert call.arguments == "".join(seen[i])
    assert len({c.id for c in result.calls}) == len(result.calls)


# -- recorded outputs ---------------------------------------------------------------------------

QWEN_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
QWEN_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}\n</tool_call>'
)
QWEN_TEXT_FIRST = (
    "I'll look up the current weather in Paris for you.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
QWEN_NESTED = (
    '<tool_call>\n{"name": "search", "arguments": {"q": "a } b \\" c ]", '
    '"filters": {"site": "x.org", "tags": [1, {"k": "{"}], "ok": true}}}\n</tool_call>'
)
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
MISTRAL_ONE = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_TWO = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "search", "arguments": {"q": "Paris events"}}]'
)
MISTRAL_TEXT_FIRST = (
    'Let me check that. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
)
# Tokenizers v11 on (Mistral Small 3.2, Magistral, Devstral, Ministral 3): a name, then [ARGS].
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "Paris events"}'
MISTRAL_NAMED_ID = 'Checking.[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'

UNICODE = (
    'Wetter in Zürich ☀️:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京 🌧"}}\n'
    "</tool_call>\nDanach: ✓"
)
NOT_A_MARKER = "Arrays look like [1, 2] and [TOOL is not a marker."
GRANITE_ONE = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
GRANITE_TWO = (
    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "search", "arguments": {"q": "Paris events"}}]'
)
GRANITE_SPELLED = 'Checking.\n<tool_call>[{"name": "get_time", "arguments": {}}]'
GRANITE_NOT_A_MARKER = "Tags like <tool> and <|tool|> and [TOOL_CALLS] are not Granite's marker."

QWEN3_CODER_ONE = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
    "</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_TWO = (
    "I'll check both.\n\n<tool_call>\n<function=search>\n<parameter=q>\na </b> \"c\"\n{x}\n</parameter>\n"
    "<parameter=filters>\n{\"site\": \"ü.org\"}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_time>\n</function>\n</tool_call>"
)
QWEN3_CODER_BARE = "<function=get_weather>\n<parameter=city>\n東京 🌧\n</parameter>\n</function>"
SEED_ONE = ("Checking.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
            "<parameter=unit>celsius</parameter>\n</function>\n</seed:tool_call>")
GLM45_TWO = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n"
             "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>a </b> \"c\"</arg_value>\n<arg_key>filters</arg_key>\n"
             "<arg_value>{\"site\": \"ü.org\"}</arg_value>\n</tool_call>")
GLM47_TIGHT = "Let me see.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
GLM45_NO_ARGS = "<tool_call>get_time\n</tool_call>"
MINIMAX_TWO = ("Two calls.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n"
               "</invoke>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>")

SAMPLES = [
    ("hermes", QWEN_ONE, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("hermes", QWEN_TWO, "", [("get_weather", '{"city": "Paris"}'),
                              ("get_weather", '{"city": "London", "unit": "celsius"}')]),
    ("hermes", QWEN_TEXT_FIRST, "I'll look up the current weather in Paris for you.",
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", QWEN_NESTED, "", [("search", '{"q": "a } b \\" c ]", '
                                 '"filters": {"site": "x.org", "tags": [1, {"k": "{"}], "ok": true}}')]),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "Is 1 < 2? Yes: <b>1 <= 2</b>, and <tool_calls> is not a tag.",
     "Is 1 < 2? Yes: <b>1 <= 2</b>, and <tool_calls> is not a tag.", []),
    ("hermes", UNICODE, "Wetter in Zürich ☀️:\nDanach: ✓", [("get_weather", '{"city": "東京 🌧"}')]),
    ("llama3_json", LLAMA_ONE, "", [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", LLAMA_TAG, "", [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", LLAMA_TWO, "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", '{"answer": 42, "name": "not a tool"}', '{"answer": 42, "name": "not a tool"}', []),
    ("mistral", MISTRAL_ONE, "", [("get_weather", '{"city": "Paris"}')]),
    ("mistral", MISTRAL_TWO, "", [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "Paris events"}')]),
    ("mistral", MISTRAL_TEXT_FIRST, "Let me check that.", [("get_weather", '{"city": "Paris"}')]),
    ("mistral", NOT_A_MARKER, NOT_A_MARKER, []),
    ("mistral", MISTRAL_NAMED, "", [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "Paris events"}')]),
    ("mistral", MISTRAL_NAMED_ID, "Checking.", [("get_weather", '{"city": "Paris"}')]),
    ("granite", GRANITE_ONE, "", [("get_weather", '{"city": "Paris"}')]),
    ("granite", GRANITE_TWO, "", [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "Paris events"}')]),
    ("granite", GRANITE_SPELLED, "Checking.", [("get_time", "{}")]),
    ("granite", GRANITE_NOT_A_MARKER, GRANITE_NOT_A_MARKER, []),
    ("qwen3_coder", QWEN3_CODER_ONE, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("qwen3_coder", QWEN3_CODER_TWO, "I'll check both.", [("search", '{"q": "a </b> \\"c\\"\\n{x}", '
                                                                    '"filters": {"site": "ü.org"}}'), ("get_time", "{}")]),
    ("qwen3_coder", QWEN3_CODER_BARE, "", [("get_weather", '{"city": "東京 🌧"}')]),
    ("qwen3_coder", "Use <b>bold</b> and <function> tags.", "Use <b>bold</b> and <function> tags.", []),
    ("seed_oss", SEED_ONE, "Checking.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("glm45", GLM45_TWO, "", [("get_weather", '{"city": "Paris"}'),
                              ("search", '{"q": "a </b> \\"c\\"", "filters": {"site": "ü.org"}}')]),
    ("glm45", GLM47_TIGHT, "Let me see.", [("get_weather", '{"city": "Paris"}')]),
    ("glm45", GLM45_NO_ARGS, "", [("get_time", "{}")]),
    ("minimax_m2", MINIMAX_TWO, "Two calls.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
]
SAMPLE_IDS = [f"{fmt}-{i}" for i, (fmt, *_) in enumerate(SAMPLES)]


@pytest.mark.parametrize("fmt,text,content,pairs", SAMPLES, ids=SAMPLE_IDS)
def test_whole_text(fmt, text, content, pairs):
    r = whole(fmt, text)
    assert r.content == content
    assert r.pairs == pairs
    for _, arguments in pairs:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("fmt,text,content,pairs", SAMPLES, ids=SAMPLE_IDS)
def test_one_character_at_a_time(fmt, text, content, pairs):
    r = run(fmt, chars(text))
    assert (r.content, r.pairs) == (content, pairs)


@pytest.mark.parametrize("fmt,text,content,pairs", SAMPLES, ids=SAMPLE_IDS)
def test_random_splits_give_the_same_result(fmt, text, content, pairs):
    for seed in range(40):
        r = run(fmt, random_splits(text, seed))
        assert (r.content, r.pairs) == (content, pairs), seed


# -- streaming: arguments as they are written -----------------------------------------------------


@pytest.mark.parametrize("fmt,text", [
    ("hermes", QWEN_NESTED), ("hermes", UNICODE), ("llama3_json", LLAMA_TAG), ("mistral", MISTRAL_TWO),
    ("granite", GRANITE_TWO), ("mistral", MISTRAL_NAMED),
])
def test_arguments_stream_as_soon_as_written(fmt, text):
    """After each character, the arguments sent so far are exactly the arguments value written
    so far: nothing is held back once the name is known."""
    parser = get_parser(fmt)(TOOLS)
    sent: dict[int, str] = {}
    expected = [c.arguments for c in whole(fmt, text).calls]
    starts = [text.index(a) for a in expected]
    for pos, c in enumerate(text, 1):
        for d in parser.push(c).calls:
            sent[d.index] = sent.get(d.index, "") + d.arguments
        for i, (start, args) in enumerate(zip(starts, expected)):
            written = text[start:pos][: len(args)]
            assert sent.get(i, "") == written, (pos, i)


def test_first_delta_comes_when_the_name_is_complete():
    parser = get_parser("hermes")(TOOLS)
    assert parser.push('<tool_call>\n{"name": "get_wea').calls == []
    first = parser.push('ther", ').calls
    assert len(first) == 1 and first[0].name == "get_weather" and first[0].arguments == ""
    assert parser.push('"arguments": {"ci').calls == [ToolCallDelta(0, arguments='{"ci')]


def test_one_fragment_per_call_per_push():
    deltas = whole("hermes", QWEN_TWO).call_deltas
    assert [(d.index, d.id is not None) for d in deltas] == [(0, True), (0, False), (1, True), (1, False)]


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'),
    ("llama3_json", '{"parameters": {"city": "Paris"}, "name": "get_weather"}'),
    ("mistral", '[TOOL_CALLS][{"arguments": {"city": "Paris"}, "name": "get_weather"}]'),
])
def test_arguments_before_name_wait_for_the_name(fmt, text):
    parser = get_parser(fmt)(TOOLS)
    cut = text.index('"name"')
    assert parser.push(text[:cut]).calls == []
    calls = parser.push(text[cut:]).calls
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", ""), (None, '{"city": "Paris"}')]
    parser.finish()
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}')]


# -- content and markup ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,marker", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                                        ("granite", "<|tool_call|>"), ("granite", "<tool_call>")])
def test_a_split_marker_is_held_back_then_consumed(fmt, marker):
    parser = get_parser(fmt)(TOOLS)
    assert parser.push("Checking " + marker[:4]).content == "Checking"
    assert parser.push(marker[4:-1]).content == ""
    assert parser.push(marker[-1]).content == ""


@pytest.mark.parametrize("fmt,almost", [
    ("hermes", "<tool_c"), ("mistral", "[TOOL_CA"), ("llama3_json", "<|python"), ("granite", "<|tool_ca"),
    ("granite", "<tool_ca"),
])
def test_a_partial_marker_at_the_end_is_content(fmt, almost):
    parser = get_parser(fmt)(TOOLS)
    held = parser.push(almost).content
    assert held == ""  # could still be the marker
    assert parser.finish().content == almost


def test_held_text_is_released_when_it_is_not_a_marker():
    parser = get_parser("hermes")(TOOLS)
    assert parser.push("a <").content == "a"
    assert parser.push("tool").content == ""
    assert parser.push("s> b").content == " <tools> b"


@pytest.mark.parametrize("text,content", [
    ("Sure.\n\n<tool_call>\nCALL\n</tool_call>\n", "Sure."),
    ("\n<tool_call>\nCALL\n</tool_call>\n\n  Done.\n", "Done.\n"),
    ("Sure.\n\n<tool_call>\nCALL\n</tool_call>\n  Done.\n", "Sure.\n\nDone.\n"),
    ("A<tool_call>CALL</tool_call>B", "AB"),
    ("A\n<tool_call>CALL</tool_call>\n<tool_call>CALL</tool_call> \nB", "A\nB"),
])
def test_hermes_layout_whitespace_around_tags_is_not_content(text, content):
    text = text.replace("CALL", '{"name": "get_time", "arguments": {}}')
    for pieces in ([text], chars(text)):
        r = run("hermes", pieces)
        assert r.content == content
        assert len(r.calls) == text.count("get_time")


def test_hermes_text_between_calls():
    text = (
        'First: <tool_call>{"name": "get_time", "arguments": {}}</tool_call> then '
        '<tool_call>  {"name": "search", "arguments": {"q": "x"}}  </tool_call> end'
    )
    r = whole("hermes", text)
    assert r.content == "First: then end"
    assert r.pairs == [("get_time", "{}"), ("search", '{"q": "x"}')]


def test_hermes_closing_tag_inside_a_string_does_not_end_the_call():
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "</tool_call> <tool_call>"}}\n</tool_call>'
    for pieces in ([text], chars(text)):
        r = run("hermes", pieces)
        assert r.content == "" and r.pairs == [("search", '{"q": "</tool_call> <tool_call>"}')]


def test_content_only_with_trailing_newline_is_kept():
    assert whole("hermes", "Hello!\n").content == "Hello!\n"
    assert whole("mistral", "Hello!\n").content == "Hello!\n"
    assert whole("llama3_json", "  Hello!\n").content == "  Hello!\n"


def test_empty_reply():
    for fmt in PARSERS:
        r = whole(fmt, "")
        assert (r.content, r.calls) == ("", [])


# -- malformed and cut-off calls -------------------------------------------------------------------


@pytest.mark.parametrize("fmt,text,partial", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', '{"city": "Par'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"ci', '{"ci'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', '{"city": "Par'),
])
def test_unterminated_call_keeps_its_partial_arguments(fmt, text, partial):
    for pieces in ([text], chars(text), random_splits(text, 7)):
        r = run(fmt, pieces)
        assert r.content == ""
        assert r.pairs == [("get_weather", partial)]


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "get_wea'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_wea'),
    ("llama3_json", '<|python_tag|>{"name": "get_wea'),
])
def test_cut_off_before_the_name_is_no_call_and_no_content(fmt, text):
    r = whole(fmt, text)
    assert (r.content, r.calls) == ("", [])


def test_llama3_cut_off_before_the_name_without_tag_is_content():
    # Nothing showed it was a call: it might have been a JSON answer.
    text = '{"name": "get_wea'
    assert whole("llama3_json", text).content == text


def test_hermes_complete_call_without_closing_tag():
    text = 'Ok.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_'
    for pieces in ([text], chars(text)):
        r = run("hermes", pieces)
        assert (r.content, r.pairs) == ("Ok.", [("get_weather", '{"city": "Paris"}')])
    r = whole("hermes", '<tool_call>{"name": "get_time", "arguments": {}}')
    assert (r.content, r.pairs) == ("", [("get_time", "{}")])


@pytest.mark.parametrize("body,arguments", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}', '{"city": "Paris"}'),
    ('{"name": "get_weather", "arguments": {"city": "Paris"', '{"city": "Paris"\n'),
])
def test_hermes_broken_json_drops_the_rest_of_the_block(body, arguments):
    """A closing tag where the JSON needs a brace: the arguments keep what was sent, the
    block ends there, and content and calls after it are read as usual."""
    text = f"<tool_call>\n{body}\n</tool_call>\nNext.<tool_call>\n" + '{"name": "get_time"}\n</tool_call>'
    for pieces in ([text], chars(text)):
        r = run("hermes", pieces)
        assert r.content == "Next."
        assert r.pairs == [("get_weather", arguments), ("get_time", "{}")]


def test_hermes_unclosed_string_takes_the_rest_of_the_reply():
    # Inside a string a closing tag is text, so nothing is known to end the arguments.
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "x}}\n</tool_call>\nNext.'
    r = whole("hermes", text)
    assert (r.content, r.pairs) == ("", [("search", '{"q": "x}}\n</tool_call>\nNext.')])


def test_hermes_block_that_is_not_json_is_dropped():
    r = whole("hermes", "A<tool_call>\nget_weather(city='Paris')\n</tool_call>B")
    assert (r.content, r.calls) == ("AB", [])


def test_hermes_next_call_without_closing_the_previous():
    text = (
        '<tool_call>{"name": "get_time", "arguments": {}}\n'
        '<tool_call>{"name": "search", "arguments": {"q": "a"}}'
    )
    r = whole("hermes", text)
    assert (r.content, r.pairs) == ("", [("get_time", "{}"), ("search", '{"q": "a"}')])


def test_call_without_arguments_gets_an_empty_object():
    assert whole("hermes", '<tool_call>{"name": "get_time"}</tool_call>').pairs == [("get_time", "{}")]
    assert whole("mistral", '[TOOL_CALLS][{"name": "get_time"}]').pairs == [("get_time", "{}")]


def test_extra_keys_are_ignored():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]'
    assert whole("mistral", text).pairs == [("get_weather", '{"city": "Paris"}')]
    text = '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}'
    assert whole("llama3_json", text).pairs == [("get_weather", '{"city": "Paris"}')]


def test_arguments_are_the_raw_text_trimmed_at_the_ends():
    text = '<tool_call>{"name": "search", "arguments":   {\n  "q" :"x"\n}   }</tool_call>'
    assert whole("hermes", text).pairs == [("search", '{\n  "q" :"x"\n}')]


def test_non_object_arguments_pass_through_as_written():
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    assert whole("hermes", text).pairs == [("search", '"{\\"q\\": \\"x\\"}"')]


def test_unknown_tool_names_are_reported_as_called():
    text = '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>'
    assert whole("hermes", text).pairs == [("launch_rocket", "{}")]


def test_llama3_json_answer_is_content():
    for text in ('{"name": "Ada", "born": 1815}', '{"result": {"name": "get_weather"}}', '{"a": 1} and more'):
        for pieces in ([text], chars(text)):
            r = run("llama3_json", pieces)
            assert (r.content, r.calls) == (text, [])


def test_llama3_without_tools_everything_untagged_is_content():
    assert whole("llama3_json", LLAMA_ONE, tools=[]).content == LLAMA_ONE


def test_llama3_accepts_arguments_key_and_leading_whitespace():
    r = whole("llama3_json", '\n\n {"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert (r.content, r.pairs) == ("", [("get_weather", '{"city": "Paris"}')])


def test_llama3_text_after_the_call_is_content():
    r = whole("llama3_json", LLAMA_ONE + "\nHope that helps!")
    assert (r.content, r.pairs) == ("Hope that helps!", [("get_weather", '{"city": "Paris"}')])


def test_llama3_python_tag_without_json_is_content():
    r = whole("llama3_json", '<|python_tag|>brave_search.call(query="Paris")')
    assert (r.content, r.calls) == ('brave_search.call(query="Paris")', [])


def test_mistral_bare_object_and_text_after():
    r = whole("mistral", '[TOOL_CALLS] {"name": "get_time", "arguments": {}} ok')
    assert (r.content, r.pairs) == ("ok", [("get_time", "{}")])
    r = whole("mistral", MISTRAL_ONE + "\n\nAnything else?")
    assert (r.content, r.pairs) == ("Anything else?", [("get_weather", '{"city": "Paris"}')])


def test_mistral_malformed_array_is_dropped():
    r = whole("mistral", 'Hi [TOOL_CALLS]get_weather\n[ARGS]{"city": "Paris"}')  # a name is one line
    assert (r.content, r.calls) == ("Hi", [])
    r = whole("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}} {"name": "search"}]')
    assert r.pairs == [("get_time", "{}")]


@pytest.mark.parametrize("text,content,pairs", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} Anything else?', "Anything else?",
     [("get_weather", '{"city": "Paris"}')]),
    ("[TOOL_CALLS]get_time[ARGS]42", "", [("get_time", "42")]),  # arguments as written, not an object
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "", [("get_weather", '{"city": "Par')]),  # cut off
    ("[TOOL_CALLS]get_wea", "", []),  # cut off before [ARGS]: no call, and not content
    ("[TOOL_CALLS]get_time[CALL_ID][ARGS]{}", "", [("get_time", "{}")]),
    ("[TOOL_CALLS][ARGS]{}", "", []),  # no name
    ('[TOOL_CALLS]get_time{"a": 1}', "", []),  # no [ARGS]
    ("[TOOL_CALLS]ns/get time[ARGS]{}", "", [("ns/get time", "{}")]),  # any name a tool may have
])
def test_mistral_named_calls_edge_cases(text, content, pairs):
    r = whole("mistral", text)
    assert (r.content, r.pairs) == (content, pairs)


# -- the parser object ----------------------------------------------------------------------------


def test_ids_are_unique_across_parsers():
    ids = {c.id for _ in range(50) for c in whole("hermes", QWEN_TWO).calls}
    assert len(ids) == 100 and all(ID.fullmatch(i) for i in ids)


def test_calls_are_snapshots():
    parser = get_parser("hermes")(TOOLS)
    parser.push(QWEN_ONE)
    parser.calls[0].arguments = "changed"
    assert parser.calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    assert isinstance(parser.calls[0], ToolCall)


def test_nothing_after_finish():
    parser = get_parser("hermes")(TOOLS)
    assert parser.push("Hi <").content == "Hi"
    assert parser.finish().content == " <"
    assert parser.push(QWEN_ONE) == ParsedDelta() and parser.finish() == ParsedDelta()
    assert parser.calls == []


def test_registry():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "granite", *XML_FORMATS}
    for name, cls in PARSERS.items():
        assert get_parser(name) is cls and cls.name == name
    with pytest.raises(ValueError, match="glm45, granite, hermes, llama3_json, minimax_m2, mistral, qwen3_coder, seed_oss"):
        get_parser("qwen3_xml")


# -- grammars -------------------------------------------------------------------------------------

tok = ByteTokenizer()


@pytest.fixture(scope="module")
def ll_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    from router.constraints import _TokenTable

    return LLTokenizer(TokenizerWrapper(_TokenTable(tok)))


def matcher(ll_tokenizer, fmt, tools=TOOLS, choice=None, parallel=False):
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    # The path a grammar constraint takes in router.constraints.
    grammar = LLMatcher.grammar_from_lark(any_to_lark(get_parser(fmt).grammar(tools, choice, parallel)))
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    assert not is_error, messages
    return LLMatcher(ll_tokenizer, grammar, log_level=0)


def accepts(m, text: str) -> bool:
    """Every token of ``text`` is allowed when it comes and the grammar may end after it."""
    for t in tok.encode(text, add_special_tokens=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


def hermes_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def llama_call(body: str) -> str:
    return body.replace('"arguments"', '"parameters"')


def mistral_calls(*bodies: str) -> str:
    return "[TOOL_CALLS][" + ", ".join(bodies) + "]"


def xml_call(body: str, fmt: str) -> str:
    """A JSON call body in an XML-like format's layout (its chat template's): a string value as it
    is, others as JSON."""
    call = json.loads(body)
    text = lambda v: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)  # noqa: E731
    name, args = call["name"], call["arguments"].items()
    if fmt == "glm45":
        return (f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{text(v)}</arg_value>\n"
                                                 for k, v in args) + "</tool_call>")
    if fmt == "minimax_m2":  # one call; the block around them all: xml_calls_of
        return f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{text(v)}</parameter>\n'
                                                    for k, v in args) + "</invoke>\n"
    if fmt == "seed_oss":
        return (f"<seed:tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>{text(v)}</parameter>\n"
                                                                   for k, v in args) + "</function>\n</seed:tool_call>")
    return (f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{text(v)}\n</parameter>\n"
                                                          for k, v in args) + "</function>\n</tool_call>")


def xml_calls_of(fmt: str, *bodies: str) -> str:
    calls = [xml_call(b, fmt) for b in bodies]
    return "<minimax:tool_call>\n" + "".join(calls) + "</minimax:tool_call>" if fmt == "minimax_m2" else "\n".join(calls)


XML_FORMATS = ("qwen3_coder", "seed_oss", "glm45", "minimax_m2")


WRAP = {
    "hermes": lambda *b: "\n".join(hermes_call(x) for x in b),
    "llama3_json": lambda *b: "; ".join(llama_call(x) for x in b),
    "mistral": mistral_calls,
    "granite": lambda *b: "<|tool_call|>[" + ", ".join(b) + "]",
    **{fmt: (lambda f: lambda *b: xml_calls_of(f, *b))(fmt) for fmt in XML_FORMATS},
}
JSON_LAYOUT = {"compact separators", "free whitespace", "extra call key", "wrong type"}
"""INVALID cases that only JSON can get wrong: in Qwen3-Coder's layout they write valid calls (a
string parameter's text is any text)."""
JSON_FORMATS = sorted(set(PARSERS) - set(XML_FORMATS))
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS_C = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NESTED = '{"name": "search", "arguments": {"q": "a } b \\" c", "filters": {"site": "ü.org"}}}'
NOW = '{"name": "get_time", "arguments": {}}'
INVALID = {
    "unknown name": '{"name": "get_whether", "arguments": {"city": "Paris"}}',
    "missing required": '{"name": "get_weather", "arguments": {"unit": "celsius"}}',
    "wrong type": '{"name": "get_weather", "arguments": {"city": 7}}',
    "not in enum": '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',
    "extra key": '{"name": "get_weather", "arguments": {"city": "Paris", "country": "FR"}}',
    "extra nested key": '{"name": "search", "arguments": {"q": "x", "filters": {"site": "a", "lang": "en"}}}',
    "arguments for none": '{"name": "get_time", "arguments": {"tz": "UTC"}}',
    "compact separators": '{"name":"get_weather","arguments":{"city":"Paris"}}',
    "free whitespace": '{"name": "get_weather", "arguments": { "city": "Paris"}}',
    "extra call key": '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "x"}',
}


@pytest.mark.parametrize("fmt", sorted(PARSERS))
@pytest.mark.parametrize("body", [PARIS, PARIS_C, NESTED, NOW])
def test_grammar_accepts_a_valid_call(ll_tokenizer, fmt, body):
    assert accepts(matcher(ll_tokenizer, fmt), WRAP[fmt](body))


@pytest.mark.parametrize("fmt,why", [(fmt, why) for fmt in sorted(PARSERS) for why in sorted(INVALID)
                                     if not (fmt in XML_FORMATS and why in JSON_LAYOUT)])
def test_grammar_rejects_an_invalid_call(ll_tokenizer, fmt, why):
    assert not accepts(matcher(ll_tokenizer, fmt), WRAP[fmt](INVALID[why]))


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_rejects_text_instead_of_a_call(ll_tokenizer, fmt):
    assert not accepts(matcher(ll_tokenizer, fmt), "The weather is nice.")
    assert not accepts(matcher(ll_tokenizer, fmt), "")


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_parallel(ll_tokenizer, fmt):
    two = WRAP[fmt](PARIS, NOW)
    assert accepts(matcher(ll_tokenizer, fmt, parallel=True), two)
    assert accepts(matcher(ll_tokenizer, fmt, parallel=True), WRAP[fmt](PARIS))
    assert not accepts(matcher(ll_tokenizer, fmt, parallel=False), two)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_choice_allows_only_that_tool(ll_tokenizer, fmt):
    assert accepts(matcher(ll_tokenizer, fmt, choice="get_time"), WRAP[fmt](NOW))
    assert not accepts(matcher(ll_tokenizer, fmt, choice="get_time"), WRAP[fmt](PARIS))


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_output_parses_back_to_the_call(ll_tokenizer, fmt):
    text = WRAP[fmt](NESTED, PARIS_C)
    assert accepts(matcher(ll_tokenizer, fmt, parallel=True), text)
    r = run(fmt, chars(text))
    assert r.content == ""
    assert [(n, json.loads(a)) for n, a in r.pairs] == [
        ("search", {"q": 'a } b " c', "filters": {"site": "ü.org"}}),
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_errors_are_values(fmt):
    cls = get_parser(fmt)
    with pytest.raises(ValueError, match="`launch` is not one of the tools: get_weather, search, get_time"):
        cls.grammar(TOOLS, "launch", False)
    with pytest.raises(ValueError, match="at least one tool"):
        cls.grammar([], None, False)


def test_mistrals_grammar_takes_named_calls_too(ll_tokenizer):
    # Tokenizers v11 on write [TOOL_CALLS]name[ARGS]{...}; the grammar lets the model take
    # either form, and the parser reads back what it wrote.
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    two = named + "[TOOL_CALLS]get_time[ARGS]{}"
    assert accepts(matcher(ll_tokenizer, "mistral"), named)
    assert accepts(matcher(ll_tokenizer, "mistral", parallel=True), two)
    assert not accepts(matcher(ll_tokenizer, "mistral"), two)
    assert not accepts(matcher(ll_tokenizer, "mistral", choice="get_time"), named)
    assert not accepts(matcher(ll_tokenizer, "mistral"), '[TOOL_CALLS]get_weather[ARGS]{"city": 7}')
    assert not accepts(matcher(ll_tokenizer, "granite"), "<|tool_call|>get_time[ARGS]{}")  # Mistral's own
    assert [(n, json.loads(a)) for n, a in run("mistral", chars(two)).pairs] == [("get_weather", {"city": "Paris"}),
                                                                                  ("get_time", {})]


def test_grammar_text_for_one_tool():
    grammar = get_parser("hermes").grammar([WEATHER], None, False)
    assert grammar.splitlines()[:4] == [
        "start: tool_call",
        'tool_call: "<tool_call>\\n" call_object "\\n</tool_call>"',
        "call_object: call_0",
        'call_0: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " arguments_0 "}"',
    ]
    schema = json.loads(grammar.splitlines()[4].removeprefix("arguments_0: %json "))
    assert schema["additionalProperties"] is False
    assert schema["x-guidance"] == {
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
    }
    assert WEATHER["function"]["parameters"].get("additionalProperties") is None  # the request is untouched


# -- any text, any split ----------------------------------------------------------------------------

PIECES = [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "<tool", "[TOOL", "<|py",
    "<|tool", "[ARGS]", "[CALL_ID]", "get_time", "[A", "<function=", "</function>", "<parameter=", "</parameter>",
    "<function=get_time>", "<parameter=q>", ">", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="', "</invoke>", '<parameter name="', '">',
    "<seed:tool_call>", "</seed:tool_call>",
    "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', '"get_time"', '"search"', ": ", ", ",
    ";", " ", "\n", "x", "\\", '"', "<", "1", "true", "é", "🌧",
]


def same_for_every_split(fmt: str, text: str, seed: int) -> None:
    expected = whole(fmt, text)
    for pieces in (chars(text), random_splits(text, seed)):
        r = run(fmt, pieces)
        assert (r.content, r.pairs) == (expected.content, expected.pairs), (text, pieces)


@pytest.mark.parametrize("fmt,text,content,pairs", SAMPLES, ids=SAMPLE_IDS)
def test_cut_anywhere_by_max_tokens(fmt, text, content, pairs):
    """Every prefix, as if generation stopped there: no error, and the split does not matter."""
    for end in range(len(text) + 1):
        same_for_every_split(fmt, text[:end], end)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_random_markup_soup(fmt):
    rng = random.Random(fmt)
    for i in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))
        same_for_every_split(fmt, text, i)


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "bool", "null", "list", "obj"] if depth < 3 else ["str", "int"])
    if kind == "str":
        return "".join(rng.choice(['a', ' ', '}', '{', '"', '\\', ']', ':', ',', 'ü', '🌧', '<tool_call>'])
                       for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_object(rng, depth)


def random_object(rng: random.Random, depth: int) -> dict:
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_reply(fmt: str, rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    """A well-formed reply in ``fmt`` with random calls, layout and text; and its calls."""
    calls = [(rng.choice(["get_weather", "search", "get_time"]), random_object(rng, 1))
             for _ in range(rng.randint(1, 3))]
    ws = lambda: rng.choice(["", " ", "\n", "  \n "])  # noqa: E731
    key = "parameters" if fmt == "llama3_json" and rng.random() < 0.7 else "arguments"
    objects = []
    for name, args in calls:
        members = [f'"name":{ws()}{json.dumps(name)}',
                   f'"{key}":{ws()}{json.dumps(args, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)}']
        if rng.random() < 0.3:
            members.reverse()
        objects.append("{" + ws() + f",{ws()}".join(members) + ws() + "}")
    if fmt == "hermes":
        text = rng.choice(["", "Sure, let me check.\n"]) + "\n".join(
            f"<tool_call>{ws()}{o}{ws()}</tool_call>" for o in objects)
    elif fmt == "llama3_json":
        text = rng.choice(["", "<|python_tag|>"]) + "; ".join(objects)
    elif fmt == "mistral" and rng.random() < 0.5:  # v11: each call its name, [ARGS] and its arguments alone
        text = rng.choice(["", "Calling: "]) + "".join(
            f"[TOOL_CALLS]{name}{rng.choice(['', '[CALL_ID]x9Yz'])}[ARGS]{ws()}"
            f"{json.dumps(args, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)}{ws()}"
            for name, args in calls)
    else:
        marker = rng.choice(["<|tool_call|>", "<tool_call>"]) if fmt == "granite" else "[TOOL_CALLS]"
        text = rng.choice(["", "Calling: "]) + marker + ws() + "[" + ", ".join(objects) + "]"
    return text, [(name, args) for name, args in calls]


@pytest.mark.parametrize("fmt", JSON_FORMATS)
def test_random_replies(fmt):  # the XML-like formats': test_tool_parser_xml.py
    rng = random.Random(fmt)
    for i in range(150):
        text, calls = random_reply(fmt, rng)
        r = run(fmt, random_splits(text, i))
        assert [(n, json.loads(a)) for n, a in r.pairs] == calls, text
        assert r.content in ("", "Sure, let me check.", "Calling:")
        same_for_every_split(fmt, text, i)
        # The same reply damaged: a character lost or a piece of markup added somewhere.
        at = rng.randrange(len(text))
        damaged = text[:at] + rng.choice(["", *PIECES]) + text[at + 1:]
        same_for_every_split(fmt, damaged, i)


# -- templates without tools ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_injected_calls_are_written_so_that_the_parser_reads_them_back(fmt):
    from router.tools.inject import inject

    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    messages = [{"role": "user", "content": "Weather and time?"},
                {"role": "assistant", "content": None, "tool_calls": calls}]
    system, user, assistant = inject(messages, TOOLS, fmt)
    assert system["role"] == "system" and '{"name": "get_weather"' in system["content"] and user == messages[0]
    assert "tool_calls" not in assistant
    # The instructions' example is in the parser's format: its markup read as a call (Llama's
    # untagged JSON is a call only when it names one of the tools, which "<function name>" is not).
    example = system["content"].split("nothing else:\n", 1)[1]
    assert whole(fmt, example.replace("<function name>", "get_time")).content == ""
    r = whole(fmt, assistant["content"])
    assert r.content == "" and [(n, json.loads(a)) for n, a in r.pairs] == [("get_weather", {"city": "Zürich"}),
                                                                          ("get_time", {})]


# -- markers that are control tokens in the model's vocabulary ---------------------------------------

CONTROL_TOK = ByteTokenizer(["[TOOL_CALLS]", "[ARGS]", "<|tool_call|>", "<tool_call>", "</tool_call>", "<arg_key>",
                             "</arg_key>", "<arg_value>", "</arg_value>", "<minimax:tool_call>", "</minimax:tool_call>",
                             "<seed:tool_call>", "</seed:tool_call>"])


def control_matcher(fmt, tools=TOOLS, choice=None, parallel=False):
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
    from llguidance.gbnf_to_lark import any_to_lark

    from router.constraints import _TokenTable
    from router.tools.grammar import control_markers

    ll = LLTokenizer(TokenizerWrapper(_TokenTable(CONTROL_TOK)))
    text = get_parser(fmt).grammar(tools, choice, parallel, control_markers(CONTROL_TOK))
    grammar = LLMatcher.grammar_from_lark(any_to_lark(text))
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll)
    assert not is_error, messages
    return LLMatcher(ll, grammar, log_level=0)


def takes(m, ids) -> bool:
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


@pytest.mark.parametrize("fmt,text", [
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    # GLM-4.5's every marker a control token: a string value's text ends where one begins.
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   "</invoke>\n</minimax:tool_call>"),
    ("seed_oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
                 "</seed:tool_call>"),
])
def test_a_forced_call_writes_the_markers_as_the_control_tokens_they_are(fmt, text):
    # A grammar's quoted text never matches a control token: written quoted, the markers could
    # only be spelled out in ordinary tokens, which these models never write.
    as_control = CONTROL_TOK.encode(text, add_special_tokens=False, parse_special=True)
    spelled = CONTROL_TOK.encode(text, add_special_tokens=False, parse_special=False)
    assert len(as_control) < len(spelled)
    assert takes(control_matcher(fmt), as_control)
    assert not takes(control_matcher(fmt), spelled)
    # The parser reads what the model wrote, control tokens spelled out for it.
    r = run(fmt, [CONTROL_TOK.decode(as_control, skip_special_tokens=False)])
    assert (r.content, r.pairs) == ("", [("get_weather", '{"city": "Paris"}')])


def test_a_forced_named_call_to_any_tool_name_is_read_back():
    odd = {"type": "function", "function": {"name": "ns/get weather", "parameters": {"type": "object"}}}
    text = "[TOOL_CALLS]ns/get weather[ARGS]{}"
    ids = CONTROL_TOK.encode(text, add_special_tokens=False, parse_special=True)
    assert takes(control_matcher("mistral", tools=[odd]), ids)
    assert run("mistral", [CONTROL_TOK.decode(ids, skip_special_tokens=False)], tools=[odd]).pairs == [("ns/get weather", "{}")]
