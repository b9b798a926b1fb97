"""Tool calling over HTTP with the bundled model, on both local engines, with the openai SDK."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from sse_util import parse_events

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\\\.com$"},
            "subject": {"type": "string", "maxLength": 40},
            "urgent": {"type": "boolean"}}, "required": ["to", "subject", "urgent"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = {
    "get_weather": "What is the weather in Paris?",
    "add": "What is 17 plus 25?",
    "send_email": "Email bob@mail.com that the meeting moved.",
}


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.fixture(scope="module")
def sdk(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("name", list(ASK))
def test_named_tool_choice_streams_the_same_call(sdk, model, name):
    assert_forced_call_streams_the_same(sdk, model, name, 120)


def assert_forced_call_streams_the_same(sdk, model: str, name: str, max_tokens: int):
    """The model forced to call ``name``: one call to it, valid against its schema; the
    message. Streamed, the SDK's own accumulation gives the same call."""
    kw = dict(model=model, messages=[{"role": "user", "content": ASK[name]}], tools=TOOLS, temperature=0,
              tool_choice={"type": "function", "function": {"name": name}}, max_tokens=max_tokens)
    full = sdk.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == name
    check_call(call)
    with sdk.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert streamed.function.name == name and streamed.function.arguments == call.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"
    return choice.message


def test_required_tool_choice_calls_some_tool(sdk, model):
    for prompt in ASK.values():
        r = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                        tool_choice="required", temperature=0, max_tokens=200)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls"
        for call in calls:
            check_call(call)


def test_stream_deltas_follow_the_openai_shape_and_leak_no_markup(base_url, model):
    body = {"model": model, "messages": [{"role": "user", "content": ASK["add"]}], "tools": TOOLS,
            "tool_choice": "required", "temperature": 0, "max_tokens": 120, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300) as r:
        events = parse_events(r.read())
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls, deltas
    first = calls[0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
    assert first["type"] == "function" and first["function"]["name"] in SCHEMAS
    for later in calls[1:]:
        if later["index"] == first["index"]:
            assert set(later) == {"index", "function"} and set(later["function"]) == {"arguments"}
    args = "".join(c["function"]["arguments"] for c in calls if c["index"] == 0)
    jsonschema.validate(json.loads(args), SCHEMAS[first["function"]["name"]])
    content = "".join(d.get("content") or "" for d in deltas)
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]


def test_tool_results_round_trip_through_the_template(sdk, model):
    messages = [
        {"role": "user", "content": ASK["add"]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    r = sdk.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    toks = httpx.post(f"{sdk.base_url}".replace("/v1/", "") + "/tokenize",
                      json={"model": model, "messages": messages, "tools": TOOLS, "return_token_strs": True}).json()
    text = "".join(toks["token_strs"])
    assert "get_weather" in text and "42" in text  # the tool list and the tool result reach the model


def test_tool_choice_errors(base_url, model):
    msgs = [{"role": "user", "content": "x"}]
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": model, "messages": msgs, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": model, "messages": msgs, "tools": TOOLS,
                                                           "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": model, "messages": msgs, "tools": TOOLS,
                                                           "tool_choice": "required", "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
