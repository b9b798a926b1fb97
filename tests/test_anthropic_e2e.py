"""``/v1/messages`` over real HTTP with the official ``anthropic`` SDK: on both local engines
(the bundled SmolLM2) and through a remote model, with Anthropic's events, usage and errors."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import openai
import pytest

from server import RouterProcess, llamacpp_config
from upstreams import remote_model
from workers_util import workers

WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": f"{text} ({uuid.uuid4().hex[:8]})"}]  # no answer cached before


def test_the_same_answer_as_chat_and_usage_that_adds_up(claude, base_url, model):
    messages = ask("Name three colours.")
    got = claude.messages.create(model=model, max_tokens=24, extra_body={"temperature": 0}, system="Be brief.",
                                 messages=messages)
    chat = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model=model, max_tokens=24, temperature=0, messages=[{"role": "system", "content": "Be brief."}, *messages])
    assert got.id.startswith("msg_") and got.type == "message" and got.role == "assistant" and got.model == model
    assert [b.type for b in got.content] == ["text"] and got.content[0].text == chat.choices[0].message.content
    assert got.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert got.usage.output_tokens == chat.usage.completion_tokens
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = claude.messages.count_tokens(model=model, system="Be brief.", messages=messages)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_stream_gives_the_same_message_event_by_event(claude, model):
    kw = dict(model=model, max_tokens=20, extra_body={"temperature": 0}, messages=ask("Count to five."))
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_raw_stream_names_each_event_by_its_type(base_url, model):
    body = {"model": model, "max_tokens": 5, "stream": True, "messages": ask("Hi.")}
    with httpx.stream("POST", f"{base_url}/v1/messages?beta=true", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    for e in events:
        name, data = e.split("\n")
        assert name.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert events[0].startswith("event: message_start") and events[1].startswith("event: ping")
    assert events[-1].startswith("event: message_stop")


def test_a_forced_tool_call_is_a_tool_use_block_streamed_or_not(claude, model):
    kw = dict(model=model, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER], messages=ask("Weather in Paris?"),
              tool_choice={"type": "tool", "name": "get_weather"})
    got = claude.messages.create(**kw)
    (call,) = [b for b in got.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and isinstance(call.input["city"], str)
    assert got.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == call.input and final.stop_reason == "tool_use"
    # The answer goes back as a tool_result; the next turn reads it.
    follow = claude.messages.create(model=model, max_tokens=10, tools=[WEATHER], messages=[
        *kw["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in got.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."}]}])
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > got.usage.input_tokens


def test_a_stop_sequence_ends_the_answer_and_is_named(claude, model):
    kw = dict(model=model, max_tokens=30, extra_body={"temperature": 0}, messages=ask("Write a sentence about the sea."))
    text = claude.messages.create(**kw).content[0].text
    words = text.split()
    assert len(words) > 3, text
    stop = " " + words[2]
    got = claude.messages.create(**kw, stop_sequences=[stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    assert got.content[0].text == text[: text.index(stop)]


def test_max_tokens_past_the_context_is_capped_and_a_prompt_past_it_is_refused(claude, model):
    filler = "apple " * 950  # about 950 tokens of the 1,024
    got = claude.messages.create(model=model, max_tokens=32000, messages=ask(filler))
    assert got.stop_reason in ("max_tokens", "end_turn")
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens + got.usage.output_tokens <= 1024
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=model, max_tokens=32000, messages=ask("apple " * 1100))
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert "1024" in caught.value.body["error"]["message"]


def test_errors_take_anthropics_envelope(claude, base_url):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", max_tokens=5, messages=ask("Hi."))
    assert caught.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model `no-such-model` does not exist."}}
    r = httpx.post(f"{base_url}/v1/messages", json={"model": "smollm2", "messages": ask("Hi."), "max_tokens": 5, "n": 2})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Unrecognized request argument supplied: n"}}
    r = httpx.post(f"{base_url}/v1/messages", json={"model": "smollm2", "messages": ask("Hi.")})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.get(f"{base_url}/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    # The OpenAI paths keep OpenAI's envelope.
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "no-such-model", "messages": ask("Hi.")})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- a remote model, behind keys ------------------------------------------------------------------


@pytest.fixture(scope="module")
def front(upstream, tmp_path_factory):
    config = ('[server]\napi_keys = ["sekret"]\n' + remote_model("relay", upstream.url, upstream_model='"up"',
                                                                 health_check_interval="0")
              + llamacpp_config("lazy", extra="preload = false"))
    router = RouterProcess(config, tmp_path_factory.mktemp("anthropic_remote"), name="front")
    yield router
    router.stop()


def test_a_remote_model_through_chat_completions_upstream(front, upstream):
    upstream.reset("ok")
    claude = anthropic.Anthropic(base_url=front.url, api_key="sekret", max_retries=0)  # sent as x-api-key
    got = claude.messages.create(model="relay", max_tokens=10, system="S.", stop_sequences=["zz"],
                                 messages=[{"role": "user", "content": "Hi"}])
    sent = upstream.hits[-1]
    assert sent["path"] == "/v1/chat/completions" and sent["body"]["model"] == "up"
    assert sent["body"]["messages"] == [{"role": "system", "content": "S."}, {"role": "user", "content": "Hi"}]
    assert sent["body"]["max_tokens"] == 10 and sent["body"]["stop"] == ["zz"]
    assert got.content[0].type == "text" and got.content[0].text and got.usage.input_tokens == 5
    with claude.messages.stream(model="relay", max_tokens=10, messages=[{"role": "user", "content": "Hi"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == got.content[0].text and final.usage.input_tokens == 5
    assert "continuous_usage_stats" not in str(upstream.hits[-1]["body"].get("stream_options"))
    assert claude.messages.count_tokens(model="relay", messages=[{"role": "user", "content": "Hi"}]).input_tokens == 5


def test_an_upstream_error_mid_stream_is_an_error_event(front, upstream):
    upstream.reset("error_event")
    claude = anthropic.Anthropic(base_url=front.url, api_key="sekret", max_retries=0)
    with pytest.raises(anthropic.APIStatusError):
        with claude.messages.stream(model="relay", max_tokens=10, messages=[{"role": "user", "content": "Hi"}]) as s:
            s.get_final_message()


def test_keys_from_either_header_and_a_wrong_one_refused_in_anthropics_envelope(front, upstream):
    upstream.reset("ok")
    body = {"model": "relay", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(f"{front.url}/v1/messages", json=body, headers={"authorization": "Bearer sekret"}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=front.url, api_key="wrong", max_retries=0).messages.create(**body)
    assert caught.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{front.url}/v1/messages/count_tokens", json={"model": "relay", "messages": body["messages"]})
    assert r.status_code == 401 and r.json()["type"] == "error"


def events_of(lines) -> list[tuple[str, dict]]:
    """(name, data) per event of a raw stream's lines; comments as ("comment", {})."""
    out, name = [], None
    for line in lines:
        if line.startswith(":"):
            out.append(("comment", {}))
        elif line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name
            out.append((name, data))
    return out


def test_a_model_loading_on_demand_keeps_the_stream_alive_then_answers(front):
    headers = {"x-api-key": "sekret"}
    body = {"model": "lazy", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{front.url}/v1/messages", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        events = events_of(r.iter_lines())
    assert events[0][0] == "comment"  # the model was loading
    names = [n for n, _ in events if n != "comment"]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]


def test_a_worker_killed_mid_stream_ends_it_with_an_error_event(front):
    claude = anthropic.Anthropic(base_url=front.url, api_key="sekret", max_retries=0)
    claude.messages.create(model="lazy", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])  # loaded
    body = {"model": "lazy", "max_tokens": 400, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
    seen = []
    with httpx.stream("POST", f"{front.url}/v1/messages", json=body, headers={"x-api-key": "sekret"},
                      timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            seen.append(line)
            if line.startswith("event: content_block_delta"):
                workers(front.proc.pid)["lazy"].kill()  # SIGKILL, mid-answer
                break
        seen += list(lines)
    events = events_of(seen)
    assert events[-1][0] == "error" and "message_stop" not in [n for n, _ in events]
    assert events[-1][1]["error"]["type"] in ("overloaded_error", "api_error")
    # The next request loads the model again and is answered.
    again = claude.messages.create(model="lazy", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert again.content and again.stop_reason in ("max_tokens", "end_turn")


def claude_code_request(model: str) -> dict:
    """The shape of Claude Code 2.1.197's first request (captured from the real binary against a
    stub; the texts are ours): three system blocks, two with cache marks; a user turn of two text
    blocks; a system entry inside messages; 24 tools; its thinking, effort, context editing and
    metadata; 32,000 output tokens; streamed."""
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
              "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}
    mark = {"type": "ephemeral"}
    return {
        "model": model,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Context.</system-reminder>"},
                                         {"type": "text", "text": "Say hello", "cache_control": mark}]},
            {"role": "system", "content": "A note from the harness."}],
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
                   {"type": "text", "text": "You are a coding agent.", "cache_control": mark},
                   {"type": "text", "text": "Be careful. " * 2000, "cache_control": mark}],
        "tools": [{"name": f"Tool{i}", "description": "Does a thing. " * 40, "input_schema": schema} for i in range(24)],
        "metadata": {"user_id": '{"device_id":"d","account_uuid":"","session_id":"s"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def test_what_claude_code_sends_is_answered(front, upstream):
    upstream.reset("ok")
    headers = {"x-api-key": "sekret", "anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"}
    with httpx.stream("POST", f"{front.url}/v1/messages?beta=true", json=claude_code_request("relay"),
                      headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = events_of(r.iter_lines())
    assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]
    sent = upstream.hits[-1]["body"]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "system"] and len(sent["tools"]) == 24
    assert sent["max_tokens"] == 32000  # a remote model's context is its upstream's to enforce


# --- a thinking model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from test_reasoning_e2e import THINKING_TEMPLATE  # SmolLM2 answering inside an open <think>

    tmp = tmp_path_factory.mktemp("anthropic_thinking")
    template = tmp / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    router = RouterProcess(llamacpp_config("r1", extra=f'chat_template = "{template}"\nreasoning_parser = "deepseek_r1"'),
                           tmp, name="thinker")
    yield router
    router.stop()


def test_a_thinking_models_reasoning_is_a_thinking_block_streamed_or_not(thinker):
    kw = dict(model="r1", max_tokens=24, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Is 7 a prime number? Think first."}])
    chat = openai.OpenAI(base_url=f"{thinker.url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="r1", max_tokens=24, temperature=0, messages=kw["messages"])
    reasoning = (chat.choices[0].message.model_extra or {}).get("reasoning")
    assert reasoning
    claude = anthropic.Anthropic(base_url=thinker.url, api_key="x", max_retries=0)
    got = claude.messages.create(**kw, thinking={"type": "adaptive"}, output_config={"effort": "low"})
    assert got.content[0].type == "thinking" and got.content[0].thinking == reasoning
    with claude.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and final.content[0].thinking == reasoning
    hidden = claude.messages.create(**kw, thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in hidden.content)  # include_reasoning false: not sent
