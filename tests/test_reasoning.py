"""Reasoning parsers (router/reasoning.py): ``<think>`` text as ``reasoning``, the rest as content,
whole or streamed in pieces split anywhere; and the wire shape through the serving pipeline."""

from __future__ import annotations

import itertools
import random

import pytest

from router.reasoning import PARSERS, DeepSeekR1Parser, MistralParser, Qwen3Parser, SeedOssParser, prompt_opens_thinking


def parse(parser_type, pieces, prompt_opens=False):
    """Feed ``pieces`` one at a time; return (streamed reasoning, streamed content, parser)."""
    parser = parser_type(prompt_opens)
    reasoning = content = ""
    for piece in pieces:
        out = parser.push(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    end = parser.finish()
    return reasoning + end.reasoning, content + end.content, parser


CASES = [
    # parser, prompt opens a block, model output, reasoning, content
    (Qwen3Parser, False, "<think>\nI think.\n</think>\n\nHello", "I think.", "Hello"),
    (Qwen3Parser, False, "Hello", None, "Hello"),
    (Qwen3Parser, False, "  Hello there", None, "  Hello there"),  # no block: content as written
    (Qwen3Parser, False, "\n<think>a</think>b", "a", "b"),
    (Qwen3Parser, False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (Qwen3Parser, False, "<think>\n\n</think>\n\nHi", None, "Hi"),  # an empty block
    (Qwen3Parser, False, "<thin", None, "<thin"),  # not a marker after all
    (Qwen3Parser, False, "a</think>b", None, "a</think>b"),  # no block was opened
    (Qwen3Parser, False, "<think>a  b\n c </think> d\n", "a  b\n c", "d\n"),
    (Qwen3Parser, False, "<think>a</thi", "a</thi", ""),
    (Qwen3Parser, False, "<think>a</think>b</think>c", "a", "b</think>c"),
    (Qwen3Parser, False, "", None, ""),
    (Qwen3Parser, True, "I think.\n</think>\n\nHello", "I think.", "Hello"),  # Qwen3 thinking-only models
    (Qwen3Parser, True, "Hello", "Hello", ""),
    (DeepSeekR1Parser, False, "<think>\nx\n</think>\n\ny", "x", "y"),
    (DeepSeekR1Parser, False, "x</think>y", "x", "y"),  # R1's template opened the block
    (DeepSeekR1Parser, False, "x y", "x y", ""),
    (DeepSeekR1Parser, True, "\n\nx\n</think>\n\n", "x", ""),
    (DeepSeekR1Parser, False, "", None, ""),
    (DeepSeekR1Parser, False, "é😀</think>ü", "é😀", "ü"),
    (MistralParser, False, "[THINK]\nI think.\n[/THINK]\n\nHello", "I think.", "Hello"),
    (MistralParser, False, "Hello", None, "Hello"),
    (MistralParser, False, "<think>a</think>b", None, "<think>a</think>b"),  # Qwen's markers are text here
    (MistralParser, False, "[THINK]cut off", "cut off", ""),
    (MistralParser, False, "[THIN", None, "[THIN"),
    (MistralParser, True, "x[/THINK]y", "x", "y"),
    (SeedOssParser, False, "<seed:think>\nLet me see.<seed:cot_budget_reflect>7 left</seed:cot_budget_reflect>\n"
                           "</seed:think>\nParis.", "Let me see.<seed:cot_budget_reflect>7 left</seed:cot_budget_reflect>",
     "Paris."),
    (SeedOssParser, False, "<think>a</think>b", None, "<think>a</think>b"),  # Qwen's markers are text here
    (SeedOssParser, False, "<seed:thi", None, "<seed:thi"),
    (SeedOssParser, True, "x</seed:think>y", "x", "y"),
]


@pytest.mark.parametrize("parser_type,opens,text,reasoning,content", CASES)
def test_whole_text(parser_type, opens, text, reasoning, content):
    streamed, got, parser = parse(parser_type, [text], opens)
    assert (parser.reasoning, got) == (reasoning, content)
    assert streamed == (reasoning or "")


@pytest.mark.parametrize("parser_type,opens,text,reasoning,content", CASES)
def test_any_split_gives_the_same_texts(parser_type, opens, text, reasoning, content):
    cuts = range(1, len(text))
    splits = [[c] for c in cuts] + [list(pair) for pair in itertools.combinations(cuts, 2)]
    splits.append(list(cuts))  # a character at a time
    for points in splits:
        pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
        streamed, got, parser = parse(parser_type, pieces, opens)
        assert (streamed, got) == (reasoning or "", content), pieces
        assert parser.reasoning == reasoning


def test_random_long_texts_split_anywhere():
    rng = random.Random(3)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", " ", "\n", "a", "b", "[THINK]", "[/THINK]", "[", "THINK]",
                "<seed:think>", "</seed:think>", "seed:"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        for parser_type, opens in itertools.product(PARSERS.values(), (False, True)):
            whole = parse(parser_type, [text], opens)
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if text else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            split = parse(parser_type, pieces, opens)
            assert split[:2] == whole[:2] and split[2].reasoning == whole[2].reasoning, (text, pieces)


def test_nothing_is_sent_while_the_start_may_still_be_a_marker():
    parser = Qwen3Parser(False)
    assert parser.push("\n<thi").content == ""
    out = parser.push("nk>Let")
    assert (out.reasoning, out.content) == ("Let", "")
    out = parser.push(" me see </th")
    assert out.reasoning == " me see"  # the space and what may begin </think> wait
    out = parser.push("ink>\n\nIt is 4.")
    assert (out.reasoning, out.content) == ("", "It is 4.")
    assert Qwen3Parser(False).push("Hi").content == "Hi"  # plain content is not held


@pytest.mark.parametrize(
    "tail,opens",
    [("<|im_start|>assistant\n<think>\n", True), ("assistant<think>", True),
     ("<think>\n\n</think>\n\n", False), ("<|im_start|>assistant\n", False), ("", False)],
)
def test_prompt_opens_thinking(tail, opens):
    assert prompt_opens_thinking(tail) is opens
    assert prompt_opens_thinking(tail.replace("<think>", "[THINK]").replace("</think>", "[/THINK]"), "[THINK]") is opens


# --- through the serving pipeline (a scripted engine; real HTTP with real models in test_reasoning_e2e) ---

import plugins.reasoning  # noqa: E402
import plugins.sampling  # noqa: E402
import plugins.structured_outputs  # noqa: E402
import plugins.templating  # noqa: E402
from litestar.testing import TestClient  # noqa: E402

from router.app import create_app  # noqa: E402
from router.backend import LocalBackend  # noqa: E402
from router.config import parse_config  # noqa: E402
from router.hookspecs import hookimpl  # noqa: E402
from router.plugins import load_plugins  # noqa: E402
from sse_util import parse_events  # noqa: E402
from test_serving import EOS, ScriptedEngine, tok  # noqa: E402


class ThinkingEngine(ScriptedEngine):
    """Templates the last message's reasoning_content too (what Qwen3's template reads)."""

    chat_template = "{% for m in messages %}{{ m.content }}{{ m.reasoning_content or '' }}{% endfor %}"
    capabilities = ScriptedEngine.capabilities | {"structured_outputs"}
    max_model_len = 4096  # room for the tool list the router writes into the prompt


THINKER = ThinkingEngine()
SAID = "<think>\nab bc\n</think>\n\nhello world"


class Thinker(LocalBackend):
    def create_engine(self):
        return THINKER


class ThinkerPlugin:
    __name__ = "thinker"

    @hookimpl
    def register_backends(self, register):
        register("thinker", Thinker)


@pytest.fixture
def client():
    THINKER.script = tok.encode(SAID, add_special_tokens=False) + [EOS]
    found = load_plugins(entrypoints=False, extra=[ThinkerPlugin(), plugins.sampling, plugins.templating,
                                                   plugins.reasoning, plugins.structured_outputs])
    config = b"".join(
        b'[[models]]\nname="%s"\nbackend="thinker"\nworker=false\n%s\n' % (name, line)
        for name, line in ((b"r1", b'reasoning_parser="deepseek_r1"'), (b"q3", b'reasoning_parser="qwen3"'), (b"plain", b""))
    )
    with TestClient(create_app(parse_config(config, found.backends), found), raise_server_exceptions=False) as c:
        c.get("/health")
        yield c


def ask(model, **extra):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def deltas(client, body):
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200
    return [c["delta"] for e in parse_events(r.content) for c in e["choices"]]


@pytest.mark.parametrize("model", ["r1", "q3"])
def test_the_message_carries_reasoning_apart(client, model):
    body = client.post("/v1/chat/completions", json=ask(model)).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello world", "reasoning": "ab bc"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(THINKER.script)  # the reasoning's tokens count


@pytest.mark.parametrize("model", ["r1", "q3"])
def test_stream_deltas_reassemble_the_message(client, model):
    got = deltas(client, ask(model))
    assert got[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning", "") for d in got) == "ab bc"
    assert "".join(d.get("content", "") for d in got) == "hello world"
    assert not any("think>" in d.get("reasoning", "") + d.get("content", "") for d in got)
    first_content = next(i for i, d in enumerate(got) if d.get("content"))
    assert all("reasoning" not in d for d in got[first_content:])  # reasoning first, then content
    assert all(set(d) <= {"role", "content", "reasoning"} for d in got)


def test_a_model_without_a_parser_sends_the_text_as_it_is(client):
    message = client.post("/v1/chat/completions", json=ask("plain")).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": SAID}
    assert all("reasoning" not in d for d in deltas(client, ask("plain")))


def test_include_reasoning_false_drops_it(client):
    body = ask("r1", include_reasoning=False)
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "hello world", "reasoning": None}
    assert [d for d in deltas(client, body) if "reasoning" in d] == []
    r = client.post("/v1/chat/completions", json=ask("r1", include_reasoning="no"))
    assert r.status_code == 400 and "include_reasoning" in r.text


def test_a_reply_cut_off_while_thinking_has_no_content(client):
    message = client.post("/v1/chat/completions", json=ask("r1", max_tokens=10)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning": "ab"}


def test_qwen3_output_without_a_block_is_content(client):
    THINKER.script = tok.encode("hello world", add_special_tokens=False) + [EOS]
    message = client.post("/v1/chat/completions", json=ask("q3")).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "hello world", "reasoning": None}
    message = client.post("/v1/chat/completions", json=ask("r1")).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning": "hello world"}


def test_tool_calls_are_read_from_the_content_only(client):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    THINKER.script = tok.encode(f"<think>I could {call}</think>\n{call}", add_special_tokens=False) + [EOS]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = client.post("/v1/chat/completions", json=ask("r1", tools=tools))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == f"I could {call}"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "add", "arguments": '{"a": 1}'}]


def test_an_assistant_messages_reasoning_reaches_the_template(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A", "reasoning": "R"}]
    r = client.post("/tokenize", json={"model": "r1", "messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200
    assert tok.decode(r.json()["tokens"]) == "hiAR"


def test_a_constraint_begins_after_the_reasoning(client):
    from router.constraints import TokenConstraint
    from router.thinking_gate import AfterReasoning

    body = ask("r1", structured_outputs={"choice": ["yes", "no"]})
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "hello world", "reasoning": "ab bc"}  # (a script: unmasked)
    gate = THINKER.seen[-1].constraint
    assert isinstance(gate, AfterReasoning) and gate.allowed() is None
    for t in tok.encode("no, </think>", add_special_tokens=False):
        gate.advance(t)
    assert not gate.reasoning and gate.allowed()[tok.encode("y", add_special_tokens=False)[0]]
    # qwen3 with no block in the prompt needs a one-token <think> to open one; this vocabulary
    # spells it in bytes, so the grammar governs from the first token.
    assert client.post("/v1/chat/completions", json={**body, "model": "q3"}).status_code == 200
    assert isinstance(THINKER.seen[-1].constraint, TokenConstraint)
    assert client.post("/v1/chat/completions", json={**body, "model": "plain"}).status_code == 200
    assert isinstance(THINKER.seen[-1].constraint, TokenConstraint)


def assert_reasoning_tokens(client, model, tokenizer, reasoning, marked, answer):
    """usage's reasoning_tokens counts at least the tokens of the reasoning text, at most those of
    it with its markers (``marked``), and none of the answer's; returns the usage."""
    def n(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    usage = client.post("/v1/chat/completions", json=ask(model)).json()["usage"]
    counted = usage["completion_tokens_details"]["reasoning_tokens"]
    assert n(reasoning) <= counted <= n(marked)
    assert usage["completion_tokens"] - counted >= n(answer)
    return usage


def test_usage_counts_the_reasoning_tokens(client):
    usage = assert_reasoning_tokens(client, "r1", tok, "ab bc", "<think>\nab bc\n</think>", "\n\nhello world")
    r = client.post("/v1/chat/completions", json={**ask("r1"), "stream": True, "stream_options": {"include_usage": True}})
    assert parse_events(r.content)[-1]["usage"] == usage
    # a model without a parser has no such detail; a reply without reasoning has none
    assert "completion_tokens_details" not in client.post("/v1/chat/completions", json=ask("plain")).json()["usage"]
    THINKER.script = tok.encode("hello world", add_special_tokens=False) + [EOS]
    usage = client.post("/v1/chat/completions", json=ask("q3")).json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0


# --- Mistral's [THINK] blocks: control tokens, spelled out for the parser ---

from fakes import ByteTokenizer  # noqa: E402

MISTRAL_TOK = ByteTokenizer(["[THINK]", "[/THINK]"])


class MistralThinker(ThinkingEngine):
    def __init__(self):
        super().__init__()
        self.tokenizer = MISTRAL_TOK
        self.script = MISTRAL_TOK.encode("[THINK]ab bc[/THINK]\n\nhello world", add_special_tokens=False) + [EOS]


MAGISTRAL = MistralThinker()


@pytest.fixture
def mistral_client():
    found = load_plugins(entrypoints=False, extra=[MagistralPlugin(), plugins.sampling, plugins.templating,
                                                   plugins.reasoning, plugins.structured_outputs])
    config = b'[[models]]\nname="magistral"\nbackend="magistral"\nreasoning_parser="mistral"\nworker=false\n'
    with TestClient(create_app(parse_config(config, found.backends), found), raise_server_exceptions=False) as c:
        c.get("/health")
        yield c


class MagistralPlugin:
    __name__ = "magistral"

    @hookimpl
    def register_backends(self, register):
        register("magistral", type("Magistral", (LocalBackend,), {"create_engine": lambda self: MAGISTRAL}))


def test_mistrals_think_blocks_are_read_though_their_markers_are_control_tokens(mistral_client):
    # Were control tokens left out of the text the parser reads, all of it would be content.
    body = mistral_client.post("/v1/chat/completions", json=ask("magistral")).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello world", "reasoning": "ab bc"}
    got = deltas(mistral_client, ask("magistral"))
    assert "".join(d.get("reasoning", "") for d in got) == "ab bc"
    assert "".join(d.get("content", "") for d in got) == "hello world"
    # A constraint begins after [/THINK]; with no block in the prompt the one-token [THINK] opens it.
    from router.thinking_gate import AfterReasoning

    r = mistral_client.post("/v1/chat/completions", json=ask("magistral", structured_outputs={"choice": ["yes", "no"]}))
    assert r.status_code == 200, r.text
    gate = MAGISTRAL.seen[-1].constraint
    assert isinstance(gate, AfterReasoning)
    think, end = (MISTRAL_TOK.encode(m, add_special_tokens=False) for m in ("[THINK]", "[/THINK]"))
    assert len(think) == len(end) == 1
    gate.advance(think[0])
    assert gate.reasoning and gate.allowed() is None
    gate.advance(end[0])
    assert not gate.reasoning and gate.allowed()[MISTRAL_TOK.encode("y", add_special_tokens=False)[0]]
