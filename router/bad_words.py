"""``bad_words`` (vLLM's sampling parameter): words the reply may not contain, as tokenized.

Each word becomes one or two token sequences: the word as it starts a text, and with a leading
space, as in the middle of a text, where the tokenizer spells that otherwise. (vLLM keeps the
spaced form only when it has as many tokens as the other, so where ``jumps`` is two tokens and
`` jumps`` one, it lets the word through mid-text; here it is banned.) Before each token,
every sequence whose beginning (all of it but its last token) ends the output so far has its last
token banned, so the sequence is never completed; a one-token sequence is banned always. As in
vLLM, this bans the word as the tokenizer spells it: the model may still spell it with other
tokens.
"""

from __future__ import annotations

from typing import Sequence

from .engine import Tokenizer


def bad_words_ids(tok: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ``words`` forbid, each word's text-start and mid-text forms
    (the module docstring says where this parts from vLLM)."""
    out: list[tuple[int, ...]] = []
    for word in (w.lstrip() for w in words):
        plain = tuple(tok.encode(word, add_special_tokens=False, parse_special=False))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(tok.encode(" " + word, add_special_tokens=False, parse_special=False))
        if spaced != plain:
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def banned_tokens(sequences: Sequence[tuple[int, ...]], output: Sequence[int]) -> frozenset[int]:
    """The tokens that would complete one of ``sequences`` after ``output``."""
    banned = set()
    for ids in sequences:
        head = len(ids) - 1
        if head == 0 or (len(output) >= head and tuple(output[len(output) - head :]) == ids[:-1]):
            banned.add(ids[-1])
    return frozenset(banned)
