"""Reasoning parsers over real HTTP with the bundled model and the openai SDK.

SmolLM2 is no thinking model, so a ChatML template that opens ``<think>`` at the start of the
reply stands in for DeepSeek-R1's: the model then writes inside the block. The same model
without a parser, on the same template, shows what it wrote; greedy decoding makes both the
same tokens.
"""

from __future__ import annotations

import openai
import pytest

from server import RouterProcess, llamacpp_config, torch_config

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
ASK = [{"role": "user", "content": "Is 7 a prime number? Think first."}]


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    template = tmp / "think.jinja"
    template.write_text(THINKING_TEMPLATE)
    config = (
        llamacpp_config("r1", extra=f'chat_template = "{template}"\nreasoning_parser = "deepseek_r1"')
        + llamacpp_config("raw", extra=f'chat_template = "{template}"')
        + llamacpp_config("q3", extra='reasoning_parser = "qwen3"')
        + torch_config("r1-torch", extra=f'chat_template = "{template}"\nreasoning_parser = "deepseek_r1"')
        # drafts from the prompt (the few-shot answers repeat), checked against the gate's masks
        + torch_config("r1-spec", extra=f'chat_template = "{template}"\nreasoning_parser = "deepseek_r1"\n'
                       'speculative_config = { method = "ngram", num_speculative_tokens = 4, prompt_lookup_min = 2 }')
    )
    router = RouterProcess(config, tmp)
    yield openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=300)
    router.stop()


def expected_split(text: str) -> tuple[str | None, str | None]:
    """What deepseek_r1 makes of a reply written inside an open block."""
    reasoning, _, content = text.partition("</think>")
    return reasoning.strip() or None, content.lstrip() or None


def stream_parts(stream) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("model", ["r1", "r1-torch"])
def test_a_reply_inside_an_open_block_is_reasoning(sdk, model):
    raw = sdk.chat.completions.create(model="raw", messages=ASK, max_tokens=24, temperature=0)
    written = raw.choices[0].message.content
    assert written.strip()
    got = sdk.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0)
    message = got.choices[0].message
    if model == "r1":  # the same engine and tokens; the torch engine's int4 rounding may part from them
        assert (message.model_extra["reasoning"], message.content) == expected_split(written)
    else:
        assert message.model_extra["reasoning"] and "think>" not in message.model_extra["reasoning"]
    assert got.usage.completion_tokens == 24 or got.choices[0].finish_reason == "stop"
    stream = sdk.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0, stream=True)
    assert stream_parts(stream) == (message.model_extra["reasoning"] or "", message.content or "")


def test_include_reasoning_false(sdk):
    got = sdk.chat.completions.create(model="r1", messages=ASK, max_tokens=8, temperature=0,
                                      extra_body={"include_reasoning": False})
    assert got.choices[0].message.model_extra["reasoning"] is None
    stream = sdk.chat.completions.create(model="r1", messages=ASK, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"include_reasoning": False})
    assert stream_parts(stream)[0] == ""


# Two answered questions teach the model the shape: reasoning, </think>, a one-word answer.
SHOTS = [
    {"role": "user", "content": "Is 4 a prime number?"},
    {"role": "assistant", "content": "<think>\n4 is 2 times 2.\n</think>\nno"},
    {"role": "user", "content": "Is 5 a prime number?"},
    {"role": "assistant", "content": "<think>\n5 has no divisors but 1 and 5.\n</think>\nyes"},
    {"role": "user", "content": "Is 9 a prime number?"},
]


@pytest.mark.parametrize("model", ["r1", "r1-torch", "r1-spec"])
def test_a_constrained_reply_thinks_first(sdk, model):
    written = sdk.chat.completions.create(model="raw", messages=SHOTS, max_tokens=24, temperature=0).choices[0].message.content
    reasoning, answer = expected_split(written)  # seen: "9 is 3 times 3.", "no"
    assert reasoning and answer == "no"
    # The reasoning is no choice's text: the grammar began after </think>, and made its answer.
    choice = {"structured_outputs": {"choice": ["maybe", "never"]}}
    got = sdk.chat.completions.create(model=model, messages=SHOTS, max_tokens=24, temperature=0, extra_body=choice)
    message = got.choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (reasoning, "never")
    assert got.choices[0].finish_reason == "stop"
    # usage: the reasoning's tokens (with </think>'s), then the answer's one or two and EOS
    assert 5 <= got.usage.completion_tokens_details.reasoning_tokens <= got.usage.completion_tokens - 2
    stream = sdk.chat.completions.create(model=model, messages=SHOTS, max_tokens=24, temperature=0, stream=True,
                                         extra_body=choice)
    assert stream_parts(stream) == (reasoning, "never")


def test_a_constrained_reply_cut_off_while_thinking_has_no_content(sdk):
    raw = sdk.chat.completions.create(model="raw", messages=ASK, max_tokens=8, temperature=0)
    got = sdk.chat.completions.create(model="r1", messages=ASK, max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert got.choices[0].finish_reason == "length"
    # No token of the reasoning was masked: it is what the same greedy request writes unconstrained.
    assert (got.choices[0].message.model_extra["reasoning"], got.choices[0].message.content) == \
        (expected_split(raw.choices[0].message.content)[0], None)


def test_qwen3_without_a_block_is_all_content(sdk):
    got = sdk.chat.completions.create(model="q3", messages=ASK, max_tokens=16, temperature=0)
    message = got.choices[0].message
    assert message.content and message.model_extra["reasoning"] is None
