"""Incremental detokenizing: whole characters only, and the deltas add up to the full text."""

import pytest

from fakes import ByteTokenizer
from router.detokenizer import IncrementalDetokenizer

tok = ByteTokenizer()


def stream(ids, prompt=(), step=1):
    d = IncrementalDetokenizer(tok, list(prompt))
    deltas = []
    for i in range(0, len(ids), step):
        deltas.append(d.push(ids[i : i + step]))
    return deltas


@pytest.mark.parametrize(
    "text",
    ["hello world", "héllo", "日本語のテキスト", "emoji 🎉🎉 and more", "a\nb\n", "🎉", "x" * 50, "ab" * 20],
)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_concatenate_to_text(text, step):
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(stream(ids, step=step)) == text


def test_split_utf8_character_is_held_until_complete():
    ids = list("🎉".encode())  # four byte tokens
    deltas = stream(ids)
    assert deltas == ["", "", "", "🎉"]


def test_no_delta_ever_contains_a_replacement_character():
    ids = tok.encode("日本 🎉 é", add_special_tokens=False)
    for delta in stream(ids):
        assert "\ufffd" not in delta


def test_control_tokens_are_not_emitted():
    ids = tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(ids)) == "hi"


def test_prompt_context_does_not_leak_into_output():
    prompt = tok.encode("<|im_start|>user\nhello<|im_end|>", add_special_tokens=False)
    ids = tok.encode(" world", add_special_tokens=False)
    assert "".join(stream(ids, prompt=prompt)) == " world"


def test_prompt_ending_in_half_a_character():
    # A prompt cut mid-character must not corrupt or swallow the first generated text.
    prompt = list("é".encode())[:1]
    ids = tok.encode("ok", add_special_tokens=False)
    assert "".join(stream(ids, prompt=prompt)) == "ok"


def test_long_output_keeps_window_small():
    d = IncrementalDetokenizer(tok, [])
    for t in tok.encode("abc" * 1000, add_special_tokens=False):
        d.push([t])
    assert len(d._ids) <= 8


def test_empty_push():
    d = IncrementalDetokenizer(tok, [])
    assert d.push([]) == ""
