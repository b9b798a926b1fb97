"""Thinking before a grammar: a constraint that holds off while a thinking model reasons.

vLLM applies structured outputs (and the grammar of a forced tool call) once the reasoning has
ended, so a thinking model still thinks and only its answer is constrained. :class:`AfterReasoning`
does that around a :class:`router.constraints.TokenConstraint`: while the model reasons it masks
nothing (``allowed()`` is None: any token), and the grammar sees none of those tokens; from the
token that completes the reasoning's end marker on, it is the grammar.

The end marker is matched on the generated tokens' bytes, however the model spelled it (``</think>``
is one token in Qwen3's vocabulary, several in others). Bytes that follow the marker inside its own
token are not seen by the grammar (a newline, typically). Where the reply reasons only in a block
it opens itself (Qwen3 without a block in the prompt), the first token decides: the grammar's mask
plus the token that opens the block (``<think>``, when it is one token); that token starts the
reasoning, any other is the grammar's first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np

# Where the reply is.
_START, _REASONING, _ANSWER = range(3)


class AfterReasoning:
    """A sequence's constraint that begins once its reasoning has ended (module docstring).

    ``inner``: the grammar's constraint. ``token_bytes``: the tokenizer's. ``end``: the bytes that
    end the reasoning. ``opener``: the token id that opens a reasoning block the reply must open
    itself, or None when the reply reasons from its first token.
    """

    __slots__ = ("_inner", "_bytes", "_end", "_opener", "_state", "_tail")

    def __init__(self, inner: Any, token_bytes: Callable[[int], bytes], end: bytes, opener: int | None) -> None:
        self._inner = inner
        self._bytes = token_bytes
        self._end = end
        self._opener = opener
        self._state = _START if opener is not None else _REASONING
        self._tail = b""  # the last bytes generated while reasoning, for a marker split over tokens

    @property
    def reasoning(self) -> bool:
        """The grammar has not begun (the model reasons, or may still open a block)."""
        return self._state != _ANSWER

    def allowed(self) -> "np.ndarray | None":
        """The grammar's mask, None while the model reasons (any token may come)."""
        if self._state == _REASONING:
            return None
        mask = self._inner.allowed()
        if self._state == _START:
            mask = mask.copy()
            mask[self._opener] = True
        return mask

    def advance(self, token: int) -> None:
        if self._state == _START:
            if token == self._opener:
                self._state = _REASONING
                return
            self._state = _ANSWER
        if self._state == _REASONING:
            self._tail, ends = self._reads(self._tail, token)
            if ends:
                self._state = _ANSWER
            return
        self._inner.advance(token)

    def _reads(self, tail: bytes, token: int) -> tuple[bytes, bool]:
        """The reasoning's last bytes after ``token``, and whether it completes the end marker."""
        window = tail + self._bytes(token)
        return window[-(len(self._end) - 1) :] if len(self._end) > 1 else b"", self._end in window

    def _answer_from(self, tokens: list[int]) -> int | None:
        """Where the grammar would begin in ``tokens`` (the index after the one ending the
        reasoning), from the current state; None if it would not begin within them."""
        tail, i = self._tail, 0
        if self._state == _START:
            if not tokens or tokens[0] != self._opener:
                return 0
            i = 1
        for j in range(i, len(tokens)):
            tail, ends = self._reads(tail, tokens[j])
            if ends:
                return j + 1
        return None

    # Speculative decoding: a draft is checked and masked without being consumed.

    def accepts(self, tokens: list[int]) -> int:
        if self._state == _ANSWER:
            return self._inner.accepts(tokens)
        at = self._answer_from(tokens)
        return len(tokens) if at is None else at + self._inner.accepts(tokens[at:])

    def forced(self) -> list[int]:
        return self._inner.forced() if self._state == _ANSWER else []

    def allowed_along(self, draft: list[int]) -> list["np.ndarray | None"]:
        if self._state == _ANSWER:
            return self._inner.allowed_along(draft)
        at = self._answer_from(draft)
        if at is None:
            masks: list[Any] = [None] * (len(draft) + 1)
        else:
            masks = [None] * at + self._inner.allowed_along(draft[at:])
        if self._state == _START:
            masks[0] = self.allowed()
        return masks

    @property
    def done(self) -> bool:
        return self._state == _ANSWER and self._inner.done

    @property
    def error(self) -> str:
        return self._inner.error
