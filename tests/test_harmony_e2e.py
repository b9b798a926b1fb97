"""Control tokens over real HTTP with the openai SDK: gpt-oss's harmony format on the torch
engine, and ``skip_special_tokens`` on both local engines with the bundled SmolLM2.

No real gpt-oss fits here, so a tiny random one stands in, its tokenizer SmolLM2's with seven of
its code-data control tokens renamed to harmony's markers, under a harmony template of our own.
Its text means nothing, but a forced tool call (a grammar whose markers are the control tokens)
must still come back as a well-formed call, and a reply with no markers as it was written.
"""

from __future__ import annotations

import json

import openai
import pytest

from router.harmony import HarmonyParser
from server import RouterProcess, llamacpp_config, torch_config
from torch_models import tiny_checkpoint

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
FIRST = 3  # SmolLM2's <repo_name>, the first of the ids renamed
TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def harmony_checkpoint(folder):
    """The tiny random gpt-oss, its tokenizer speaking harmony (``<|return|>`` and ``<|call|>`` end it)."""
    tiny_checkpoint(folder, "gpt_oss")
    renamed = {FIRST + i: token for i, token in enumerate(HARMONY_TOKENS)}
    spec = json.loads((folder / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        if added["id"] in renamed:
            old, added["content"] = added["content"], renamed[added["id"]]
            spec["model"]["vocab"][added["content"]] = spec["model"]["vocab"].pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, added in config.get("added_tokens_decoder", {}).items():
        if int(key) in renamed:
            added["content"] = renamed[int(key)]
    config.update(eos_token="<|return|>", pad_token="<|return|>", bos_token=None)
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    ends = [FIRST + HARMONY_TOKENS.index("<|return|>"), FIRST + HARMONY_TOKENS.index("<|call|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return folder


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harmony")
    folder = harmony_checkpoint(tmp / "oss")
    oss = f'[[models]]\nbackend = "torch"\npath = "{folder}"\nmax_model_len = 512\nkv_cache_gb = 0.05\n'
    config = (
        oss.replace("[[models]]", '[[models]]\nname = "oss"') + 'reasoning_parser = "openai_gptoss"\ntool_parser = "openai"\n'
        + oss.replace("[[models]]", '[[models]]\nname = "oss-raw"')
        + llamacpp_config("smol") + torch_config("smol-torch")
    )
    router = RouterProcess(config, tmp)
    yield openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=300)
    router.stop()


def streamed(stream):
    """(content, reasoning, [(name, arguments)], finish_reason) from a chat stream."""
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [tuple(c) for c in calls.values()], finish


# The forced call's grammar lets the model write an analysis message first (router/harmony.py).
# Left to itself this random one takes it and never ends it; a bias steers it either way.
COMMENT, ANALYSIS, END = 3591, 14975, FIRST + HARMONY_TOKENS.index("<|end|>")  # "comment", "analysis"
NO_ANALYSIS = {"logit_bias": {str(COMMENT): 100}}  # the channel it picks is commentary


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_comes_back_as_a_tool_call(sdk, choice):
    got = sdk.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                      max_tokens=64, temperature=0, extra_body=NO_ANALYSIS)
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls"
    assert message.content is None and message.model_extra["reasoning"] is None
    [call] = message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    if choice != "required":
        assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments == {} if call.function.name == "get_time" else set(arguments) == {"city"}
    # ... ended by <|call|>, an end token: no text after the call
    stream = sdk.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                         max_tokens=64, temperature=0, stream=True, extra_body=NO_ANALYSIS)
    assert streamed(stream) == ("", "", [(call.function.name, call.function.arguments)], "tool_calls")


def test_a_forced_call_may_come_after_the_models_reasoning(sdk):
    # The model takes the analysis channel (its token biased 50), ends its message after a token
    # (<|end|>, biased 100 so that it beats "analysis" there, cannot come before one), and then
    # must call: the reply is that reasoning and the call.
    body = {"logit_bias": {str(ANALYSIS): 50, str(END): 100}}
    got = sdk.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], tool_choice="required",
                                      max_tokens=64, temperature=0, extra_body=body)
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls"
    reasoning = message.model_extra["reasoning"]
    assert reasoning and "<|" not in reasoning and message.content is None
    # The analysis message's tokens (seen: 4 of 5, its <|channel|> not yet known to open it) count
    # as reasoning; the call's do not.
    assert 3 <= got.usage.completion_tokens_details.reasoning_tokens < got.usage.completion_tokens - 5
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    raw = sdk.chat.completions.create(model="oss-raw", messages=ASK, max_tokens=64, temperature=0,
                                      extra_body={**body, "skip_special_tokens": False, "structured_outputs": {
                                          "grammar": HarmonyParser.grammar([WEATHER], None, False)}})
    assert raw.choices[0].message.content == (
        f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{call.function.arguments}")
    stream = sdk.chat.completions.create(model="oss", messages=ASK, tools=[WEATHER], tool_choice="required",
                                         max_tokens=64, temperature=0, stream=True, extra_body=body)
    assert streamed(stream) == ("", reasoning, [("get_weather", call.function.arguments)], "tool_calls")


def test_the_raw_reply_shows_what_the_call_was_made_of(sdk):
    raw = sdk.completions.create(model="oss-raw", prompt="<|start|>user<|message|>hi<|end|><|start|>assistant",
                                 max_tokens=4, temperature=0, extra_body={"skip_special_tokens": False})
    assert raw.choices[0].text is not None  # the same model without parsers takes the option
    forced = sdk.chat.completions.create(model="oss-raw", messages=ASK, max_tokens=64, temperature=0,
                                         extra_body={"skip_special_tokens": False, "structured_outputs": {
                                             "grammar": 'start: <|channel|> "final" <|message|> "ok" <|return|>'}})
    # The grammar's markers are control tokens, spelled out when asked for; <|return|> ends the
    # reply without being shown, as an end token always does.
    assert forced.choices[0].message.content == "<|channel|>final<|message|>ok"


def test_a_reply_without_markers_is_content_as_written(sdk):
    raw = sdk.chat.completions.create(model="oss-raw", messages=ASK, max_tokens=12, temperature=0,
                                      extra_body={"skip_special_tokens": False})
    written = raw.choices[0].message.content
    got = sdk.chat.completions.create(model="oss", messages=ASK, max_tokens=12, temperature=0)
    # A random model writes words, no markers (seen: " cavern cavern ..."); greedy, so both
    # models wrote the same tokens.
    assert written and "<|" not in written
    assert got.choices[0].message.content == written
    assert got.choices[0].message.model_extra["reasoning"] is None
    # Under a grammar the model reasons freely first: a random one never writes the final
    # message's header, so nothing is masked, and it writes the same words.
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}
    got = sdk.chat.completions.create(model="oss", messages=ASK, max_tokens=12, temperature=0,
                                      response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (written, "length")


@pytest.mark.parametrize("model", ["smol", "smol-torch"])
def test_skip_special_tokens_false_spells_control_tokens_out(sdk, model):
    # <|im_end|> (id 2) is SmolLM2's end token: ignore_eos keeps it from ending the reply, and a
    # bias makes the model write it three times.
    body = {"ignore_eos": True, "logit_bias": {"2": 100}}
    got = sdk.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, extra_body=body)
    assert got.choices[0].text == "" and got.usage.completion_tokens == 3
    got = sdk.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                 extra_body={**body, "skip_special_tokens": False})
    assert got.choices[0].text == "<|im_end|>" * 3
    stream = sdk.chat.completions.create(model=model, messages=ASK, max_tokens=3, temperature=0, stream=True,
                                         extra_body={**body, "skip_special_tokens": False})
    assert streamed(stream)[0] == "<|im_end|>" * 3
