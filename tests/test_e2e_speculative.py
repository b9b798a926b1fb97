"""End to end: a torch model with n-gram speculative decoding, and one with a draft model,
against the same model without, over HTTP with the openai SDK. Same answers, usage that adds
up, the spec_decode metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server import GGUF, RouterProcess, torch_config
from sse_util import sdk_stream
from test_torch_speculative import TEXT

SPEC = 'speculative_config = { method = "ngram", num_speculative_tokens = 4, prompt_lookup_min = 2, prompt_lookup_max = 4 }'
COPY = [{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}]
# The same SmolLM2 as its own draft (packed int4 as the model is).
DRAFT = f'speculative_config = {{ model = "{GGUF}", num_speculative_tokens = 3 }}'


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    config = torch_config("plain", 512) + torch_config("spec", 512, SPEC) + torch_config("draft", 512, DRAFT)
    proc = RouterProcess(config, tmp_path_factory.mktemp("spec-e2e"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)


def chat(client, model, **fields):
    fields = {"messages": COPY, "temperature": 0, "max_tokens": 48, **fields}
    return client.chat.completions.create(model=model, **fields)


def spec_metrics(router) -> dict[str, float]:
    text = httpx.get(f"{router.url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("router:spec_decode_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_same_answer_and_usage_with_drafts(router, client):
    before = spec_metrics(router)
    plain = chat(client, "plain", extra_body={"return_token_ids": True})
    spec = chat(client, "spec", extra_body={"return_token_ids": True})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert "quick brown fox" in spec.choices[0].message.content
    assert spec.choices[0].token_ids == plain.choices[0].token_ids
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == len(spec.choices[0].token_ids)
    after = spec_metrics(router)
    accepted = 'router:spec_decode_num_accepted_tokens_total{model="spec",backend="torch"}'
    drafted = 'router:spec_decode_num_draft_tokens_total{model="spec",backend="torch"}'
    assert after[accepted] - before.get(accepted, 0) >= 10
    assert after[drafted] >= after[accepted]
    assert not any('model="plain"' in name for name in after)  # no drafts, no series


def test_a_stream_carries_every_token_once(router, client):
    whole = chat(client, "plain", logprobs=True)
    stream = chat(client, "spec", logprobs=True, stream=True, stream_options={"include_usage": True})
    text, entries, usage, chunks = "", [], None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            chunks += 1
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                entries += choice.logprobs.content
    assert text == whole.choices[0].message.content
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert usage.completion_tokens == whole.usage.completion_tokens == len(entries)
    assert chunks < len(entries)  # some chunks carried several tokens: drafts were kept


def test_a_stop_string_inside_a_step_cuts_the_tokens_after_it(router, client):
    # In the copy, ". A journey of a" comes in one step (drafted): " of a" must not count.
    fields = {"stop": ["journey"], "logprobs": True, "extra_body": {"return_token_ids": True}}
    plain = chat(client, "plain", **fields)
    spec = chat(client, "spec", **fields)
    choice = spec.choices[0]
    assert choice.finish_reason == "stop" and "journey" not in choice.message.content
    assert choice.message.content == plain.choices[0].message.content
    assert choice.token_ids == plain.choices[0].token_ids
    assert spec.usage.completion_tokens == len(choice.token_ids) == len(choice.logprobs.content)
    for stream_options in ({"include_usage": True},):
        chunks = list(chat(client, "spec", stop=["journey"], stream=True, stream_options=stream_options))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].usage.completion_tokens == spec.usage.completion_tokens


def test_structured_outputs_and_tool_calls_with_drafts(router, client):
    """Under a JSON schema (response_format) and a forced tool call, the drafted model answers
    as the plain one, in fewer steps: the grammar's keys and quotes are drafted."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"], "additionalProperties": False}
    messages = [{"role": "user", "content": "As JSON: Alice Smith lives in Paris."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}
    before = spec_metrics(router)
    plain = chat(client, "plain", messages=messages, response_format=fmt)
    spec = chat(client, "spec", messages=messages, response_format=fmt, stream=True,
                stream_options={"include_usage": True})
    text, usage, chunks = sdk_stream(spec)
    assert text == plain.choices[0].message.content
    assert set(json.loads(text)) == {"name", "city"}
    assert usage.completion_tokens == plain.usage.completion_tokens and chunks < usage.completion_tokens
    accepted = 'router:spec_decode_num_accepted_tokens_total{model="spec",backend="torch"}'
    assert spec_metrics(router)[accepted] - before.get(accepted, 0) >= 4

    tool = {"type": "function", "function": {"name": "locate", "parameters": schema}}
    calls = [
        chat(client, model, messages=messages, tools=[tool], tool_choice="required").choices[0].message.tool_calls
        for model in ("plain", "spec")
    ]
    assert [(c.function.name, c.function.arguments) for c in calls[0]] == [
        (c.function.name, c.function.arguments) for c in calls[1]
    ]


def test_bad_words_hold_inside_drafts(router, client):
    # After "The quick brown" the prompt lookup drafts " fox jumps over the": " jumps" is the
    # draft's second token, checked by a row the ban must cover too.
    before = spec_metrics(router)
    plain = chat(client, "plain", extra_body={"return_token_ids": True, "bad_words": ["jumps"]})
    spec = chat(client, "spec", extra_body={"return_token_ids": True, "bad_words": ["jumps"]})
    assert spec.choices[0].token_ids == plain.choices[0].token_ids
    text = spec.choices[0].message.content
    assert "quick brown fox" in text and "jumps" not in text
    accepted = 'router:spec_decode_num_accepted_tokens_total{model="spec",backend="torch"}'
    assert spec_metrics(router)[accepted] - before.get(accepted, 0) >= 5


def test_a_draft_model_gives_the_answers_without_it(router, client):
    """A question, not a copy: the draft model guesses where no n-gram could (SmolLM2 guessing
    for itself, most guesses hold), greedy and seeded, stream and not."""
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    accepted = 'router:spec_decode_num_accepted_tokens_total{model="draft",backend="torch"}'
    before = spec_metrics(router).get(accepted, 0)
    for fields in ({}, {"temperature": 0.8, "seed": 5}):
        body = {"messages": messages, "max_tokens": 32, "extra_body": {"return_token_ids": True}, **fields}
        plain, draft = chat(client, "plain", **body), chat(client, "draft", **body)
        assert draft.choices[0].token_ids == plain.choices[0].token_ids
        assert draft.usage.completion_tokens == plain.usage.completion_tokens
        text, usage, chunks = sdk_stream(chat(client, "draft", **body, stream=True, stream_options={"include_usage": True}))
        assert text == plain.choices[0].message.content and usage.completion_tokens == plain.usage.completion_tokens
    assert spec_metrics(router)[accepted] - before >= 20
