"""End to end: vLLM's ``use_beam_search`` on both local engines, over HTTP with raw requests and
the openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

PROMPT = "The three primary colours are"


def post(base_url, path, body):
    return httpx.post(f"{base_url}{path}", json=body, timeout=300)


def complete(base_url, model, **body):
    r = post(base_url, "/v1/completions", {"model": model, "prompt": PROMPT, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_width_one_without_eos_is_the_greedy_answer(base_url, model):
    beam = complete(base_url, model, use_beam_search=True, max_tokens=10, ignore_eos=True)
    greedy = complete(base_url, model, temperature=0, max_tokens=10, ignore_eos=True)
    assert beam["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    assert beam["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert beam["choices"][0]["finish_reason"] == "length"
    assert beam["usage"] == greedy["usage"] | {"prompt_tokens_details": beam["usage"]["prompt_tokens_details"]}


def test_beams_come_best_first_with_the_model_s_own_logprobs(base_url, model):
    """Three beams of eight tokens: different, ranked by summed logprob (one length, so the
    length penalty divides all alike), each token's logprob what the model gives that token
    after the prompt and the beam's tokens before it (scored afresh with echo)."""
    body = complete(base_url, model, use_beam_search=True, n=3, max_tokens=8, ignore_eos=True, logprobs=2,
                    length_penalty=1.0)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    beams = [c["token_ids"] for c in choices]
    assert len({tuple(b) for b in beams}) == 3 and all(len(b) == 8 for b in beams)
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == sorted(sums, reverse=True)
    assert body["usage"]["completion_tokens"] == 24
    prompt_ids = post(base_url, "/tokenize", {"model": model, "prompt": PROMPT}).json()["tokens"]
    for choice, tokens in zip(choices, beams):
        lp = choice["logprobs"]
        # The two most likely alternatives, and the beam's own token (OpenAI's "up to logprobs + 1").
        assert all(top[t] == v and 2 <= len(top) <= 3
                   for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
        scored = complete(base_url, model, prompt=prompt_ids + tokens, echo=True, logprobs=0, max_tokens=1)
        again = scored["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids) : len(prompt_ids) + 8]
        assert again == pytest.approx(choice["logprobs"]["token_logprobs"], abs=0.05)


def test_chat_stream_with_the_openai_sdk_equals_the_reply(base_url, model):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name a colour."}]
    extra = {"use_beam_search": True}
    reply = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=16, extra_body=extra)
    chunks = list(client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra))
    texts, finish = {0: "", 1: ""}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in reply.choices}
    assert finish == {c.index: c.finish_reason for c in reply.choices}
    assert texts[0] != texts[1] and all(texts.values())
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"allowed_token_ids": [5, 6, 7]}, "allowed_token_ids"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_the_field(base_url, model, extra, param):
    r = post(base_url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                "use_beam_search": True, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_length_penalty_without_beam_search_changes_nothing_as_in_vllm(base_url, model):
    plain = complete(base_url, model, temperature=0, max_tokens=6)
    assert complete(base_url, model, temperature=0, max_tokens=6, length_penalty=0.5)["choices"] == plain["choices"]
