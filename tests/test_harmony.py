"""gpt-oss's harmony format (router/harmony.py): analysis as reasoning, final as content, calls to
functions as tool calls, however the text is split; and the grammar that forces a call."""

from __future__ import annotations

import json
import random

import pytest

from fakes import ByteTokenizer
from router.harmony import MARKERS, HarmonyParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

# (text the model writes after the prompt's <|start|>assistant, reasoning, content, calls)
CASES = [
    (A + "Need to think." + NEXT + FINAL + "It is 4.", "Need to think.", "It is 4.", []),
    (FINAL + "Hi there", None, "Hi there", []),
    (A + "Weather?" + NEXT + CALL + '{"city": "Oslo"}', "Weather?", "", [("get_weather", '{"city": "Oslo"}')]),
    # the recipient in the role part, the content type after the channel (the template's own shape)
    (' to=functions.get_time<|channel|>commentary json<|message|>{}', None, "", [("get_time", "{}")]),
    (A + "x" + NEXT + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>',
     "x", "", [("get_weather", '{"city": "Rome"}')]),
    # a preamble on commentary is content; two messages of one field are joined by a newline
    ("<|channel|>commentary<|message|>Checking." + NEXT + CALL + '{"city": "Bern"}', None, "Checking.",
     [("get_weather", '{"city": "Bern"}')]),
    (A + "one" + NEXT + A + "two" + NEXT + FINAL + "three", "one\ntwo", "three", []),
    (A + "a" + NEXT + "<|channel|>commentary<|message|>b" + NEXT + FINAL + "c", "a", "b\nc", []),
    # built-in tools this router does not run: dropped
    (A + "look" + NEXT + "<|channel|>analysis to=browser.search code<|message|>{\"q\": 1}" + NEXT + FINAL + "ok",
     "look", "ok", []),
    # no header at all (a grammar constrained the output): content
    ('{"answer": 42}', None, '{"answer": 42}', []),
    ("Hello <|there|>", None, "Hello <|there|>", []),
    # an unknown channel is content; a body a <|start|> ends; the explicit end tokens
    ("<|channel|>notes<|message|>n" + NEXT + FINAL + "f", None, "n\nf", []),
    (A + "t<|start|>assistant" + FINAL + "f<|return|>", "t", "f", []),
    (A + "t<|end|>", "t", "", []),
    # a header broken off by an end token is dropped; one cut off at the end too
    ("<|channel|>analysis<|end|><|start|>assistant" + FINAL + "y", None, "y", []),
    (A + "t" + NEXT + "<|channel|>fin", "t", "", []),
    # markers' look-alikes in a body are text
    (FINAL + "a <|b|> c <|end", None, "a <|b|> c <|end", []),
    (A + "" + NEXT + FINAL + "", None, "", []),
    ("", None, "", []),
]


def parse(pieces, tools=TOOLS):
    """Feed ``pieces``; return (reasoning, content, calls) as the deltas assembled them, checking
    they agree with the parser's own totals."""
    p = HarmonyParser(tools)
    reasoning, content, calls = "", "", {}
    for delta in [p.push(piece) for piece in pieces] + [p.finish()]:
        reasoning += delta.reasoning
        content += delta.content
        for c in delta.calls:
            if c.id is not None:
                assert c.index not in calls and c.index == len(calls)
                calls[c.index] = [c.name, c.arguments]
            else:
                calls[c.index][1] += c.arguments
    assert (p.reasoning or "") == reasoning
    assert [(c.name, c.arguments) for c in p.calls] == [tuple(v) for v in calls.values()]
    return p.reasoning, content, [tuple(v) for v in calls.values()]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_text(text, reasoning, content, calls):
    assert parse([text]) == (reasoning, content, calls)


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_any_split_gives_the_same_result(text, reasoning, content, calls):
    want = (reasoning, content, calls)
    assert parse(list(text)) == want
    for i in range(len(text) + 1):
        assert parse([text[:i], text[i:]]) == want, i
    rng = random.Random(len(text))
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        assert parse([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == want


def test_random_messages_split_anywhere():
    rng = random.Random(7)
    words = ["a", "b c", "<", "<|", "|>", "\n", "é", "to=x", "{", "}"]
    for _ in range(300):
        text, reasoning, content = "", [], []
        for k in range(rng.randint(1, 4)):
            body = "".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
            if any(m.startswith(body[-i:]) for m in MARKERS for i in range(1, min(len(body), 12) + 1)) or \
                    any(m in body for m in MARKERS):
                body += "z"  # a body that ends like a marker's beginning is the next case's business
            channel = rng.choice(["analysis", "final", "commentary"])
            text += ("" if k == 0 else NEXT) + f"<|channel|>{channel}<|message|>{body}"
            if body:
                (reasoning if channel == "analysis" else content).append(body)
        want = ("\n".join(reasoning) or None, "\n".join(content), [])
        assert parse([text]) == want, text
        cuts = sorted(rng.sample(range(len(text) + 1), 4))
        assert parse([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == want, (text, cuts)


def test_without_tools_a_call_is_dropped():
    assert parse([A + "w" + NEXT + CALL + '{"city": "Oslo"}'], tools=None) == ("w", "", [])


def test_nothing_is_sent_while_text_may_still_be_a_marker():
    p = HarmonyParser(TOOLS)
    assert p.push(" ").content == ""  # may begin " to=functions..."
    p = HarmonyParser(TOOLS)
    out = p.push(FINAL + "ab<|en")
    assert out.content == "ab"
    assert p.push("d|>").content == ""
    p = HarmonyParser(TOOLS)
    assert p.push(FINAL + "ab<|en").content == "ab"
    assert p.push("joy").content == "<|enjoy"


def test_a_call_streams_its_arguments_as_written():
    p = HarmonyParser(TOOLS)
    first = p.push(CALL)
    assert [(c.index, c.name, c.arguments) for c in first.calls] == [(0, "get_weather", "")]
    assert first.calls[0].id.startswith("call_")
    assert [(c.index, c.id, c.arguments) for c in p.push('{"ci').calls] == [(0, None, '{"ci')]
    assert [c.arguments for c in p.push('ty": "Oslo"}').calls] == ['ty": "Oslo"}']
    assert p.finish().calls == []
    assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", '{"city": "Oslo"}')]


# -- the grammar that forces a call -----------------------------------------------------------------

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
tok = ByteTokenizer([*HARMONY_TOKENS, "[TOOL_CALLS]", "[ARGS]", "<|tool_call|>"])


@pytest.fixture(scope="module")
def ll_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    from router.constraints import _TokenTable

    return LLTokenizer(TokenizerWrapper(_TokenTable(tok)))


def matcher(ll_tokenizer, choice=None):
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    grammar = LLMatcher.grammar_from_lark(any_to_lark(HarmonyParser.grammar(TOOLS, choice, True)))
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    assert not is_error, messages
    return LLMatcher(ll_tokenizer, grammar, log_level=0)


def consumes(m, ids) -> bool:
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


def test_the_grammar_takes_a_call_in_the_templates_shape(ll_tokenizer):
    text = CALL + '{"city": "Paris"}<|call|>'
    assert consumes(matcher(ll_tokenizer), tok.encode(text, add_special_tokens=False))
    assert consumes(matcher(ll_tokenizer), tok.encode(text.replace("weather", "time").replace('"city": "Paris"', ""),
                                                      add_special_tokens=False))
    # what it wrote parses back to the call
    assert parse([tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)]) == \
        (None, "", [("get_weather", '{"city": "Paris"}')])


def test_the_grammar_lets_the_model_reason_before_the_call(ll_tokenizer):
    call = CALL + '{"city": "Paris"}<|call|>'
    for text in (A + "Need the weather.\nParis." + NEXT + call, A + 'Not {"city": 7} but...' + NEXT + call):
        assert consumes(matcher(ll_tokenizer), tok.encode(text, add_special_tokens=False))
        assert parse([tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)])[2] == \
            [("get_weather", '{"city": "Paris"}')]
    assert parse([A + "Need the weather.\nParis." + NEXT + call])[0] == "Need the weather.\nParis."


@pytest.mark.parametrize("text", [
    CALL + '{"city": 7}<|call|>',  # arguments against the schema
    CALL.replace("weather", "whether") + '{"city": "Paris"}<|call|>',  # no such tool
    CALL + '{"city": "Paris"}',  # not ended by <|call|>
    A + "hm" + NEXT + FINAL + "It is sunny.<|return|>",  # thinking, then an answer instead of a call
    A + "hm<|return|>",  # thinking ended by another marker than <|end|>
    A + "hm<|call|>",
    A + NEXT + CALL + '{"city": "Paris"}<|call|>',  # an empty analysis
    A + "hm" + NEXT,  # thinking, no call yet: not a whole reply
    A + "one" + NEXT + A + "two" + NEXT + CALL + '{"city": "Paris"}<|call|>',  # one analysis message at most
    "<|channel|>commentary<|message|>Checking." + NEXT + CALL + '{"city": "Paris"}<|call|>',  # a preamble
])
def test_the_grammar_refuses(ll_tokenizer, text):
    assert not consumes(matcher(ll_tokenizer), tok.encode(text, add_special_tokens=False))


def test_the_markers_must_be_the_control_tokens(ll_tokenizer):
    # "<|channel|>" spelled with ordinary tokens is not the marker the model was trained on.
    spelled = tok.encode("<|channel|>", add_special_tokens=False, parse_special=False)
    assert len(spelled) > 1
    assert not matcher(ll_tokenizer).consume_token(spelled[0])


def test_a_named_choice_allows_only_that_tool(ll_tokenizer):
    text = CALL + '{"city": "Paris"}<|call|>'
    assert consumes(matcher(ll_tokenizer, "get_weather"), tok.encode(text, add_special_tokens=False))
    assert not consumes(matcher(ll_tokenizer, "get_time"), tok.encode(text, add_special_tokens=False))
    with pytest.raises(ValueError, match="get_whether"):
        HarmonyParser.grammar(TOOLS, "get_whether", False)


def test_the_grammar_text():
    lines = HarmonyParser.grammar(TOOLS[:1], None, False).splitlines()
    assert lines[:4] == [
        "start: analysis? (call_0)",
        'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
        "THOUGHT: /(?s:.+)/",
        'call_0: <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> arguments_0 <|call|>',
    ]
    schema = json.loads(lines[4].removeprefix("arguments_0: %json "))
    assert schema["required"] == ["city"] and schema["additionalProperties"] is False


# -- through the serving pipeline (a scripted engine; the torch engine over HTTP in test_harmony_e2e) --

import plugins.reasoning  # noqa: E402
import plugins.sampling  # noqa: E402
import plugins.structured_outputs  # noqa: E402
import plugins.templating  # noqa: E402
from litestar.testing import TestClient  # noqa: E402

from router.app import create_app  # noqa: E402
from router.backend import LocalBackend  # noqa: E402
from router.config import ConfigError, parse_config  # noqa: E402
from router.engine import LOCAL_ENGINE_CAPABILITIES  # noqa: E402
from router.hookspecs import hookimpl  # noqa: E402
from router.plugins import load_plugins  # noqa: E402
from sse_util import parse_events  # noqa: E402
from test_reasoning import ask, assert_reasoning_tokens  # noqa: E402
from test_serving import ScriptedEngine  # noqa: E402

EOS = tok.special_ids["<|im_end|>"]
SAID = A + "Need to think." + NEXT + FINAL + "It is 4."


class HarmonyEngine(ScriptedEngine):
    """Writes harmony; its template shows what it was given, thinking and reasoning_effort too."""

    chat_template = (
        "{{ reasoning_effort or '-' }}|{% for m in messages %}{{ m.content }}{{ m.thinking or '' }}{% endfor %}"
    )
    capabilities = LOCAL_ENGINE_CAPABILITIES
    max_model_len = 4096

    def __init__(self):
        super().__init__()
        self.tokenizer = tok


class PlainEngine(ScriptedEngine):
    """An engine whose capabilities leave skip_special_tokens out (a third party's, say)."""


HARMONY, PLAIN = HarmonyEngine(), PlainEngine()


def backend(engine):
    return type(f"B{id(engine)}", (LocalBackend,), {"create_engine": lambda self: engine})


class HarmonyPlugin:
    __name__ = "harmony-test"

    @hookimpl
    def register_backends(self, register):
        register("harmony", backend(HARMONY))
        register("plain", backend(PLAIN))


def script(text):
    HARMONY.script = tok.encode(text, add_special_tokens=False) + [EOS]


@pytest.fixture
def client():
    script(SAID)
    found = load_plugins(entrypoints=False, extra=[HarmonyPlugin(), plugins.sampling, plugins.templating,
                                                   plugins.reasoning, plugins.structured_outputs])
    config = (b'[[models]]\nname="oss"\nbackend="harmony"\nreasoning_parser="openai_gptoss"\ntool_parser="openai"\n'
              b'worker=false\n'
              b'[[models]]\nname="raw"\nbackend="harmony"\nworker=false\n'
              b'[[models]]\nname="mistral"\nbackend="harmony"\ntool_parser="mistral"\nworker=false\n'
              b'[[models]]\nname="granite"\nbackend="harmony"\ntool_parser="granite"\nworker=false\n'
              b'[[models]]\nname="plain"\nbackend="plain"\nworker=false\n')
    with TestClient(create_app(parse_config(config, found.backends), found), raise_server_exceptions=False) as c:
        c.get("/health")
        yield c


def stream_choices(client, body):
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return [c for e in parse_events(r.content) for c in e["choices"]]


def test_the_message_has_the_analysis_as_reasoning_and_the_final_as_content(client):
    body = client.post("/v1/chat/completions", json=ask("oss")).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is 4.", "reasoning": "Need to think."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(HARMONY.script)


def test_stream_deltas_reassemble_the_message_and_never_show_a_marker(client):
    got = [c["delta"] for c in stream_choices(client, ask("oss"))]
    assert "".join(d.get("reasoning", "") for d in got) == "Need to think."
    assert "".join(d.get("content", "") for d in got) == "It is 4."
    assert not any("<|" in d.get("reasoning", "") + d.get("content", "") for d in got)


def test_a_call_to_a_function_is_a_tool_call(client):
    script(A + "Weather?" + NEXT + CALL + '{"city": "Oslo"}')
    body = client.post("/v1/chat/completions", json=ask("oss", tools=TOOLS)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "Weather?"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    chunks = stream_choices(client, ask("oss", tools=TOOLS))
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Oslo"}'
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in chunks)


def test_include_reasoning_false_drops_the_analysis(client):
    message = client.post("/v1/chat/completions", json=ask("oss", include_reasoning=False)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is 4.", "reasoning": None}


def test_without_a_parser_control_tokens_are_skipped_unless_asked_for(client):
    message = client.post("/v1/chat/completions", json=ask("raw")).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "analysisNeed to think.assistantfinalIt is 4."}
    body = ask("raw", skip_special_tokens=False)
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == SAID
    assert "".join(c["delta"].get("content", "") for c in stream_choices(client, body)) == SAID
    r = client.post("/v1/completions", json={"model": "raw", "prompt": "hi", "max_tokens": 99, "skip_special_tokens": False})
    assert r.json()["choices"][0]["text"] == SAID
    r = client.post("/v1/completions", json={"model": "raw", "prompt": "hi", "max_tokens": 99, "skip_special_tokens": True})
    assert r.json()["choices"][0]["text"] == "analysisNeed to think.assistantfinalIt is 4."


def test_skip_special_tokens_is_checked(client):
    r = client.post("/v1/chat/completions", json=ask("raw", skip_special_tokens="no"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"
    r = client.post("/v1/chat/completions", json=ask("plain", skip_special_tokens=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"
    assert "cannot honour" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=ask("plain", skip_special_tokens=True)).status_code == 200


def prompt_text():
    return tok.decode(HARMONY.seen[-1].prompt_ids)


def test_reasoning_effort_reaches_the_template(client):
    assert client.post("/v1/chat/completions", json=ask("oss")).status_code == 200
    assert prompt_text().startswith("-|")
    assert client.post("/v1/chat/completions", json=ask("oss", reasoning_effort="low")).status_code == 200
    assert prompt_text().startswith("low|")
    body = ask("oss", reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert prompt_text().startswith("high|")
    r = client.post("/v1/chat/completions", json=ask("oss", reasoning_effort="extreme"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_an_assistant_messages_reasoning_reaches_the_template_as_thinking(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A", "reasoning": "R"},
                {"role": "user", "content": "B"}]
    assert client.post("/v1/chat/completions", json={"model": "oss", "messages": messages}).status_code == 200
    assert prompt_text() == "-|hiARB"


@pytest.mark.parametrize("lines, bad", [
    ('reasoning_parser="openai_gptoss"', "tool_parser = 'hermes'"),
    ('tool_parser="openai"', "reasoning_parser = None"),
    ('reasoning_parser="qwen3"\ntool_parser="openai"', "reasoning_parser = 'qwen3'"),
])
def test_harmony_takes_both_parsers(lines, bad):
    found = load_plugins(entrypoints=False, extra=[HarmonyPlugin()])
    with pytest.raises(ConfigError) as e:
        parse_config(f'[[models]]\nname="m"\nbackend="harmony"\n{lines}\n'.encode(), found.backends)
    assert "models[0]" in str(e.value) and 'reasoning_parser = "openai_gptoss"' in str(e.value) and bad in str(e.value)


@pytest.mark.parametrize("model,said", [
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{}"),  # tokenizers v11 on: [ARGS] a control token too
    ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {}}]'),
])
def test_a_call_marker_is_read_though_it_is_a_control_token(client, model, said):
    script(said)
    body = client.post("/v1/chat/completions", json=ask(model, tools=TOOLS)).json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in body["choices"][0]["message"]["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
    # ... which the text drops by default
    text = said
    for token in ("[TOOL_CALLS]", "[ARGS]", "<|tool_call|>"):
        text = text.replace(token, "")
    assert client.post("/v1/chat/completions", json=ask("raw")).json()["choices"][0]["message"]["content"] == text


def test_a_forced_mistral_call_masks_in_the_control_tokens(client):
    # Through the serving pipeline: the grammar writes [TOOL_CALLS] and [ARGS] as this
    # vocabulary's control tokens, so they are what the mask allows first.
    script("[TOOL_CALLS]get_time[ARGS]{}")
    body = ask("mistral", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["get_time"]
    gate = HARMONY.seen[-1].constraint
    (marker,) = tok.encode("[TOOL_CALLS]", add_special_tokens=False)
    allowed = gate.allowed()
    assert allowed[marker] and not allowed[ord("[")]
    gate.advance(marker)
    for t in tok.encode("get_time", add_special_tokens=False):
        gate.advance(t)
    (args,) = tok.encode("[ARGS]", add_special_tokens=False)
    assert gate.allowed()[args] and not gate.allowed()[ord("[")]


def test_a_constraint_begins_with_the_final_message_but_a_forced_call_at_once(client):
    from router.constraints import TokenConstraint
    from router.thinking_gate import AfterReasoning

    body = ask("oss", response_format={"type": "json_object"})
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == "It is 4."
    gate = HARMONY.seen[-1].constraint
    assert isinstance(gate, AfterReasoning)
    for t in tok.encode(A + "{<|end|><|start|>assistant<|channel|>final", add_special_tokens=False):
        gate.advance(t)
    assert gate.reasoning and gate.allowed() is None
    gate.advance(tok.special_ids["<|message|>"])
    assert not gate.reasoning and gate.allowed()[ord("{")] and not gate.allowed()[ord("x")]
    body = ask("oss", tools=TOOLS, tool_choice="required")
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert isinstance(HARMONY.seen[-1].constraint, TokenConstraint)


@pytest.mark.parametrize("header, opens", [
    ("<|channel|>final <|constrain|>json<|message|>", True),  # a content type, as gpt-oss may name one
    ("<|channel|>final json<|message|>", True),
    ("<|channel|>final<|message|>", True),
    ("<|channel|>final<|end|><|start|>assistant<|channel|>analysis<|message|>", False),  # a broken header
    ("<|channel|>final <|constrain|>json<|end|><|start|>assistant<|channel|>commentary<|message|>", False),
    ("<|channel|>final" + " " * 40 + "<|message|>", False),  # more than a content type fits
])
def test_the_final_messages_header_may_name_a_content_type(client, header, opens):
    body = ask("oss", response_format={"type": "json_object"})
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    gate = HARMONY.seen[-1].constraint
    ids = tok.encode(A + "{" + NEXT + header, add_special_tokens=False)
    for t in ids[:-1]:
        gate.advance(t)
    assert gate.reasoning  # nothing opens before the header's last token
    gate.advance(ids[-1])
    assert gate.reasoning is not opens
    if opens:
        assert gate.allowed()[ord("{")] and not gate.allowed()[ord("x")]


def test_usage_counts_the_analysis_tokens(client):
    assert_reasoning_tokens(client, "oss", tok, "Need to think.", A + "Need to think.<|end|>", "It is 4.")
