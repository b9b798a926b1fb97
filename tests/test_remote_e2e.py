"""The remote backend against real upstreams on loopback, driven with the openai SDK and raw httpx:
(1) a second router serving the bundled GGUF with llama.cpp, (2) llama-cpp-python's own OpenAI
server (``python -m llama_cpp.server``) on the same file."""

from __future__ import annotations

import httpx
import openai
import pytest

from server import GGUF, RouterProcess
from sse_util import chat_text, parse_events
from upstreams import LlamaCppServer

MESSAGES = [{"role": "user", "content": "Name three colours."}]
MODELS = ["via-router", "via-llama-cpp"]


@pytest.fixture(scope="module")
def upstream_router(tmp_path_factory):
    # One llama.cpp thread per upstream (see LlamaCppServer): two upstreams and the test share 2 cores.
    config = f'[[models]]\nname = "smollm2"\nbackend = "llamacpp"\npath = "{GGUF}"\nn_ctx = 1024\nn_threads = 1\nn_threads_batch = 1\n'
    r = RouterProcess(config, tmp_path_factory.mktemp("upstream"), name="upstream")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def llama_cpp_server(tmp_path_factory):
    s = LlamaCppServer(tmp_path_factory.mktemp("llama_cpp_server"), n_ctx=1024)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def front(upstream_router, llama_cpp_server, tmp_path_factory):
    config = f"""
[[models]]
name = "via-router"
backend = "remote"
upstream_model = "smollm2"
forward_extras = ["top_k", "return_token_ids", "ignore_eos"]
health_check_interval = 2
[[models.deployments]]
url = "{upstream_router.url}/v1"

[[models]]
name = "via-llama-cpp"
backend = "remote"
forward_extras = ["top_k"]
health_check_interval = 2
[[models.deployments]]
url = "{llama_cpp_server.url}"

[[models]]
name = "both"
backend = "remote"
upstream_model = "smollm2"
health_check_interval = 2
[[models.deployments]]
url = "{upstream_router.url}/v1"
[[models.deployments]]
url = "{llama_cpp_server.url}"
"""
    r = RouterProcess(config, tmp_path_factory.mktemp("front"), name="front")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)


def post(front, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{front.url}{path}", json=body, timeout=120)


def stream_raw(front, path: str, body: dict) -> bytes:
    with httpx.stream("POST", f"{front.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.read()


@pytest.mark.parametrize("model", MODELS)
def test_sdk_non_streaming(client, model):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.model == model and reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.parametrize("model", MODELS)
def test_sdk_streaming_model_name_rewritten(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True))
    assert chunks and all(c.model == model for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)  # not asked for: none, though the router asked upstream


@pytest.mark.parametrize("model", MODELS)
def test_stream_equals_non_stream_at_temperature_zero(front, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    # llama-cpp-python's server evaluates a prompt it has not seen from scratch and a repeated one
    # partly from its cache, and the two can pick different tokens at temperature 0 (seen: the
    # first answer after start differed from every later one). Compare two cached evaluations.
    post(front, "/v1/chat/completions", body)
    full = post(front, "/v1/chat/completions", body).json()
    events = parse_events(stream_raw(front, "/v1/chat/completions", {**body, "stream": True}))
    assert chat_text(events) == full["choices"][0]["message"]["content"]
    assert all(e["model"] == model for e in events)
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == [full["choices"][0]["finish_reason"]]


def test_usage_chunk_only_when_asked(front):
    body = {"model": "via-router", "messages": MESSAGES, "max_tokens": 6, "stream": True, "ignore_eos": True}
    events = parse_events(stream_raw(front, "/v1/chat/completions", body))
    assert all("usage" not in e for e in events)
    events = parse_events(stream_raw(front, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}))
    last = events[-1]
    assert last["choices"] == [] and last["model"] == "via-router"
    assert last["usage"]["completion_tokens"] == 6
    assert all("usage" not in e for e in events[:-1])
    (stats,) = httpx.get(f"{front.url}/health").json()["models"]["via-router"]["deployments"]
    assert stats["completion_tokens"] >= 12  # counted for both streams, asked or not


def test_listed_extra_is_forwarded(front):
    body = {"model": "via-router", "messages": MESSAGES, "max_tokens": 4, "return_token_ids": True}
    reply = post(front, "/v1/chat/completions", body).json()
    assert reply["model"] == "via-router"
    assert isinstance(reply["prompt_token_ids"], list) and len(reply["choices"][0]["token_ids"]) <= 4


def test_listed_top_k_reaches_llama_cpp_server(front):
    base = {"model": "via-llama-cpp", "messages": MESSAGES, "max_tokens": 12}
    greedy = post(front, "/v1/chat/completions", {**base, "temperature": 0}).json()["choices"][0]["message"]["content"]
    hot = [post(front, "/v1/chat/completions", {**base, "temperature": 2.0, "seed": s}).json()["choices"][0]["message"]["content"]
           for s in (1, 2)]
    assert any(h != greedy for h in hot)  # without top_k, this temperature wanders
    for seed in (1, 2):
        r = post(front, "/v1/chat/completions", {**base, "temperature": 2.0, "seed": seed, "top_k": 1})
        assert r.json()["choices"][0]["message"]["content"] == greedy  # top_k=1 is greedy


@pytest.mark.parametrize("model, extra", [("via-llama-cpp", {"min_p": 0.1}), ("via-router", {"priority": 1}),
                                          ("via-llama-cpp", {"return_token_ids": True}),
                                          ("via-router", {"prediction": {"type": "content", "content": "Red"}})])
def test_unlisted_extra_is_400(front, model, extra):
    r = post(front, "/v1/chat/completions", {"model": model, "messages": MESSAGES, **extra})
    name = next(iter(extra))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": f"Model `{model}` (backend `remote`) cannot honour `{name}`.",
                                 "type": "invalid_request_error", "param": name, "code": "unsupported_parameter"}


@pytest.mark.parametrize("model, stream", [("via-router", False), ("via-router", True), ("via-llama-cpp", False)])
def test_upstream_400_relayed_with_its_message(front, model, stream):
    long = [{"role": "user", "content": "word " * 1500}]
    r = post(front, "/v1/chat/completions", {"model": model, "messages": long, "max_tokens": 8, "stream": stream})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "maximum context length is 1024 tokens" in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] in (None, "context_length_exceeded")


def test_llama_cpp_server_stream_that_dies_before_its_first_event_is_502(front):
    # llama-cpp-python's server answers an over-long *streaming* request with 200 and an empty
    # stream (its error goes to its log): nothing reached the client yet, so it is a 502, not a
    # truncated 200.
    long = [{"role": "user", "content": "word " * 1500}]
    r = post(front, "/v1/chat/completions", {"model": "via-llama-cpp", "messages": long, "max_tokens": 8, "stream": True})
    assert r.status_code == 502
    assert "ended the stream before its first event" in r.json()["error"]["message"]


@pytest.mark.parametrize("model", MODELS)
def test_completions(front, model):
    body = {"model": model, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}
    full = post(front, "/v1/completions", body).json()
    assert full["model"] == model and full["object"] == "text_completion"
    events = parse_events(stream_raw(front, "/v1/completions", {**body, "stream": True}))
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["choices"][0]["text"]
    assert all(e["model"] == model for e in events)


def test_models_and_health(front, upstream_router, llama_cpp_server):
    cards = {m["id"]: m for m in httpx.get(f"{front.url}/v1/models").json()["data"]}
    assert {"via-router", "via-llama-cpp", "both"} <= set(cards)
    assert all(cards[m]["backend"] == "remote" and cards[m]["ready"] for m in ("via-router", "via-llama-cpp", "both"))
    health = httpx.get(f"{front.url}/health")
    assert health.status_code == 200
    both = health.json()["models"]["both"]
    assert both["state"] == "ready" and [d["state"] for d in both["deployments"]] == ["up", "up"]


def test_both_upstreams_share_the_traffic(front):
    for _ in range(4):
        r = post(front, "/v1/chat/completions", {"model": "both", "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "both"
    deployments = httpx.get(f"{front.url}/health").json()["models"]["both"]["deployments"]
    assert [d["requests"] for d in deployments] == [2, 2]
