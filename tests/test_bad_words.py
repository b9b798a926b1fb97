"""bad_words (router/bad_words.py): which token sequences a word forbids, and which token each
forbids next."""

from __future__ import annotations

import pytest

from fakes import ByteTokenizer
from router.bad_words import bad_words_ids, banned_tokens

tok = ByteTokenizer()


def ids(text):
    return tuple(tok.encode(text, add_special_tokens=False))


class Words:
    """A BPE-like vocabulary: a word and its spaced form are one token each."""

    VOCAB = {"world": [10], " world": [11], "xy": [1, 2], " xy": [3, 1, 2], "new york": [20, 21],
             " new york": [22, 21], "jumps": [30, 31], " jumps": [32], "same": [40], " same": [40]}

    def encode(self, text, *, add_special_tokens, parse_special=True):
        return list(self.VOCAB.get(text, []))


def test_a_word_is_forbidden_as_a_text_starts_it_and_mid_text():
    words = Words()
    assert bad_words_ids(words, ["world"]) == ((10,), (11,))
    assert bad_words_ids(words, ["new york"]) == ((20, 21), (22, 21))
    # mid-text in fewer tokens (vLLM would drop this form); a space of its own is harmless;
    # a tokenizer that spells both alike gives one sequence
    assert bad_words_ids(words, ["jumps"]) == ((30, 31), (32,))
    assert bad_words_ids(words, ["xy"]) == ((1, 2), (3, 1, 2))
    assert bad_words_ids(words, ["same"]) == ((40,),)
    # the client's leading space is not part of the word; empty words forbid nothing; once each
    assert bad_words_ids(words, ["  world", "", " ", "world"]) == ((10,), (11,))


@pytest.mark.parametrize("output, banned", [
    ([], {ord("z")}),  # a one-token word: always
    (list(ids("ab")), {ord("z"), ord("c")}),  # "ab" then "c" would complete "abc"
    (list(ids("xab")), {ord("z"), ord("c")}),
    (list(ids("a")), {ord("z")}),  # not yet: "abc" needs "ab" first
    (list(ids("abx")), {ord("z")}),
    (list(ids("x ab")), {ord("z"), ord("c")}),  # " abc" mid-text, "abc" too
])
def test_the_token_that_would_complete_a_sequence_is_banned(output, banned):
    sequences = bad_words_ids(tok, ["z", "abc"])
    assert sequences == ((ord("z"),), ids(" z"), ids("abc"), ids(" abc"))
    assert banned_tokens(sequences, output) == banned
