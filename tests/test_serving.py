"""The shared serving pipeline against a scripted engine: chunk order, n > 1, errors mid-stream."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import pytest
from litestar.testing import TestClient

import plugins.sampling
import plugins.templating
from fakes import ByteTokenizer
from router.app import create_app
from router.backend import LocalBackend
from router.config import parse_config
from router.engine import EngineError, EngineRequest, EngineStep, TokenLogprobs, UnknownAdapter
from router.hookspecs import hookimpl
from router.plugins import load_plugins
from sse_util import chat_text, parse_events

tok = ByteTokenizer()
EOS = tok.special_ids["<|im_end|>"]


class ScriptedEngine:
    """Answers every prompt with a fixed script of token ids; fails where told to."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    capabilities = frozenset({"logprobs", "stop_token_ids", "min_tokens", "ignore_eos", "top_k"})
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = tok
        self.script = tok.encode("hello world", add_special_tokens=False) + [EOS]
        self.fail_after: int | None = None
        self.failure: EngineError | None = None  # what it raises there (default: "device on fire")
        self.seen: list[EngineRequest] = []
        self.active = 0

    async def start(self): ...
    async def stop(self): ...

    def stats(self):
        return {"running": self.active, "waiting": 0}

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        self.seen.append(request)
        self.active += 1
        try:
            for n, token in enumerate(self.script[: request.max_tokens], start=1):
                await asyncio.sleep(0)
                if self.fail_after is not None and n > self.fail_after:
                    raise self.failure or EngineError("device on fire")
                finish = stop_token = None
                if token in request.stop_token_ids:
                    finish, stop_token = "stop", token
                elif token == EOS:
                    finish = "stop"
                elif n == request.max_tokens:
                    finish = "length"
                lp = [TokenLogprobs(-0.5, [(token, -0.5)])] if request.sampling.logprobs is not None else None
                yield EngineStep([token], lp, finish, stop_token, 3 if n == 1 else None)
                if finish:
                    return
        finally:
            self.active -= 1


ENGINE = ScriptedEngine()


class Scripted(LocalBackend):
    def create_engine(self):
        return ENGINE


class P:
    __name__ = "scripted"

    @hookimpl
    def register_backends(self, register):
        register("scripted", Scripted)


@pytest.fixture
def client():
    ENGINE.fail_after = None
    ENGINE.failure = None
    ENGINE.script = tok.encode("hello world", add_special_tokens=False) + [EOS]
    ENGINE.seen.clear()
    plugins_ = load_plugins(entrypoints=False, extra=[P(), plugins.sampling, plugins.templating])
    cfg = parse_config(b'[[models]]\nname="s"\nbackend="scripted"\nworker=false\n', plugins_.backends)
    with TestClient(create_app(cfg, plugins_), raise_server_exceptions=False) as c:
        c.get("/health")
        yield c


MSG = {"model": "s", "messages": [{"role": "user", "content": "hi"}]}


def events(client, body):
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200
    return parse_events(r.content)


def test_reply_and_usage(client):
    body = client.post("/v1/chat/completions", json=MSG).json()
    assert body["choices"][0]["message"]["content"] == "hello world"
    assert body["choices"][0]["finish_reason"] == "stop"
    # "hello", " world", EOS: the end token is counted, not shown
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 3}}


def test_finish_rides_on_the_last_content_chunk_or_an_empty_one(client):
    evs = events(client, {**MSG, "max_tokens": 2})
    assert [e["choices"][0]["delta"] for e in evs] == [{"role": "assistant", "content": ""}, {"content": "hello"}, {"content": " world"}]
    assert evs[-1]["choices"][0]["finish_reason"] == "length"
    evs = events(client, MSG)
    assert evs[-1]["choices"][0]["delta"] == {} and evs[-1]["choices"][0]["finish_reason"] == "stop"


def test_error_after_the_first_byte_is_an_error_event_then_done(client):
    ENGINE.fail_after = 1
    r = client.post("/v1/chat/completions", json={**MSG, "stream": True})
    assert r.status_code == 200
    evs = parse_events(r.content)
    assert evs[1]["choices"][0]["delta"] == {"content": "hello"}
    assert evs[-1] == {"error": {"message": "The engine failed: device on fire", "type": "server_error", "param": None, "code": None}}
    r = client.post("/v1/chat/completions", json=MSG)
    assert r.status_code == 500 and "device on fire" in r.json()["error"]["message"]


def test_an_adapter_unloaded_after_the_request_found_it_is_a_404(client):
    """The engine's UnknownAdapter (a LoRA adapter unloaded between the request's lookup and its
    generation) is the 404 of a model that does not exist, not an engine failure."""
    ENGINE.fail_after, ENGINE.failure = 0, UnknownAdapter("s-pirate")
    gone = {"error": {"message": "The model `s-pirate` does not exist.", "type": "invalid_request_error",
                      "param": "model", "code": "model_not_found"}}
    r = client.post("/v1/chat/completions", json=MSG)
    assert r.status_code == 404 and r.json() == gone
    r = client.post("/v1/chat/completions", json={**MSG, "stream": True})
    assert parse_events(r.content)[-1] == gone


def test_n_choices_interleave_one_choice_per_chunk(client):
    evs = events(client, {**MSG, "n": 3, "stream_options": {"include_usage": True}})
    assert all(len(e["choices"]) == 1 for e in evs[:-1])
    for i in range(3):
        assert chat_text(evs, i) == "hello world"
        assert sum(1 for e in evs for c in e["choices"] if c["index"] == i and c["finish_reason"]) == 1
    assert evs[-1]["usage"]["completion_tokens"] == 9 and evs[-1]["usage"]["prompt_tokens"] == 2


def test_stop_token_ids_and_min_tokens_reach_the_engine(client):
    world = tok.word_ids[" world"]
    body = client.post("/v1/chat/completions", json={**MSG, "stop_token_ids": [world], "min_tokens": 1}).json()
    c = body["choices"][0]
    assert c["message"]["content"] == "hello" and c["stop_reason"] == world
    req = ENGINE.seen[-1]
    assert req.stop_token_ids == {world} and req.min_tokens == 1


def test_stop_string_across_tokens_cancels_generation(client):
    body = client.post("/v1/chat/completions", json={**MSG, "stop": ["lo wo"]}).json()
    assert body["choices"][0]["message"]["content"] == "hel"
    assert body["usage"]["completion_tokens"] == 2  # the token that completed the stop is counted
    assert ENGINE.active == 0


def test_logprobs_of_held_back_tokens_are_sent_with_later_text(client):
    ENGINE.script = list("é".encode()) + [EOS]  # two tokens, one character
    evs = events(client, {**MSG, "logprobs": True, "top_logprobs": 1})
    content = [c for e in evs[1:] for c in e["choices"]]
    assert content[0]["delta"] == {"content": "é"}
    assert len(content[0]["logprobs"]["content"]) == 2
    total = sum(len(c["logprobs"]["content"]) for c in content)
    assert total == 3


def test_continuous_usage_and_return_token_ids(client):
    evs = events(client, {**MSG, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                          "return_token_ids": True})
    assert evs[0]["prompt_token_ids"] == list(b"hi")
    assert all("usage" in e for e in evs)
    ids = [t for e in evs for c in e["choices"] for t in c.get("token_ids", [])]
    assert ids == ENGINE.script


def test_capability_missing_is_400_naming_field_and_model(client):
    r = client.post("/v1/chat/completions", json={**MSG, "min_p": 0.2})
    assert r.status_code == 400
    e = r.json()["error"]
    assert e["param"] == "min_p" and "`s`" in e["message"] and "scripted" in e["message"]


def test_logit_bias_outside_vocab_is_400(client):
    r = client.post("/v1/chat/completions", json={**MSG, "logit_bias": {"999999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_response_format_needs_structured_outputs(client):
    r = client.post("/v1/chat/completions", json={**MSG, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert client.post("/v1/chat/completions", json={**MSG, "response_format": {"type": "text"}}).status_code == 200


def test_chat_echo_prepends_last_assistant_message(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    body = {"model": "s", "messages": msgs, "echo": True, "add_generation_prompt": False}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert full == "Sure: hello world"
    assert chat_text(events(client, body)) == full


def test_echo_with_logprobs_needs_an_engine_that_scores_prompts(client):
    body = {"model": "s", "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    e = r.json()["error"]
    assert e["param"] == "echo" and e["code"] == "unsupported_parameter" and "`s`" in e["message"]
    assert ENGINE.seen == []  # refused before the engine saw it
    # echo alone, or logprobs alone, need no prompt scores
    assert client.post("/v1/completions", json={**body, "logprobs": None}).status_code == 200
    assert client.post("/v1/completions", json={**body, "echo": False}).status_code == 200
    assert [r.prompt_logprobs for r in ENGINE.seen] == [None, None]


@pytest.fixture
def scoring_engine(monkeypatch):
    """The scripted engine, able to score prompts (before the client loads it)."""
    monkeypatch.setattr(ScriptedEngine, "capabilities", ScriptedEngine.capabilities | {"prompt_logprobs"})
    real = ScriptedEngine.generate

    async def scoring(self, request):
        async for step in real(self, request):
            if step.cached_tokens is not None:  # the first step carries the prompt's scores
                entry = TokenLogprobs(-1.25, [(tok.word_ids["hello"], -0.25)], 2)
                step.prompt_logprobs = [entry] * (len(request.prompt_ids) - 1)
            yield step

    monkeypatch.setattr(ScriptedEngine, "generate", scoring)


def test_echo_with_logprobs_lists_the_prompt_then_the_completion(scoring_engine, client):
    body = {"model": "s", "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert ENGINE.seen[-1].prompt_logprobs == 1
    assert lp == {
        "text_offset": [0, 1, 2, 7],
        "token_logprobs": [None, -1.25, -0.5, -0.5],
        "tokens": ["h", "i", "hello", " world"],
        "top_logprobs": [None, {"i": -1.25, "hello": -0.25}, {"hello": -0.5}, {" world": -0.5}],
    }
    evs = parse_events(client.post("/v1/completions", json={**body, "stream": True}).content)
    chunks = [c for e in evs for c in e["choices"]]
    assert chunks[0]["text"] == "hihello" and chunks[0]["logprobs"]["tokens"] == ["h", "i", "hello"]
    assert [x for c in chunks for x in c["logprobs"]["text_offset"]] == lp["text_offset"]


def test_prompt_logprobs_as_vllm_returns_them(scoring_engine, client):
    entry = [None, {str(ord("i")): {"logprob": -1.25, "rank": 2, "decoded_token": "i"},
                    str(tok.word_ids["hello"]): {"logprob": -0.25, "rank": 1, "decoded_token": "hello"}}]
    body = {"model": "s", "prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    assert c["prompt_logprobs"] == entry and c["logprobs"] is None
    assert ENGINE.seen[-1].prompt_logprobs == 1
    chat = client.post("/v1/chat/completions", json={**MSG, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"] == [None, {str(ord("i")): entry[1][str(ord("i"))]}]  # k = 0: the token alone
    assert "prompt_logprobs" not in chat["choices"][0]
    # echo with logprobs 0 and prompt_logprobs 1: one scoring pass, each field its own k
    both = client.post("/v1/completions", json={**body, "echo": True, "logprobs": 0}).json()["choices"][0]
    assert ENGINE.seen[-1].prompt_logprobs == 1
    assert both["prompt_logprobs"] == entry and both["logprobs"]["top_logprobs"][1] == {"i": -1.25}
    plain = client.post("/v1/completions", json={"model": "s", "prompt": "hi", "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_prompt_logprobs_is_refused_when_streaming_or_not_scored(client):
    r = client.post("/v1/completions", json={"model": "s", "prompt": "hi", "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = client.post("/v1/chat/completions", json={**MSG, "prompt_logprobs": 1})  # this engine cannot
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = client.post("/v1/chat/completions", json={**MSG, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert ENGINE.seen == []


def test_echoed_offsets_count_token_texts_throughout(scoring_engine, client):
    # "é" is two byte tokens, each shown as U+FFFD: the tokens' texts are longer than the echo.
    body = {"model": "s", "prompt": "é!", "max_tokens": 2, "echo": True, "logprobs": 0}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["\ufffd", "\ufffd", "!", "hello", " world"]
    assert lp["text_offset"] == [0, 1, 2, 3, 8]
    evs = parse_events(client.post("/v1/completions", json={**body, "stream": True}).content)
    assert [x for e in evs for c in e["choices"] for x in c["logprobs"]["text_offset"]] == lp["text_offset"]


def test_each_field_gets_the_alternatives_it_asked_for(scoring_engine, client):
    body = {"model": "s", "prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 0}
    c = client.post("/v1/completions", json=body).json()["choices"][0]
    assert ENGINE.seen[-1].prompt_logprobs == 1
    assert c["logprobs"]["top_logprobs"][1] == {"i": -1.25, "hello": -0.25}
    assert list(c["prompt_logprobs"][1]) == [str(ord("i"))]
    # prompt_logprobs 0 with stream is let through and ignored (vLLM)
    r = client.post("/v1/completions", json={"model": "s", "prompt": "hi", "max_tokens": 1, "stream": True,
                                             "prompt_logprobs": 0})
    assert r.status_code == 200 and ENGINE.seen[-1].prompt_logprobs is None


def test_a_prompts_other_choices_start_after_its_first_has_a_token(client, monkeypatch):
    events = []
    real = ScriptedEngine.generate

    async def logged(self, request):
        events.append(("start", request.request_id[-1]))
        async for step in real(self, request):
            events.append(("step", request.request_id[-1]))
            yield step

    monkeypatch.setattr(ScriptedEngine, "generate", logged)
    body = {"model": "s", "prompt": ["hi", "yo"], "max_tokens": 3, "n": 2}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in choices] == ["hello world"] * 4
    # Choices 0 and 2 lead prompts 0 and 1; 1 and 3 wait for their lead's first step.
    assert events.index(("start", "1")) > events.index(("step", "0"))
    assert events.index(("start", "3")) > events.index(("step", "2"))
    # and the two leads do not wait for each other
    assert max(events.index(("start", "0")), events.index(("start", "2"))) < events.index(("start", "1"))


def test_with_n_the_prompt_is_scored_once(scoring_engine, client):
    body = {"model": "s", "prompt": "hi", "max_tokens": 2, "n": 3, "echo": True, "logprobs": 0}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [r.prompt_logprobs for r in ENGINE.seen] == [0, None, None]
    assert all(c["logprobs"]["token_logprobs"][:2] == [None, -1.25] for c in choices)
    evs = parse_events(client.post("/v1/completions", json={**body, "stream": True}).content)
    firsts = {}
    for e in evs:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c)
    assert [firsts[i]["logprobs"]["token_logprobs"][:2] for i in range(3)] == [[None, -1.25]] * 3


# --- several tokens in one engine step (speculative decoding) -----------------------------------


def choice(stops, include=False):
    from router.detokenizer import IncrementalDetokenizer
    from router.serving import Choice
    from router.stops import StopChecker

    return Choice(0, 0, IncrementalDetokenizer(tok, []), StopChecker(stops, include))


@pytest.mark.parametrize(
    "stops, include, text, kept",
    [
        # tokens: "ab" "c" "X" "Y" "d" "e" "f"
        (["XY"], False, "abc", 4),  # "Y" completes the stop string: "def" is not part of the answer
        (["XY"], True, "abcXY", 4),
        (["QQ"], False, "abcXYdef", 7),  # no stop string inside: every token
        ([], False, "abcXYdef", 7),
    ],
)
def test_a_multi_token_step_ends_at_the_token_completing_a_stop_string(stops, include, text, kept):
    ids = tok.encode("abcXYdef", add_special_tokens=False)
    logprobs = [TokenLogprobs(-0.1 * i, []) for i in range(len(ids))]
    whole = choice(stops, include)
    whole.absorb(EngineStep(ids, logprobs, None, None))
    one_by_one = choice(stops, include)
    for token, lp in zip(ids, logprobs):
        one_by_one.absorb(EngineStep([token], [lp], None, None))
        if one_by_one.finished:
            break
    assert whole.token_ids == one_by_one.token_ids == ids[:kept]
    assert [t for t, _ in whole.logprobs] == ids[:kept] and whole.logprobs == one_by_one.logprobs
    assert whole.text == one_by_one.text == text
    assert whole.finish_reason == ("stop" if kept < len(ids) else None)


def test_a_multi_token_step_with_a_stop_token_and_a_stop_string():
    ids = tok.encode("abcXYd", add_special_tokens=False) + [EOS]
    c = choice(["XY"])
    assert c.absorb(EngineStep(ids, None, "stop", EOS))[0] == "abc"
    assert c.token_ids == ids[:4] and (c.finish_reason, c.stop_reason) == ("stop", "XY")


def test_prediction_tokens_kept_after_a_stop_string_do_not_count():
    """Ten single-token steps, then one whose four drafted prediction tokens were all kept (plus
    the token after them); the stop string completes at the step's first token."""
    ids = tok.encode("abcdefghijXYZWV", add_special_tokens=False)
    c = choice(["jX"])
    for n, token in enumerate(ids[:10]):
        c.absorb(EngineStep([token], None, None, None, prediction_tokens=(0, n % 2)))
    c.absorb(EngineStep(ids[10:15], None, None, None, prediction_tokens=(4, 1)))
    assert c.text == "abcdefghi" and len(c.token_ids) == 11
    assert c.prediction_tokens == (1, 1)  # "X" only: the drafted "YZW" lie past the stop string
    c = choice(["ZW"])
    c.absorb(EngineStep(ids[:2], None, None, None, prediction_tokens=(1, 0)))
    c.absorb(EngineStep(ids[2:7], None, None, None, prediction_tokens=(5, 2)))
    assert c.prediction_tokens == (5, 2)  # no stop string inside: every kept token counts
