"""End to end: the legacy completions endpoint."""

from __future__ import annotations

import httpx
import pytest

from sse_util import parse_events



def post(base_url, body):
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)


def stream_events(base_url, body):
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return parse_events(r.read())


def test_shape_and_default_max_tokens(base_url, model):
    body = post(base_url, {"model": model, "prompt": "The sky is", "ignore_eos": True}).json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    (c,) = body["choices"]
    assert set(c) >= {"index", "text", "logprobs", "finish_reason"}
    assert body["usage"]["completion_tokens"] == 16 and c["finish_reason"] == "length"


def test_stream_equals_non_stream(base_url, model):
    req = {"model": model, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    full = post(base_url, req).json()["choices"][0]["text"]
    events = stream_events(base_url, req)
    assert "".join(c["text"] for e in events for c in e["choices"]) == full
    assert all(e["object"] == "text_completion" for e in events)


def test_prompt_shapes_and_indices(base_url, model):
    base = {"model": model, "max_tokens": 3, "temperature": 0}
    a = post(base_url, {**base, "prompt": "Hello"}).json()
    ids = httpx.post(f"{base_url}/tokenize", json={"model": model, "prompt": "Hello"}).json()["tokens"]
    b = post(base_url, {**base, "prompt": ids}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    many = post(base_url, {**base, "prompt": ["Hello", "Goodbye"], "n": 2}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == a["choices"][0]["text"]
    assert many["usage"]["prompt_tokens"] == len(ids) + len(
        httpx.post(f"{base_url}/tokenize", json={"model": model, "prompt": "Goodbye"}).json()["tokens"])
    lists = post(base_url, {**base, "prompt": [ids, ids]}).json()
    assert len(lists["choices"]) == 2


@pytest.mark.parametrize("prompt", [[], [[]], ["a", 1], [10**9]])
def test_bad_prompts_are_400(base_url, prompt, model):
    r = post(base_url, {"model": model, "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")


def test_echo_and_logprobs(base_url, model):
    r = post(base_url, {"model": model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0,
                        "echo": True, "logprobs": 2}).json()
    c = r["choices"][0]
    assert c["text"].startswith("One, two,")
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert lp["text_offset"][0] == len("One, two,")
    assert "".join(lp["tokens"]) == c["text"][len("One, two,"):]
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    events = stream_events(base_url, {"model": model, "prompt": "One, two,", "max_tokens": 4,
                                      "temperature": 0, "echo": True})
    assert "".join(ch["text"] for e in events for ch in e["choices"]) == c["text"]


def test_usage_in_stream_and_stop(base_url, model):
    events = stream_events(base_url, {"model": model, "prompt": "1, 2, 3,", "max_tokens": 30, "temperature": 0,
                                      "stop": [" 6"], "stream_options": {"include_usage": True}})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert " 6" not in text and text.endswith("5,")
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    finish = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert len(finish) == 1 and finish[0]["finish_reason"] == "stop" and finish[0]["stop_reason"] == " 6"


def test_suffix_and_best_of(base_url, model):
    assert post(base_url, {"model": model, "prompt": "x", "suffix": "y"}).status_code == 400
    assert post(base_url, {"model": model, "prompt": "x", "best_of": 3}).status_code == 400


def test_openai_sdk_completions(base_url, model):
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=model, prompt="Paris is", max_tokens=5, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Paris is", max_tokens=5, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_empty_prompt_is_a_400_not_a_stuck_engine(base_url, model):
    for prompt in ("", ["ok", ""]):
        r = post(base_url, {"model": model, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")
    # and the engine still serves
    assert post(base_url, {"model": model, "prompt": "Hello", "max_tokens": 2}).status_code == 200
