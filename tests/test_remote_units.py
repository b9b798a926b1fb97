"""The remote backend's tricky pieces, without a network: balancing and ejection, upstream error
shapes, the body sent upstream, the SSE splitter and the config."""

from __future__ import annotations

import json

import msgspec
import pytest

from backends.remote import RemoteBackend, RemoteConfig
from backends.remote.balancer import Balancer
from backends.remote.deployment import build_deployments
from backends.remote.errors import body_from_json, client_error, error_body, status_of
from backends.remote.events import EventSplitter
from backends.remote.forward import extras_used, upstream_body
from router.config import ConfigError, parse_config
from router.plugins import load_plugins
from router.requests import compose


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def remote(**kw) -> RemoteConfig:
    base = {"name": "m", "backend": "remote", "deployments": [{"url": "http://a:1/v1"}, {"url": "http://b:2/v1"}]}
    return msgspec.convert({**base, **kw}, RemoteConfig)


def balancer(config: RemoteConfig | None = None, **kw) -> tuple[Balancer, Clock]:
    config = config or remote()
    clock = Clock()
    b = Balancer(build_deployments(config), failure_threshold=kw.get("threshold", 3),
                 cooldown=kw.get("cooldown", 10.0), clock=clock)
    return b, clock


def names(picks) -> list[str]:
    return [d.name for d in picks]


# --- balancing ---------------------------------------------------------------------------------


def test_fewest_in_flight_wins():
    b, _ = balancer(remote(deployments=[{"url": f"http://h{i}:1/v1"} for i in range(3)]))
    first, second, third = b.pick(), b.pick(), b.pick()
    assert {first.name, second.name, third.name} == {"h0:1", "h1:1", "h2:1"}  # one each
    b.release(second)
    assert b.pick() is second  # the only one with nothing in flight
    assert second.in_flight == 1 and first.in_flight == 1


def test_ties_alternate_with_equal_weights():
    b, _ = balancer()
    picks = []
    for _ in range(6):
        d = b.pick()
        picks.append(d)
        b.release(d)
    assert names(picks) == ["a:1", "b:2"] * 3


def test_ties_follow_weights_spread_out():
    b, _ = balancer(remote(deployments=[{"url": "http://a:1/v1", "weight": 2}, {"url": "http://b:2/v1"}]))
    picks = []
    for _ in range(9):
        d = b.pick()
        picks.append(d.name)
        b.release(d)
    assert picks.count("a:1") == 6 and picks.count("b:2") == 3
    assert "b:2b:2" not in "".join(picks) and "a:1a:1a:1" not in "".join(picks)


def test_in_flight_beats_weight():
    b, _ = balancer(remote(deployments=[{"url": "http://a:1/v1", "weight": 10}, {"url": "http://b:2/v1"}]))
    a = b.pick()
    assert a.name == "a:1"
    assert b.pick().name == "b:2"  # a has one in flight, b none: weight only breaks ties


def test_tried_and_needs_are_skipped():
    config = remote(deployments=[{"url": "http://a:1/v1", "forward_extras": ["top_k"]}, {"url": "http://b:2/v1"}])
    b, _ = balancer(config)
    assert b.pick(tried=[0]).name == "b:2"
    assert b.pick(needs=frozenset({"top_k"})).name == "a:1"
    assert b.pick(tried=[0], needs=frozenset({"top_k"})) is None
    assert b.pick(needs=frozenset({"logprobs"})) is not None  # every upstream has logprobs


def test_ejection_after_n_failures_and_cooldown_expiry():
    b, clock = balancer(threshold=2, cooldown=5.0)
    a, other = b.deployments
    assert not b.failed(a, "HTTP 500")
    assert a.state(clock()) == "up"
    assert b.failed(a, "HTTP 500")  # second in a row: cools down
    assert a.state(clock()) == "cooling" and a.ejections == 1
    for _ in range(4):
        d = b.pick()
        assert d is other
        b.release(d)
    clock.now += 4.9
    assert b.pick(tried=[1]) is None
    assert b.retry_after(10.0) == 1  # b is up: retry now
    clock.now += 0.2  # cooldown over: a takes traffic again
    picks = set()
    for _ in range(2):
        d = b.pick()
        picks.add(d.name)
        b.release(d)
    assert picks == {"a:1", "b:2"}


def test_half_open_after_cooldown():
    b, clock = balancer(threshold=3, cooldown=5.0)
    a = b.deployments[0]
    for _ in range(3):
        b.failed(a, "timeout")
    clock.now += 5.0
    assert a.available(clock())
    assert b.failed(a, "timeout")  # one failure after the cooldown is enough
    assert a.state(clock()) == "cooling" and a.ejections == 2
    clock.now += 5.0
    b.succeeded(a)
    assert a.failures == 0
    assert not b.failed(a, "timeout")  # a success cleared the count


def test_failures_must_be_in_a_row():
    b, clock = balancer(threshold=2)
    a = b.deployments[0]
    b.failed(a, "x")
    b.succeeded(a)
    assert not b.failed(a, "x")
    assert a.available(clock())


def test_all_cooling_gives_none_and_retry_after():
    b, clock = balancer(threshold=1, cooldown=7.5)
    a, c = b.deployments
    b.failed(a, "x")
    clock.now += 2
    b.failed(c, "y")
    assert b.pick() is None and not b.any_available()
    assert b.retry_after(10.0) == 6  # a is back first: ceil(7.5 - 2)
    assert "a:1 cooling" in b.why_unavailable() and "(y)" in b.why_unavailable()


def test_down_by_health_check_is_skipped():
    b, _ = balancer()
    a, c = b.deployments
    a.healthy, a.health_error = False, "GET http://a:1/health answered HTTP 503"
    assert {b.pick().name for _ in range(3)} == {"b:2"}
    c.healthy = False
    assert b.pick() is None
    assert b.retry_after(4.0) == 4  # the next health check
    assert "a:1 down (GET http://a:1/health answered HTTP 503)" in b.why_unavailable()


# --- upstream errors ---------------------------------------------------------------------------


def envelope(status: int, obj) -> dict:
    content = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return msgspec.to_builtins(error_body(status, content))


def test_openai_shape_kept():
    body = {"error": {"message": "bad temperature", "type": "invalid_request_error", "param": "temperature", "code": "x"}}
    assert envelope(400, body) == body["error"]


def test_llama_server_shape_with_int_code():
    assert envelope(400, {"error": {"code": 400, "message": "the request exceeds the context", "type": "invalid_request_error"}}) == {
        "message": "the request exceeds the context", "type": "invalid_request_error", "param": None, "code": 400}


def test_tensorrt_llm_object_error():
    got = envelope(400, {"object": "error", "message": "Unrecognized field top_k", "type": "BadRequestError", "param": None, "code": 400})
    assert got == {"message": "Unrecognized field top_k", "type": "invalid_request_error", "param": None, "code": 400}


def test_string_error():
    assert envelope(400, {"error": "messages must not be empty"}) == {
        "message": "messages must not be empty", "type": "invalid_request_error", "param": None, "code": None}
    assert envelope(404, {"error": "no such model", "code": 404})["type"] == "not_found_error"


def test_fastapi_detail_string_and_list():
    assert envelope(401, {"detail": "Invalid API key"}) == {
        "message": "Invalid API key", "type": "authentication_error", "param": None, "code": None}
    got = envelope(422, {"detail": [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer", "type": "int_parsing"}]})
    assert got["message"] == "max_tokens: Input should be a valid integer" and got["type"] == "invalid_request_error"


def test_bare_message_text_html_and_empty():
    assert envelope(503, {"message": "overloaded"})["message"] == "overloaded"
    html = envelope(502, b"<html><body>502 Bad Gateway</body></html>")
    assert html == {"message": "<html><body>502 Bad Gateway</body></html>", "type": "server_error", "param": None, "code": None}
    assert envelope(500, b"")["message"] == "HTTP 500"
    assert envelope(500, b"x" * 5000)["message"].endswith("...") and len(envelope(500, b"x" * 5000)["message"]) < 600
    assert envelope(429, {"unexpected": True})["type"] == "rate_limit_error"


def test_client_error_keeps_upstream_status():
    exc = client_error(422, error_body(422, b'{"object":"error","message":"m","type":"BadRequestError","code":422}'))
    assert exc.status == 422
    assert json.loads(exc.to_json()) == {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": 422}}


def test_in_stream_errors_and_their_status():
    trt = body_from_json({"object": "error", "message": "m", "type": "BadRequestError", "code": 400}, None)
    assert trt.type == "invalid_request_error" and status_of(trt) == 400
    ours = body_from_json({"error": {"message": "engine died", "type": "server_error", "param": None, "code": None}}, None)
    assert ours.type == "server_error" and status_of(ours) is None
    assert status_of(body_from_json({"error": "x", "code": "503"}, None)) == 503
    assert body_from_json({"id": "c", "choices": []}, None) is None  # a chunk is not an error
    assert body_from_json([1], None) is None


# --- the body sent upstream --------------------------------------------------------------------


@pytest.fixture(scope="module")
def types():
    return compose(load_plugins().request_fields())


def deployment(**kw):
    config = remote(deployments=[{"url": "http://a:1/v1", **kw}])
    return build_deployments(config)[0]


def test_only_listed_extras_are_forwarded(types):
    req = types.decode_chat(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 5, "min_p": 0.1, "priority": 3,
    }).encode())
    assert sorted(extras_used(req)) == ["min_p", "priority", "top_k"]
    body = json.loads(upstream_body(req, deployment(forward_extras=["top_k", "priority"]), stream=False))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 5, "priority": 3}


def test_defaults_are_not_sent_and_model_is_rewritten(types):
    req = types.decode_chat(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1, "stream": False,
        "temperature": 0, "priority": 0, "add_generation_prompt": True, "top_k": None,
    }).encode())
    assert extras_used(req) == []
    body = json.loads(upstream_body(req, deployment(upstream_model="org/Big-70B"), stream=False))
    assert body == {"model": "org/Big-70B", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0}


def test_stream_always_asks_for_usage(types):
    req = types.decode_chat(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}')
    body = json.loads(upstream_body(req, deployment(), stream=True))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    req = types.decode_chat(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,'
                            b'"stream_options":{"include_usage":false,"continuous_usage_stats":true}}')
    body = json.loads(upstream_body(req, deployment(), stream=True))
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_function_types_survive_omit_defaults(types):
    req = types.decode_chat(json.dumps({
        "model": "m",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    }).encode())
    body = json.loads(upstream_body(req, deployment(), stream=False))
    assert body["tools"] == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert body["messages"][1]["tool_calls"][0]["type"] == "function"
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


def test_max_tokens_limit_sent_when_none_asked(types):
    chat = types.decode_chat(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert json.loads(upstream_body(chat, deployment(), stream=False, max_tokens_cap=7))["max_tokens"] == 7
    asked = types.decode_chat(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5}')
    body = json.loads(upstream_body(asked, deployment(), stream=False, max_tokens_cap=7))
    assert body["max_completion_tokens"] == 5 and "max_tokens" not in body
    prompt = types.decode_completions(b'{"model":"m","prompt":"x"}')
    assert "max_tokens" not in json.loads(upstream_body(prompt, deployment(), stream=False, max_tokens_cap=100))
    assert json.loads(upstream_body(prompt, deployment(), stream=False, max_tokens_cap=8))["max_tokens"] == 8


def test_completions_body(types):
    req = types.decode_completions(b'{"model":"m","prompt":["a","b"],"max_tokens":4,"echo":true,"top_k":2,"logprobs":1}')
    assert extras_used(req) == ["top_k"]
    body = json.loads(upstream_body(req, deployment(), stream=False))
    assert body == {"model": "m", "prompt": ["a", "b"], "max_tokens": 4, "echo": True, "logprobs": 1}


# --- the SSE splitter --------------------------------------------------------------------------


STREAM = b'data: {"a":1}\n\ndata: {"b":2}\n\n: ping - 2025-01-01\n\nevent: message\nid: 7\ndata: {"c":\ndata: 3}\n\ndata: [DONE]\n\n'
EXPECTED = [b'{"a":1}', b'{"b":2}', b'{"c":\n3}', b"[DONE]"]


def test_splitter_whole_stream():
    assert EventSplitter().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13])
def test_splitter_any_chunking(size):
    s = EventSplitter()
    out = []
    for i in range(0, len(STREAM), size):
        out += s.feed(STREAM[i:i + size])
    assert out == EXPECTED and s.pending == b""


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_splitter_crlf_and_cr(size):
    raw = STREAM.replace(b"\n", b"\r\n")
    s = EventSplitter()
    out = []
    for i in range(0, len(raw), size):
        out += s.feed(raw[i:i + size])
    assert out == EXPECTED
    assert EventSplitter().feed(STREAM.replace(b"\n", b"\r")) == EXPECTED


def test_splitter_no_space_after_colon_and_partial_event():
    s = EventSplitter()
    assert s.feed(b'data:{"x":1}\n\ndata: {"y"') == [b'{"x":1}']
    assert s.pending == b'data: {"y"'
    assert s.feed(b":2}\n\n") == [b'{"y":2}']


# --- config ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backends():
    return load_plugins().backends


def problems(backends, text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text.encode(), backends)
    return info.value.problems


def test_config_example_decodes(backends):
    cfg = parse_config(b'''
[[models]]
name = "llama-70b"
backend = "remote"
upstream_model = "meta-llama/Llama-3.1-70B-Instruct"
forward_extras = ["top_k", "priority"]
first_byte_timeout = 30
[[models.deployments]]
url = "http://trt-a:8000/v1"
[[models.deployments]]
url = "http://trt-b:8000/v1/"
weight = 2
upstream_model = "llama"
read_timeout = 5
forward_extras = []
''', backends)
    (model,) = cfg.models
    a, b = build_deployments(model)
    assert (a.name, a.url, a.upstream_model, a.weight, a.forward_extras) == (
        "trt-a:8000", "http://trt-a:8000/v1", "meta-llama/Llama-3.1-70B-Instruct", 1, frozenset({"top_k", "priority"}))
    assert (b.url, b.upstream_model, b.weight, b.forward_extras, b.read_timeout, b.first_byte_timeout) == (
        "http://trt-b:8000/v1", "llama", 2, frozenset(), 5.0, 30.0)
    assert a.health_urls == ("http://trt-a:8000/health", "http://trt-a:8000/v1/models")
    assert "authorization" not in a.headers


def test_config_unknown_keys_have_paths(backends):
    assert problems(backends, '[[models]]\nname="m"\nbackend="remote"\n[[models.deployments]]\nurl="http://a/v1"\nwieght=2\n') == [
        "models[0].deployments[0].wieght: unknown key"]
    assert problems(backends, '[[models]]\nname="m"\nbackend="remote"\nretries=2\n[[models.deployments]]\nurl="http://a/v1"\n') == [
        "models[0].retries: unknown key"]


def test_config_bad_values(backends):
    assert problems(backends, '[[models]]\nname="m"\nbackend="remote"\n') == [
        "models[0]: Object missing required field `deployments`"]
    assert problems(backends, '[[models]]\nname="m"\nbackend="remote"\ndeployments=[]\n') == [
        "models[0].deployments: Expected `array` of length >= 1"]
    (p,) = problems(backends, '[[models]]\nname="m"\nbackend="remote"\n[[models.deployments]]\nurl="trt-a:8000"\n')
    assert p.startswith("models[0].deployments[0]: url `trt-a:8000` must be http://")
    (p,) = problems(backends, '[[models]]\nname="m"\nbackend="remote"\n[[models.deployments]]\nurl="http://u:pw@a/v1"\n')
    assert p == "models[0].deployments[0]: url must not carry credentials (they would show in /health); use api_key"
    (p,) = problems(backends, '[[models]]\nname="m"\nbackend="remote"\n[[models.deployments]]\nurl="http://a/v1"\nweight=0\n')
    assert p == "models[0].deployments[0].weight: Expected `int` >= 1"
    (p,) = problems(backends, '[[models]]\nname="m"\nbackend="remote"\nforward_extras=["top-k"]\n[[models.deployments]]\nurl="http://a/v1"\n')
    assert p.startswith("models[0].forward_extras[0]: Expected `str` matching regex")
    (p,) = problems(backends, '[[models]]\nname="m"\nbackend="remote"\nchat_template="x.jinja"\n[[models.deployments]]\nurl="http://a/v1"\n')
    assert "chat_template is not used by the remote backend" in p
    (p,) = problems(backends, '[[models]]\nname="m"\nbackend="remote"\nreasoning_parser="qwen3"\n[[models.deployments]]\nurl="http://a/v1"\n')
    assert p.startswith("models[0]: reasoning_parser is not used by the remote backend")


def test_api_key_from_environment(monkeypatch):
    config = remote(api_key="env:ROUTER_TEST_KEY", deployments=[{"url": "http://a:1/v1"}, {"url": "http://b:1/v1", "api_key": "literal"}])
    with pytest.raises(ValueError, match="api_key: environment variable `ROUTER_TEST_KEY` is not set"):
        build_deployments(config)
    monkeypatch.setenv("ROUTER_TEST_KEY", "sekret")
    a, b = build_deployments(config)
    assert a.headers["authorization"] == "Bearer sekret" and b.headers["authorization"] == "Bearer literal"


def test_names_unique_and_health_path(backends):
    config = remote(health_check_path="/ready", deployments=[{"url": "http://a:1/v1"}, {"url": "http://a:1/other/v1"}])
    a, b = build_deployments(config)
    assert (a.name, b.name) == ("a:1", "a:1#1")
    assert a.health_urls == ("http://a:1/ready",)
    with pytest.raises(ValueError, match="name: `x` is used twice"):
        build_deployments(remote(deployments=[{"url": "http://a:1/v1", "name": "x"}, {"url": "http://b:1/v1", "name": "x"}]))


def test_capabilities_are_the_union_of_deployments():
    backend = RemoteBackend(remote(forward_extras=["top_k"], deployments=[
        {"url": "http://a:1/v1"}, {"url": "http://b:1/v1", "forward_extras": ["priority", "structured_outputs"]}]))
    assert backend.capabilities == {"logprobs", "top_k", "priority", "structured_outputs"}
    assert backend.state == "loading"
    every_one_overrides = RemoteBackend(remote(forward_extras=["top_k"], deployments=[
        {"url": "http://a:1/v1", "forward_extras": []}, {"url": "http://b:1/v1", "forward_extras": ["min_p"]}]))
    assert every_one_overrides.capabilities == {"logprobs", "min_p"}


def test_the_documented_example_is_valid(backends, monkeypatch):
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "remote.md").read_text()
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    (model,) = parse_config(example.encode(), backends).models
    monkeypatch.setenv("TRT_API_KEY", "t")
    monkeypatch.setenv("VLLM_KEY", "v")
    a, b, spare = build_deployments(model)
    assert (b.weight, spare.name, spare.upstream_model, spare.read_timeout) == (2, "vllm-spare", "llama-70b", 120.0)
    assert spare.headers["authorization"] == "Bearer v" and a.headers["authorization"] == "Bearer t"
    assert RemoteBackend(model).capabilities == {"logprobs", "top_k", "priority", "structured_outputs"}
