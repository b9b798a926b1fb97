"""Strict decoding of request bodies into the composed request types."""

import json

import msgspec
import pytest

import plugins.priority
import plugins.sampling
import plugins.templating
from router.errors import BadRequest
from router.hookspecs import RequestField
from router.plugins import load_plugins
from router.requests import FieldConflict, chat_params, completion_params, compose


@pytest.fixture(scope="module")
def types():
    p = load_plugins(entrypoints=False, extra=[plugins.sampling, plugins.templating, plugins.priority])
    return compose(p.request_fields())


def chat(types, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return types.decode_chat(json.dumps(body).encode())


def err(fn, *a, **kw) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        fn(*a, **kw)
    assert e.value.status == 400
    return e.value


def test_minimal_chat(types):
    r = chat(types)
    assert r.model == "m" and r.messages[0].content == "hi" and r.n == 1


def test_unknown_field_is_rejected_with_openai_wording(types):
    e = err(chat, types, foo=1)
    assert e.message == "Unrecognized request argument supplied: foo" and e.param == "foo"


@pytest.mark.parametrize("body, param", [
    (b'{"messages":[{"role":"user","content":"hi"}]}', "model"),
    (b'{"model":"m"}', "messages"),
    (b'{"model":"m","messages":[{"role":"tool","content":"x"}]}', "messages[0].tool_call_id"),
])
def test_a_missing_required_field_is_named(types, body, param):
    e = err(types.decode_chat, body)
    assert e.param == param and e.message == f"Missing required field: {param}"


def test_unknown_nested_field_names_its_path(types):
    body = b'{"model":"m","messages":[{"role":"user","content":"hi","bogus":1}]}'
    e = err(types.decode_chat, body)
    assert e.param == "messages[0].bogus"


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("n", 0, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("max_completion_tokens", -1, "max_completion_tokens"),
        ("presence_penalty", 3, "presence_penalty"),
        ("frequency_penalty", -2.5, "frequency_penalty"),
        ("logit_bias", {"5": 200}, "logit_bias"),
        ("top_logprobs", 21, "top_logprobs"),
        ("stop", 5, "stop"),
        ("stream", "yes", "stream"),
        ("top_k", -2, "top_k"),
        ("min_p", 1.5, "min_p"),
        ("priority", 1.5, "priority"),
        ("messages", [], "messages"),
        ("tool_choice", "sometimes", "tool_choice"),
    ],
)
def test_bad_values_name_the_field(types, field, value, param):
    e = err(chat, types, **{field: value})
    assert e.param == param, e.message


def test_bad_role_names_the_field(types):
    e = err(types.decode_chat, b'{"model":"m","messages":[{"role":"wizard","content":"x"}]}')
    assert e.param == "messages[0].role"


def test_missing_model(types):
    e = err(types.decode_chat, b'{"messages":[{"role":"user","content":"x"}]}')
    assert "model" in e.message


@pytest.mark.parametrize("body", [b"", b"   ", b"{", b"[1,2]", b"null", b'{"model": "m", ', b"\xff\xfe"])
def test_bad_json(types, body):
    err(types.decode_chat, body)


def test_plugin_fields_decode(types):
    r = chat(types, top_k=5, min_p=0.1, priority=-3, chat_template_kwargs={"enable_thinking": False})
    assert (r.top_k, r.min_p, r.priority) == (5, 0.1, -3)


def test_plugin_fields_are_per_endpoint(types):
    # continue_final_message is a chat field only.
    body = b'{"model":"m","prompt":"x","continue_final_message":true}'
    e = err(types.decode_completions, body)
    assert e.message == "Unrecognized request argument supplied: continue_final_message"


def test_top_logprobs_needs_logprobs(types):
    e = err(chat_params, chat(types, top_logprobs=2))
    assert e.param == "top_logprobs"


def test_stream_options_needs_stream(types):
    e = err(chat_params, chat(types, stream_options={"include_usage": True}))
    assert e.param == "stream_options"


def test_tool_choice_needs_tools(types):
    e = err(chat_params, chat(types, tool_choice="auto"))
    assert e.param == "tool_choice"


def test_named_tool_must_exist(types):
    tools = [{"type": "function", "function": {"name": "a"}}]
    e = err(chat_params, chat(types, tools=tools, tool_choice={"type": "function", "function": {"name": "b"}}))
    assert e.param == "tool_choice"


def test_logit_bias_keys_must_be_ids(types):
    e = err(chat_params, chat(types, logit_bias={"abc": 1}))
    assert e.param == "logit_bias"


def test_empty_stop_string(types):
    e = err(chat_params, chat(types, stop=["a", ""]))
    assert e.param == "stop[1]"


def test_params_from_core_fields(types):
    p = chat_params(chat(types, temperature=0, max_tokens=5, max_completion_tokens=7, stop="x",
                         logprobs=True, top_logprobs=3, seed=9, n=2, stream=True,
                         stream_options={"include_usage": True}))
    assert p.sampling.temperature == 0 and p.max_tokens == 7 and p.stop == ["x"]
    assert p.sampling.logprobs == 3 and p.sampling.seed == 9 and p.n == 2
    assert p.include_usage and p.requires == {"logprobs": "logprobs"}


def test_completion_prompt_shapes(types):
    for prompt in ["x", ["x", "y"], [1, 2, 3], [[1, 2], [3]]]:
        r = types.decode_completions(json.dumps({"model": "m", "prompt": prompt}).encode())
        assert r.prompt == prompt
    p = completion_params(types.decode_completions(b'{"model":"m","prompt":"x","logprobs":2,"echo":true}'))
    assert p.sampling.logprobs == 2 and p.echo


def test_two_plugins_declaring_one_field_fail_with_both_names():
    with pytest.raises(FieldConflict) as e:
        compose([("alpha", RequestField("x", int)), ("beta", RequestField("x", int))])
    assert "alpha" in str(e.value) and "beta" in str(e.value)


def test_plugin_may_not_redeclare_a_core_field():
    with pytest.raises(FieldConflict) as e:
        compose([("alpha", RequestField("temperature", float))])
    assert "alpha" in str(e.value) and "core" in str(e.value)


def test_omitted_plugin_field_takes_default(types):
    r = chat(types)
    assert r.priority == 0 and r.add_generation_prompt is True and r.top_k is None


def test_deep_nesting_is_a_400_not_a_crash(types):
    deep = b'{"model":"m","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":' + b"[" * 50000 + b"]" * 50000 + b"}}"
    e = err(types.decode_chat, deep)
    assert "deep" in e.message


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("n", 129, "n"),
        ("stop", ["x"] * 65, "stop"),
        ("stop", "x" * 1025, "stop[0]"),
        ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias"),
        ("messages", [{"role": "user", "content": "x"}] * 4097, "messages"),
    ],
)
def test_hostile_sizes_are_capped_by_the_limits(types, field, value, param):
    from router.config import Limits
    from router.requests import check_limits

    req = chat(types, **{field: value})
    e = err(check_limits, req, chat_params(req), Limits())
    assert e.param == param


def test_limits_are_configurable_and_json_depth_is_bounded(types):
    from router.config import Limits
    from router.requests import check_limits

    req = chat(types, n=3)
    err(check_limits, req, chat_params(req), Limits(max_n=2))
    nested = {"a": 1}
    for _ in range(70):
        nested = {"x": nested}
    req = chat(types, chat_template_kwargs=nested)
    e = err(check_limits, req, chat_params(req), Limits())
    assert "deeper" in e.message
    shallow = chat(types, chat_template_kwargs={"x": {"y": [1, {"z": 2}]}})
    check_limits(shallow, chat_params(shallow), Limits())
    many = types.decode_completions(b'{"model":"m","prompt":["a","b","c"]}')
    err(check_limits, many, completion_params(many), Limits(max_prompts=2))
