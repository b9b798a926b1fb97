"""Property-based: whatever JSON (or not-JSON) a client sends, the answer is a 200 or a 4xx in
the error envelope, never a 500, and the decoder's memory stays bounded."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

import plugins.priority
import plugins.sampling
import plugins.structured_outputs
import plugins.templating
from router.app import create_app
from router.config import parse_config
from router.errors import BadRequest
from router.plugins import load_plugins
from router.requests import compose
from test_serving import ENGINE, P

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5),
    max_leaves=30,
)
FIELDS = ["temperature", "top_p", "n", "max_tokens", "stop", "stream", "stream_options",
          "logprobs", "top_logprobs", "logit_bias", "seed", "tools", "tool_choice", "response_format", "top_k",
          "min_p", "priority", "structured_outputs", "chat_template_kwargs", "prompt", "echo", "bogus"]
near_valid = st.fixed_dictionaries(
    {"model": st.just("s"), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={f: json_values for f in FIELDS},
)


@pytest.fixture(scope="module")
def client():
    extra = [P(), plugins.sampling, plugins.templating, plugins.priority, plugins.structured_outputs]
    p = load_plugins(entrypoints=False, extra=extra)
    app = create_app(parse_config(b'[[models]]\nname="s"\nbackend="scripted"\nworker=false\n', p.backends), p)
    with TestClient(app, raise_server_exceptions=False) as c:
        c.get("/health")
        yield c


def check(response) -> None:
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text[:500]
    if response.status_code != 200:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@HYP
@given(body=json_values)
def test_any_json_document(client, body):
    ENGINE.fail_after = None
    check(client.post("/v1/chat/completions", content=json.dumps(body, allow_nan=True)))


@HYP
@given(body=near_valid, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize"]))
def test_near_valid_requests(client, body, path):
    ENGINE.fail_after = None
    check(client.post(path, content=json.dumps(body, allow_nan=True)))


@HYP
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(client, raw):
    check(client.post("/v1/chat/completions", content=raw))


@pytest.mark.parametrize("raw", [
    b'{"model": "s", "model": "t", "messages": [{"role": "user", "content": "hi"}]}',  # duplicate keys
    b'{"model": "s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
    b'{"model": "s", "messages": [{"role": "user", "content": "\\ud800"}]}',  # lone surrogate
    b'{"model": "s", "messages": [{"role": "user", "content": "\\u0000 \xf0\x9f\x8e\x89"}]}',
    b'{"model": "s", "messages": [{"role": "user", "content": "hi"}], "n": 99999999999999999999999}',
    b'{"model": "s", "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}",
])
def test_edge_cases(client, raw):
    check(client.post("/v1/chat/completions", content=raw))


def test_ten_megabyte_string_is_decoded_with_bounded_memory():
    types = compose(load_plugins(entrypoints=False, extra=[plugins.sampling]).request_fields())
    body = json.dumps({"model": "s", "messages": [{"role": "user", "content": "x" * (10 << 20)}], "top_k": "no"}).encode()
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest):
            types.decode_chat(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(body)  # the string itself, once or twice; no blow-up
