"""Incremental detokenizing: token ids arrive one step at a time, text leaves as whole characters.

Decoding each token alone is wrong: a token may hold part of a UTF-8 character, and some
tokenizers (SentencePiece) spell a leading space differently at the start of a text. So we
decode a short window of recent ids twice, without and with the new ones, and release the
difference, unless it ends in U+FFFD (an unfinished character, held back until the next token).
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

from .engine import Tokenizer

# How many already-released ids stay in the window as context for the next decode.
_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing sequence of generated ids into text deltas for one sequence."""

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "_prefix_text")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        # Control tokens spelled out when asked (harmony's and Mistral's markers are control tokens).
        self._decode = tokenizer.decode if skip_special_tokens else partial(tokenizer.decode, skip_special_tokens=False)
        # The prompt's tail gives the first generated token its correct spelling.
        self._ids: list[int] = list(prompt_ids[-(_CONTEXT + 1) :])
        self._read = len(self._ids)
        self._prefix = max(self._read - _CONTEXT, 0)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that is now complete (may be "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: what was just released becomes the context.
        read = len(self._ids)
        start = max(read - _CONTEXT, 0)
        self._prefix_text = (
            new_text if start == self._prefix else self._decode(self._ids[start:read])
        )
        del self._ids[:start]
        self._prefix = 0
        self._read = len(self._ids)
        return delta
