"""Speculative decoding by n-gram lookup (vLLM's ``"method": "ngram"``, prompt lookup decoding).

When a sequence's last few tokens already occurred earlier in it (prompt or output), the tokens
that followed them then are a guess at what follows now. A decoding sequence with such a guess
(a *draft* of up to ``num_speculative_tokens``) computes its last token and the draft in one
step, as a short chunk of new rows; every row samples, row ``i`` from the model's distribution
given the draft's first ``i`` tokens. The tokens sampled are kept up to and including the first
that differs from the draft, so a step yields between one token (the draft's first token was
wrong) and ``len(draft) + 1`` (all right, plus the one after).

This needs no draft model and changes no output (up to floating-point rounding: drafted rows
are computed as a chunk): each kept token was sampled from the distribution of the prefix it
follows, which is the prefix the sequence really has (rejection sampling with a one-hot draft
accepts with the same probability and resamples from the same residual). A seeded sequence's
generator is rewound to one draw per kept token (:func:`rewind`), so its output stays that of
its seed whatever was drafted. Drafted rows cost compute: on a 2-core CPU the one C call of an
int4 SmolLM2 step takes ~6.6 ms for one row and ~10.5 ms for four (``bench/decode_step.py``),
so a draft pays when most of it is right, as when the output quotes or edits its input, and
at small batches (docs/benchmarks.md).

Under a grammar (structured outputs, tools) the draft is the tokens the grammar forces, when it
forces any (a JSON schema's next key with its quotes), else an n-gram draft looked up in the
prompt only, cut where the grammar would refuse it; each row samples under the grammar's mask
after the draft tokens before it (``TokenConstraint.allowed_along``), and the grammar advances
only through the kept tokens.

A request may bring a prediction (OpenAI's Predicted Outputs): text its answer is expected to
mostly repeat. It is drafted from before the lookup (:meth:`NgramProposer.predict`), and also
on an engine without ``speculative_config``, whose proposer then drafts from predictions only
(``lookup`` off, :data:`PREDICTION_ONLY`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from .sequence import Sequence


@dataclass(frozen=True, slots=True)
class NgramOptions:
    """How to draft: up to ``num_tokens`` tokens after the longest n-gram (``min_n`` to
    ``max_n`` tokens) ending the sequence that occurred earlier in it; no drafts at all while
    ``disable_by_batch_size`` or more sequences run (large batches have little compute to spare)."""

    num_tokens: int
    min_n: int
    max_n: int
    disable_by_batch_size: int | None = None


PREDICTION_ONLY = NgramOptions(num_tokens=4, min_n=1, max_n=3)
"""An engine without ``speculative_config``: drafts only from a request's prediction, 4 at most."""

PREDICTION_N = 3
"""A prediction is followed by its longest n-gram (up to this) ending the sequence: see
:meth:`NgramProposer.predict`."""


class NgramProposer:
    """Drafts tokens for a sequence from its own earlier tokens (:class:`NgramOptions`; only
    with ``lookup``) and from the request's prediction (:meth:`predict`)."""

    def __init__(self, options: NgramOptions, lookup: bool = True) -> None:
        if not 1 <= options.min_n <= options.max_n:
            raise ValueError(f"n-gram sizes {options.min_n}..{options.max_n}: need 1 <= min <= max")
        if options.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.options = options
        self.lookup = lookup  # False: no speculative_config, only requests' predictions are drafted
        self.drafts = 0  # drafts proposed (steps that verified one)
        self.draft_tokens = 0  # tokens in them
        self.accepted_tokens = 0  # of those, how many the model agreed with
        self.adaptive = True  # size each sequence's drafts by its record (False: always num_tokens)

    def active(self, running: int) -> bool:
        """Whether to draft at all in a step with ``running`` sequences."""
        limit = self.options.disable_by_batch_size
        return limit is None or running < limit

    def propose(self, tokens: list[int] | np.ndarray, limit: int, before: int | None = None) -> list[int]:
        """Up to ``min(num_tokens, limit)`` tokens that followed the most recent earlier
        occurrence of the longest n-gram ending ``tokens``; [] when none occurred. With
        ``before``, only occurrences that end before that position count (the prompt's)."""
        k = min(self.options.num_tokens, limit)
        n_min, n_max = self.options.min_n, self.options.max_n
        if k < 1 or len(tokens) <= n_min:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # Candidates: where the last token occurred before (cheap), then the longest n among them.
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # i: tokens[i] == tokens[-1], i < len - 1
        if before is not None:
            ends = ends[ends < before]
        if ends.size == 0:
            return []
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            starts = ends[ends >= n - 1] - (n - 1)  # windows tokens[s : s + n] ending at a candidate
            if starts.size == 0:
                continue
            if n > 1:
                windows = sliding_window_view(arr[:-1], n)[starts]
                starts = starts[(windows == arr[-n:]).all(axis=1)]
            if starts.size:
                follow = int(starts[-1]) + n  # the most recent occurrence: recent text repeats
                return arr[follow : follow + k].tolist()
        return []

    def predict(self, seq: Sequence, limit: int) -> list[int]:
        """Up to ``min(num_tokens, limit)`` tokens of the request's prediction (OpenAI's
        Predicted Outputs: text the answer is expected to mostly repeat), after where the
        sequence's last tokens occur in it. The longest n-gram ending the sequence (up to
        :data:`PREDICTION_N` tokens) is looked for from where the last prediction draft was
        taken on (``seq.prediction_at``), so the sequence walks the prediction in order; an
        n-gram of two or more tokens may also lead back before that point (the answer repeats
        part of the prediction), a single token only forward (it matches too easily)."""
        k = min(self.options.num_tokens, limit)
        pred = seq.prediction
        if k < 1 or pred is None or not len(pred):
            return []
        tokens = token_array(seq)
        ends = np.flatnonzero(pred == tokens[-1]) + 1  # e: pred[e - 1] is the sequence's last token
        if ends.size == 0:
            return []
        at = seq.prediction_at
        for n in range(min(PREDICTION_N, len(tokens)), 0, -1):
            starts = ends[ends >= n] - n
            if n > 1 and starts.size:
                windows = sliding_window_view(pred, n)[starts]
                starts = starts[(windows == tokens[-n:]).all(axis=1)]
            found = starts + n
            ahead = found[found >= at]
            if ahead.size:
                end = int(ahead[0])
            elif n > 1 and found.size:
                end = int(found[-1])
            else:
                continue
            seq.prediction_at = end
            return pred[end : end + k].tolist()
        return []

    def size_for(self, seq: Sequence) -> int:
        """How many tokens to draft for ``seq`` at most: ``num_tokens``, or with ``adaptive``
        what its drafts so far earned (:meth:`record`)."""
        size = seq.draft_size if self.adaptive else None
        return self.options.num_tokens if size is None else size

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verified draft, and size ``seq``'s next one: two tokens longer after a draft
        kept whole, one shorter after a miss (at least one; transformers' heuristic for
        assisted generation). A drafted row costs about what a decoded one does, so a sequence
        whose drafts keep missing drafts little, and one that copies drafts at full length."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        size = self.size_for(seq)
        seq.draft_size = min(self.options.num_tokens, size + 2) if accepted == drafted else max(1, size - 1)


def token_array(seq: Sequence) -> np.ndarray:
    """``seq.tokens`` as an int64 array, kept on the sequence and extended by the tokens added
    since (tokens are only ever appended), so a step's drafts cost no copy of every context."""
    buf, n = seq.token_buffer, len(seq.tokens)
    if buf is None or len(buf) < n:
        grown = np.empty(max(64, 2 * n), dtype=np.int64)
        have = seq.token_count if buf is not None else 0
        if have:
            grown[:have] = buf[:have]
        buf = seq.token_buffer = grown
    if seq.token_count < n:
        buf[seq.token_count : n] = seq.tokens[seq.token_count :]
        seq.token_count = n
    return buf[:n]


def accepted_count(sampled: list[int], draft: list[int]) -> int:
    """How many of the tokens sampled over a draft's rows are kept: up to and including the first
    that differs from the draft (all of them when none differs)."""
    for i, token in enumerate(draft):
        if sampled[i] != token:
            return i + 1
    return len(sampled)


def rewind(generator: torch.Generator, state: torch.Tensor, draws: int) -> None:
    """Put a sequence's generator where ``draws`` draws from ``state`` leave it: the sampler drew
    one uniform per drafted row, and only the kept rows' draws count (see
    :class:`.sampler.RowSampling`)."""
    generator.set_state(state)
    for _ in range(draws):
        torch.rand(1, generator=generator, device=generator.device)
