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


def tokenize(base_url, model, prompt):
    return httpx.post(f"{base_url}/tokenize", json={"model": model, "prompt": prompt}).json()["tokens"]


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
    ids = tokenize(base_url, model, "Hello")
    b = post(base_url, {**base, "prompt": ids}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    many = post(base_url, {**base, "prompt": ["Hello", "Goodbye"], "n": 2}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert many["choices"][0]["text"] == a["choices"][0]["text"]
    assert many["usage"]["prompt_tokens"] == len(ids) + len(tokenize(base_url, model, "Goodbye"))
    lists = post(base_url, {**base, "prompt": [ids, ids]}).json()
    assert len(lists["choices"]) == 2


@pytest.mark.parametrize("prompt", [[], [[]], ["a", 1], [10**9]])
def test_bad_prompts_are_400(base_url, prompt, model):
    r = post(base_url, {"model": model, "prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")


def test_logprobs_top_holds_the_token_itself(base_url, model):
    # OpenAI: "the API will always return the logprob of the sampled token, so there may be up
    # to logprobs+1 elements"; vLLM does the same.
    r = post(base_url, {"model": model, "prompt": "One, two,", "max_tokens": 6, "temperature": 1.5, "seed": 3,
                        "logprobs": 1}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == val and 1 <= len(top) <= 2
    zero = post(base_url, {"model": model, "prompt": "One, two,", "max_tokens": 2, "temperature": 0,
                           "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[t] for t in zero["tokens"]]


def test_echo_with_logprobs_scores_the_prompt(base_url, model):
    # What lm-evaluation-harness's loglikelihood asks of vLLM: echo, logprobs, max_tokens 1.
    prompt = "One, two, three, four,"
    ids = tokenize(base_url, model, prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    c = post(base_url, body).json()["choices"][0]
    assert c["text"].startswith(prompt)
    lp = c["logprobs"]
    n = len(ids) + 4
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes it
    for i, (tok, val, top) in enumerate(zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:])):
        assert val <= 0 and top[tok] == val and len(top) in (2, 3)
        if i + 1 >= len(ids):  # generated greedily: the most likely token
            assert val == max(top.values())
    # Counting to four is easy: the prompt's " four" is likely, the words before it less so.
    assert lp["token_logprobs"][len(ids) - 2] > -2.0
    one = post(base_url, {**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
    assert one["token_logprobs"][: len(ids)] == lp["token_logprobs"][: len(ids)]
    assert one["tokens"] == lp["tokens"][: len(ids) + 1]

    events = stream_events(base_url, body)
    chunks = [ch for e in events for ch in e["choices"]]
    assert chunks[0]["text"].startswith(prompt)  # the echo comes with its logprobs, in the first chunk
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [x for ch in chunks for x in ch["logprobs"][key]] == lp[key]


def test_return_tokens_as_token_ids_names_tokens_by_id(base_url, model):
    prompt = "One, two, three, four,"
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
            "return_token_ids": True}
    plain = post(base_url, body).json()["choices"][0]
    r = post(base_url, {**body, "return_tokens_as_token_ids": True}).json()
    named = r["choices"][0]
    ids = named["prompt_token_ids"] + named["token_ids"]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert named["text"] == plain["text"]
    # offsets still count the tokens' texts; the same logprobs, keyed by id
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top in named["logprobs"]["top_logprobs"][1:]:
        assert all(k.startswith("token_id:") and k.removeprefix("token_id:").isdigit() for k in top)
    chunks = [ch for e in stream_events(base_url, {**body, "return_tokens_as_token_ids": True}) for ch in e["choices"]]
    for key in ("tokens", "text_offset", "top_logprobs"):
        assert [x for ch in chunks for x in ch["logprobs"][key]] == named["logprobs"][key]


def contains(ids, seq):
    return any(tuple(ids[i : i + len(seq)]) == tuple(seq) for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_never_completed(base_url, model):
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}
    plain = post(base_url, body).json()["choices"][0]
    assert "Paris" in plain["text"]
    forbidden = [tokenize(base_url, model, w) for w in ("Paris", " Paris")]
    assert any(contains(plain["token_ids"], seq) for seq in forbidden)
    got = post(base_url, {**body, "bad_words": ["Paris"]})
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert not any(contains(choice["token_ids"], seq) for seq in forbidden)
    assert choice["text"] != plain["text"]
    # up to the first token the ban changed, the reply is the same
    first = next(i for i, (a, b) in enumerate(zip(plain["token_ids"], choice["token_ids"])) if a != b)
    assert any(contains(plain["token_ids"][: first + 1], seq) for seq in forbidden)
    r = post(base_url, {**body, "bad_words": "Paris"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_echo_without_logprobs_and_token_prompts(base_url, model):
    c = post(base_url, {"model": model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0,
                        "echo": True}).json()["choices"][0]
    assert c["text"].startswith("One, two,") and c["logprobs"] is None
    events = stream_events(base_url, {"model": model, "prompt": "One, two,", "max_tokens": 4,
                                      "temperature": 0, "echo": True})
    assert "".join(ch["text"] for e in events for ch in e["choices"]) == c["text"]
    ids = tokenize(base_url, model, "One, two,")
    both = post(base_url, {"model": model, "prompt": [ids, ids[:2]], "max_tokens": 1, "temperature": 0,
                           "echo": True, "logprobs": 0}).json()["choices"]
    assert [len(ch["logprobs"]["tokens"]) for ch in both] == [len(ids) + 1, 3]
    assert [ch["logprobs"]["token_logprobs"][0] for ch in both] == [None, None]


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


def test_prompt_logprobs_field_as_vllm(base_url, model):
    prompt = "One, two, three, four,"
    ids = tokenize(base_url, model, prompt)
    base = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    c = post(base_url, {**base, "prompt_logprobs": 3}).json()["choices"][0]
    echoed = post(base_url, {**base, "echo": True, "logprobs": 3}).json()["choices"][0]
    pl = c["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None and echoed["prompt_logprobs"] == pl
    for i, entry in enumerate(pl[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == echoed["logprobs"]["token_logprobs"][i]
        assert own["decoded_token"] == echoed["logprobs"]["tokens"][i]
        alts = sorted((v for k, v in entry.items() if k != str(ids[i])), key=lambda v: v["rank"])
        if own["rank"] <= 3:  # among the top 3: they are the other two, around it
            assert len(alts) == 2 and sorted([own["rank"]] + [a["rank"] for a in alts]) == [1, 2, 3]
        else:
            assert [a["rank"] for a in alts] == [1, 2, 3] and own["logprob"] <= alts[-1]["logprob"]
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["logprob"] for v in ranked] == sorted((v["logprob"] for v in ranked), reverse=True)
    chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat["prompt_logprobs"][1:])


def test_allowed_token_ids_restrict_what_is_sampled(base_url, model):
    allowed = tokenize(base_url, model, " yes no maybe")
    body = {"model": model, "prompt": "Is the sky green? Answer:", "max_tokens": 8, "temperature": 1.0,
            "seed": 7, "allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True}
    c = post(base_url, body).json()["choices"][0]
    assert len(c["token_ids"]) == 8 and set(c["token_ids"]) <= set(allowed)
    chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
        "allowed_token_ids": allowed[:1], "ignore_eos": True}).json()
    assert chat["choices"][0]["message"]["content"] == " yes" * 4
    for bad, words in [([], "at least one"), ([10**6], "outside the vocabulary")]:
        r = post(base_url, {**body, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids" and words in r.text
    eos = tokenize(base_url, model, "<|im_end|>")
    r = post(base_url, {"model": model, "prompt": "x", "allowed_token_ids": eos, "min_tokens": 2})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"]
    r = post(base_url, {"model": model, "prompt": "x", "allowed_token_ids": allowed,
                        "structured_outputs": {"regex": "[0-9]+"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_prompts_tail(base_url, model):
    text = "One, two, three, four, five, six, seven, eight, nine, ten,"
    ids = tokenize(base_url, model, text)
    base = {"model": model, "max_tokens": 4, "temperature": 0}
    cut = post(base_url, {**base, "prompt": text, "truncate_prompt_tokens": 5, "echo": True}).json()
    tail = post(base_url, {**base, "prompt": ids[-5:]}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    echo = httpx.post(f"{base_url}/detokenize", json={"model": model, "tokens": ids[-5:]}).json()["prompt"]
    assert cut["choices"][0]["text"] == echo + tail["choices"][0]["text"]
    short = post(base_url, {**base, "prompt": ids[:3], "truncate_prompt_tokens": 5}).json()
    assert short["usage"]["prompt_tokens"] == 3  # shorter prompts stay whole
    # -1: whatever fits beside max_tokens, where the whole prompt would be a 400
    long = " word" * 1100
    assert post(base_url, {**base, "prompt": long}).status_code == 400
    fit = post(base_url, {**base, "prompt": long, "truncate_prompt_tokens": -1}).json()
    assert fit["usage"]["prompt_tokens"] == 1024 - 4
    for bad in (0, 1025, -2):
        r = post(base_url, {**base, "prompt": text, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
        "truncate_prompt_tokens": 7}).json()
    assert chat["usage"]["prompt_tokens"] == 7
