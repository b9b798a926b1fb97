"""Anthropic's Messages API in and out of the chat pipeline, piece by piece: requests into the
chat requests they mean, chat answers and chat streams into Anthropic's message and events."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from router.anthropic.protocol import CountTokensRequest, MessagesRequest
from router.anthropic.stream import MessageEvents
from router.anthropic.translate import chat_request, message, stop_reason, tool_input
from router.errors import BadRequest
from router.plugins import load_plugins
from router.requests import compose

TYPES = compose(load_plugins().request_fields())
FIELDS = set(TYPES.fields)
TOOL = {"name": "get_weather", "description": "Weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat(body: dict, thinks: bool = False, counting: bool = False) -> dict:
    """The chat request as JSON would carry it (defaults such as ``"type": "function"`` left out)."""
    req = msgspec.convert(body, CountTokensRequest if counting else MessagesRequest)
    return msgspec.to_builtins(chat_request(req, TYPES.chat, FIELDS, thinks))


def base(**kw) -> dict:
    return {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_system_blocks_come_first_and_a_system_entry_in_messages_keeps_its_place():
    out = chat(base(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                            {"type": "text", "text": "Be kind."}],
                    messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
                              {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]))
    assert out["messages"] == [{"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "a"},
                               {"role": "system", "content": "late"}, {"role": "user", "content": "b\nc"}]
    assert out["max_tokens"] == 50


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages_in_order():
    out = chat(base(tools=[TOOL], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no station"}]},
            {"type": "text", "text": "And tomorrow?"}]}]))
    assert out["messages"][1] == {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
                                  "tool_calls": [
                                      {"id": "toolu_1",
                                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                                      {"id": "toolu_2",
                                       "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert out["messages"][2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                                   {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
                                   {"role": "user", "content": "And tomorrow?"}]
    assert out["tools"] == [{"function": {
        "name": "get_weather", "description": "Weather in a city.", "parameters": TOOL["input_schema"]}}]


@pytest.mark.parametrize("choice,want", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"tool_choice": {"function": {"name": "get_weather"}}, "parallel_tool_calls": False}),
])
def test_tool_choice(choice, want):
    out = chat(base(tools=[TOOL], tool_choice=choice))
    assert {k: out[k] for k in want} == want


def test_sampling_stops_user_and_stream_options():
    out = chat(base(stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=5, metadata={"user_id": "u1"},
                    stream=True))
    assert {k: out[k] for k in ("stop", "temperature", "top_p", "top_k", "user", "stream", "stream_options")} == {
        "stop": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "user": "u1", "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def test_thinking_and_effort_reach_a_thinking_model_only():
    body = base(thinking={"type": "disabled"}, output_config={"effort": "max"})
    assert chat(body) == chat(base())  # accepted, ignored
    out = chat(body, thinks=True)
    assert out["reasoning_effort"] == "high" and out["include_reasoning"] is False
    assert out["chat_template_kwargs"] == {"enable_thinking": False}
    assert "include_reasoning" not in chat(base(thinking={"type": "adaptive"}, output_config={"effort": "low"}),
                                           thinks=True)


def test_what_claude_code_sends_is_accepted():
    body = base(max_tokens=32000, thinking={"type": "adaptive"}, output_config={"effort": "high"},
                context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                metadata={"user_id": "user_abc_account_1_session_2"}, tools=[{**TOOL, "cache_control": {"type": "ephemeral"}}],
                messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}])
    assert chat(body)["max_tokens"] == 32000


def test_a_count_tokens_body_takes_no_max_tokens():
    out = chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, counting=True)
    assert "max_tokens" not in out and "stream" not in out


@pytest.mark.parametrize("body,param", [
    (base(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]),
     "messages[0].content[0].type"),
    (base(messages=[{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
     "messages[0].content[0].type"),
    (base(tools=[TOOL], tool_choice={"type": "tool", "name": "other"}), "tool_choice.name"),
    (base(tool_choice={"type": "any"}), "tool_choice"),
])
def test_what_cannot_be_said_in_chat_is_a_400_naming_the_field(body, param):
    with pytest.raises(BadRequest) as caught:
        chat(body)
    assert caught.value.param == param


@pytest.mark.parametrize("finish,by,want", [
    ("stop", None, ("end_turn", None)), ("stop", 2, ("end_turn", None)), ("stop", "END", ("stop_sequence", "END")),
    ("length", None, ("max_tokens", None)), ("tool_calls", None, ("tool_use", None)),
])
def test_stop_reasons(finish, by, want):
    assert stop_reason(finish, by) == want


def test_tool_input_keeps_what_is_not_an_object():
    assert tool_input('{"a": 1}') == {"a": 1} and tool_input("") == {}
    assert tool_input("[1]") == {"arguments": [1]} and tool_input("{oops") == {"arguments": "{oops"}


def test_a_chat_answer_as_a_message():
    reply = json.dumps({"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": "Sure.", "reasoning": "Think.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39,
                  "prompt_tokens_details": {"cached_tokens": 16}}}).encode()
    out = msgspec.to_builtins(message(reply))
    assert out == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
                   "stop_sequence": None, "content": [
                       {"type": "thinking", "thinking": "Think.", "signature": ""},
                       {"type": "text", "text": "Sure."},
                       {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
                   "usage": {"input_tokens": 14, "output_tokens": 9, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 16}}


def chunk(delta=None, finish=None, usage=None, stop_reason=None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                         **({"stop_reason": stop_reason} if stop_reason is not None else {})}]
    body = {"id": "chatcmpl-xyz", "model": "m", "choices": choices, **({"usage": usage} if usage else {})}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def chat_stream(items):
    for item in items:
        yield item


def convert(items) -> list[tuple[str, dict]]:
    async def run():
        return [e async for e in MessageEvents(chat_stream(items))]

    out = []
    for raw in asyncio.run(run()):
        if raw.startswith(b":"):
            out.append(("comment", {}))
            continue
        name, data = raw.decode().rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append((payload["type"], payload))
    return out


def test_a_stream_of_thinking_text_and_two_tool_calls():
    usage = {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}
    events = convert([
        b": loading model m\n\n",
        chunk({"role": "assistant"}, usage=usage),
        chunk({"reasoning": "Hm"}), chunk({"reasoning": "m."}),
        chunk({"content": "Ok"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
        chunk({}, finish="tool_calls"),
        chunk(usage={"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                     "prompt_tokens_details": {"cached_tokens": 4}}),
        b"data: [DONE]\n\n",
    ])
    assert [name for name, _ in events] == [
        "comment", "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[1][1]["message"]
    assert start["id"] == "msg_xyz" and start["usage"]["input_tokens"] == 10 and start["usage"]["output_tokens"] == 0
    blocks = [e for n, e in events if n == "content_block_start"]
    assert [b["index"] for b in blocks] == [0, 1, 2, 3]
    assert [b["content_block"]["type"] for b in blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert blocks[2]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}
    deltas = [e["delta"] for n, e in events if n == "content_block_delta"]
    assert deltas[:3] == [{"type": "thinking_delta", "thinking": "Hm"}, {"type": "thinking_delta", "thinking": "m."},
                          {"type": "text_delta", "text": "Ok"}]
    assert "".join(d["partial_json"] for d in deltas[3:5]) == '{"x": 1}'
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"] == {"input_tokens": 6, "output_tokens": 7, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4}


def test_a_stop_sequence_in_a_stream():
    events = convert([chunk({"content": "a"}), chunk({}, finish="stop", stop_reason="END"), b"data: [DONE]\n\n"])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_error_event_ends_the_stream():
    error = {"error": {"message": "The worker died.", "type": "service_unavailable", "param": None, "code": None}}
    events = convert([chunk({"content": "a"}), b"data: " + json.dumps(error).encode() + b"\n\n", b"data: [DONE]\n\n"])
    assert [n for n, _ in events][-2:] == ["content_block_delta", "error"]
    assert events[-1][1]["error"] == {"type": "overloaded_error", "message": "The worker died."}


def test_a_stream_that_stops_short_says_so():
    events = convert([chunk({"content": "a"})])
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"


def test_closing_before_the_first_event_closes_the_chat_stream():
    closed = []

    class Chat:
        def __aiter__(self):
            return self

        async def __anext__(self):
            raise StopAsyncIteration

        async def aclose(self):
            closed.append(True)

    asyncio.run(MessageEvents(Chat()).aclose())
    assert closed == [True]
