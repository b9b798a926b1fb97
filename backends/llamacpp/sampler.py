"""Picking the next token from one row of logits, on the CPU with numpy.

Order (as vLLM's sampler): logit_bias and min_tokens masking, then repetition / frequency /
presence penalties, then greedy argmax, or temperature, min_p, top_k, top_p and a draw from the
request's own random generator (so a seed reproduces the output whatever else runs).
Logprobs are those of the raw model distribution, before any of this.
"""

from __future__ import annotations

import numpy as np

from router.engine import SamplingParams, TokenLogprobs

# Candidates looked at first for top_p; most nucleus sets are far smaller than this.
_NUCLEUS_PROBE = 512


class Sampler:
    """Per-sequence sampling state: settings, random generator, token counts for penalties."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_ids: list[int],
        *,
        min_tokens: int = 0,
        suppress_until_min: frozenset[int] = frozenset(),
    ) -> None:
        self.p = params
        self.vocab_size = vocab_size
        # Any 64-bit seed, negative ones too (numpy takes only non-negative).
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.generated = 0
        self.min_tokens = min_tokens
        self._suppress = np.fromiter(suppress_until_min, dtype=np.int64) if suppress_until_min else None
        self._bias_ids = self._bias_vals = None
        if params.logit_bias:
            self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            self._bias_vals = np.fromiter(params.logit_bias.values(), dtype=np.float32)
        self._counts = (
            np.zeros(vocab_size, dtype=np.float32)
            if params.frequency_penalty or params.presence_penalty
            else None
        )
        self._seen = None
        if params.repetition_penalty != 1.0:
            self._seen = np.zeros(vocab_size, dtype=bool)
            if prompt_ids:
                self._seen[np.asarray(prompt_ids, dtype=np.int64)] = True

    def sample(
        self, logits: np.ndarray, allowed: np.ndarray | None = None, banned: frozenset[int] = frozenset()
    ) -> tuple[int, TokenLogprobs | None]:
        """Choose the next token from ``logits`` (shape [vocab]); record it for penalties.
        ``allowed`` (bool [vocab]) restricts the choice, e.g. to what a grammar accepts;
        ``banned`` ids are never chosen (``bad_words``), as suppressed ones are."""
        raw = logits[: self.vocab_size]
        x = raw.astype(np.float32, copy=True)
        p = self.p
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if self._suppress is not None and self.generated < self.min_tokens:
            x[self._suppress] = -np.inf
        if banned:
            x[np.fromiter(banned, dtype=np.int64)] = -np.inf
        if allowed is not None:
            x[~allowed[: self.vocab_size]] = -np.inf
        if self._seen is not None:
            r = p.repetition_penalty
            seen = self._seen
            x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
        if self._counts is not None:
            c = self._counts
            x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        token = int(np.argmax(x)) if p.greedy else self._draw(x)
        self.generated += 1
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
        return token, (self._logprobs(raw, token) if p.logprobs is not None else None)

    def _draw(self, x: np.ndarray) -> int:
        p = self.p
        x /= p.temperature
        x -= x.max()
        probs = np.exp(x)
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        if 0 < p.top_k < probs.size:
            kth = np.partition(probs, -p.top_k)[-p.top_k]
            probs[probs < kth] = 0.0
        if p.top_p < 1.0:
            probs = self._nucleus(probs, p.top_p)
        cdf = np.cumsum(probs, dtype=np.float64)
        u = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), probs.size - 1))

    @staticmethod
    def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
        """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
        total = probs.sum()
        k = min(_NUCLEUS_PROBE, probs.size)
        cand = np.argpartition(probs, -k)[-k:] if k < probs.size else np.arange(probs.size)
        order = cand[np.argsort(probs[cand])[::-1]]
        mass = np.cumsum(probs[order]) / total
        if mass[-1] < top_p and k < probs.size:
            order = np.argsort(probs)[::-1]
            mass = np.cumsum(probs[order]) / total
        keep = int(np.searchsorted(mass, top_p, side="left")) + 1
        out = np.zeros_like(probs)
        kept = order[:keep]
        out[kept] = probs[kept]
        return out

    def _logprobs(self, raw: np.ndarray, token: int) -> TokenLogprobs:
        return token_logprobs(raw, token, self.p.logprobs or 0)


def token_logprobs(raw: np.ndarray, token: int, k: int, rank: bool = False) -> TokenLogprobs:
    """``token``'s logprob in one row of raw logits and the ``k`` most likely tokens, best first;
    with ``rank``, also 1 + how many tokens were more likely (prompt logprobs).

    The log-softmax is taken in float64: float32 sums over a large vocabulary lose digits that
    clients comparing logprobs would see.
    """
    x = raw.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: list[tuple[int, float]] = []
    k = min(k, x.size)
    if k:
        idx = np.argpartition(x, -k)[-k:]
        idx = idx[np.argsort(x[idx])[::-1]]
        top = [(int(i), float(x[i] - lse)) for i in idx]
    return TokenLogprobs(float(x[token] - lse), top, int((x > x[token]).sum()) + 1 if rank else None)
