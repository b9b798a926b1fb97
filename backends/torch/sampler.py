"""Picking the next token for every row of a batch of logits, on the logits' device with torch.

The semantics are those of the llama.cpp backend's numpy sampler (:mod:`backends.llamacpp.sampler`),
in the same order: logit_bias, suppressed ids (min_tokens) and the allowed-token mask, then
repetition / frequency / presence penalties, then greedy argmax, or temperature, min_p, top_k,
top_p and a draw. Logprobs are those of the raw model distribution, before any of this.
One deliberate difference: tokens tied with the last one of a top_p nucleus are all kept (as
both samplers do for top_k), where numpy keeps whichever of them its sort happens to put first.

How it stays cheap with a few hundred rows over a large vocabulary, every engine step:

* A batch of plain greedy rows is one argmax over the raw logits, nothing else.
* A feature costs only the rows that use it. Penalties, bias and suppressed ids are sparse
  updates, prepared with numpy on the host. Sampled rows are laid out in the work buffer so that
  the min_p / top_k rows and the top_p rows are each one contiguous block, worked on as views.
* Large temporaries are avoided: the float32 copies live in buffers kept between calls, and
  everything on them happens in place (on CPU a fresh 50 MB tensor costs as much as a pass).
* Each sampled row draws exactly one uniform number per step, from its own generator when it
  has one, and picks its token by inverse CDF over the vocabulary in token-id order. So a seeded
  row's tokens depend on its seed and its logits only, not on its batch or its place in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from router.engine import SamplingParams, TokenLogprobs

# Candidate widths tried in turn for top_p before a full sort. Most nuclei are far smaller than
# 64 tokens; on CPU top-64 costs a third of top-512, and a full sort of a 49k vocabulary ~15x.
_NUCLEUS_PROBES = (64, 512, 4096)
_NEG_INF = float("-inf")
# Up to this many runs of consecutive rows are copied run by run; more, with one gather (every
# op is a parallel region on CPU, and each costs a wake-up of the thread pool).
_FEW_RUNS = 4
# The _layout groups, in work-buffer order.
_MIN_P, _TOP_K, _TOP_K_AND_TOP_P, _MIN_P_AND_TOP_P, _TOP_P, _PLAIN = range(6)


@dataclass(slots=True)
class RowSampling:
    """What the sampler needs to know about one sequence (one row of logits)."""

    params: SamplingParams
    generator: torch.Generator | None
    """The request's own generator (set when ``params.seed`` is not None), on the logits' device.
    The sampler draws exactly one float32 uniform from it per non-greedy step, nothing else."""
    output_ids: list[int]
    """Tokens generated so far (frequency / presence penalties)."""
    prompt_ids: list[int]
    """Prompt tokens (the repetition penalty counts prompt + output)."""
    suppress: frozenset[int] = frozenset()
    """Token ids forbidden for this step (min_tokens not reached: EOS and stop ids)."""
    allowed: torch.Tensor | None = None
    """Optional bool mask ``[vocab]`` of allowed tokens (structured outputs); None: all."""


class BatchSampler:
    """Samples one token per row of a logits batch. One per engine; not thread-safe.

    ``vocab_size`` is the tokenizer's vocabulary: logits may have more columns (a padded
    embedding), which are never chosen. ``seed`` seeds the shared generator that rows without
    their own generator draw from. Two float32 buffers of ``[rows, vocab_size]`` are kept between
    calls (grown to the largest batch seen): one for sampling, one for logprobs.
    """

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._buffers: list[torch.Tensor | None] = [None, None]

    def sample(
        self, logits: torch.Tensor, rows: Sequence[RowSampling]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of ``logits`` ([len(rows), >= vocab_size], any float dtype), and per
        row its :class:`TokenLogprobs` when ``params.logprobs`` is set, else None."""
        n, vocab = len(rows), self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != n or logits.shape[1] < vocab:
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {n} rows of a {vocab}-token vocabulary")
        if n == 0:
            return [], []
        raw = logits[:, :vocab]
        plain: list[int] = []  # greedy with nothing to apply: argmax of the raw logits
        greedy: list[int] = []  # greedy after bias / masks / penalties
        drawn: list[list[int]] = [[] for _ in range(_PLAIN + 1)]  # sampled, by _layout group
        for i, row in enumerate(rows):
            if not row.params.greedy:
                drawn[_layout(row.params, vocab)].append(i)
            elif _shapes_logits(row):
                greedy.append(i)
            else:
                plain.append(i)
        want_lp = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if len(plain) == n and not want_lp:
            return raw.argmax(-1).tolist(), [None] * n

        parts = []
        if plain:
            runs = list(_runs(plain))
            if len(runs) <= _FEW_RUNS:
                parts = [raw[first : first + length].argmax(-1) for _, first, length in runs]
            else:
                parts = [raw.index_select(0, _index(plain, raw.device)).argmax(-1)]
        sampled = [i for group in drawn for i in group]
        work = greedy + sampled
        if work:
            x = self._load(0, raw, work)
            self._shape(x, [rows[i] for i in work])
            g = len(greedy)
            if g:
                parts.append(x[:g].argmax(-1))
            if sampled:
                parts.append(self._draw(x[g:], [rows[i] for i in sampled]))
        chosen = torch.cat(parts) if len(parts) > 1 else parts[0]
        order = plain + work
        if order == list(range(n)):
            tokens_t = chosen
        else:
            tokens_t = torch.empty_like(chosen)
            tokens_t[_index(order, chosen.device)] = chosen
        if not want_lp:
            return tokens_t.tolist(), [None] * n
        return self._logprobs(raw, rows, tokens_t, want_lp)

    # -- steps -----------------------------------------------------------------------------------

    def _load(self, slot: int, raw: torch.Tensor, order: list[int]) -> torch.Tensor:
        """A float32 copy of rows ``order`` of ``raw``, in that order, in reused buffer ``slot``."""
        m = len(order)
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < m or buf.device != raw.device:
            buf = self._buffers[slot] = torch.empty(m, self.vocab_size, dtype=torch.float32, device=raw.device)
        x = buf[:m]
        runs = list(_runs(order))
        if len(runs) <= _FEW_RUNS:
            for pos, first, length in runs:
                x[pos : pos + length].copy_(raw[first : first + length])
        elif raw.dtype == torch.float32:
            torch.index_select(raw, 0, _index(order, raw.device), out=x)
        else:
            x.copy_(raw.index_select(0, _index(order, raw.device)))
        return x

    def _shape(self, x: torch.Tensor, rows: list[RowSampling]) -> None:
        """logit_bias, suppressed ids, allowed masks, then penalties, in place on ``x``."""
        vocab, dev = self.vocab_size, x.device
        flat = x.view(-1)
        bias_keys: list[int] = []
        bias_vals: list[float] = []
        banned: list[int] = []
        for j, row in enumerate(rows):
            base = j * vocab
            if row.params.logit_bias:
                for t, b in row.params.logit_bias.items():
                    if 0 <= t < vocab:
                        bias_keys.append(base + t)
                        bias_vals.append(b)
            # Stop ids outside the vocabulary can never be sampled anyway.
            banned.extend(base + t for t in row.suppress if 0 <= t < vocab)
        if bias_keys:
            flat.index_add_(0, _index(bias_keys, dev), _floats(bias_vals, dev))
        if banned:
            flat.index_fill_(0, _index(banned, dev), _NEG_INF)
        for j, row in enumerate(rows):
            if row.allowed is not None:
                x[j].masked_fill_(row.allowed[:vocab].to(dev).logical_not(), _NEG_INF)
        self._repetition(flat, rows)
        self._frequency_presence(flat, rows)

    def _repetition(self, flat: torch.Tensor, rows: list[RowSampling]) -> None:
        """Seen tokens (prompt + output): positive logits divided by r, negative multiplied."""
        vocab = self.vocab_size
        keys, factors = [], []
        for j, row in enumerate(rows):
            r = row.params.repetition_penalty
            if r == 1.0 or not (row.prompt_ids or row.output_ids):
                continue
            ids = np.concatenate([np.asarray(row.prompt_ids, np.int64), np.asarray(row.output_ids, np.int64)])
            seen = np.unique(ids[(ids >= 0) & (ids < vocab)])
            keys.append(seen + j * vocab)
            factors.append(np.full(seen.size, r, dtype=np.float32))
        if keys:
            k = _to(np.concatenate(keys), flat.device)
            r_t = _to(np.concatenate(factors), flat.device)
            v = flat[k]
            flat[k] = torch.where(v > 0, v / r_t, v * r_t)

    def _frequency_presence(self, flat: torch.Tensor, rows: list[RowSampling]) -> None:
        """Output tokens only: logit -= f * count + p * (count > 0)."""
        vocab = self.vocab_size
        keys, pens = [], []
        for j, row in enumerate(rows):
            f, p = row.params.frequency_penalty, row.params.presence_penalty
            if not (f or p) or not row.output_ids:
                continue
            ids = np.asarray(row.output_ids, np.int64)
            ids, counts = np.unique(ids[(ids >= 0) & (ids < vocab)], return_counts=True)
            keys.append(ids + j * vocab)
            # Rounded as numpy rounds it in the reference sampler (f * count in float32, the sum
            # in float64, one rounding at the end), so greedy choices match it exactly.
            pens.append((np.float32(f) * counts.astype(np.float32)).astype(np.float64) + p)
        if keys:
            k = _to(np.concatenate(keys), flat.device)
            pen = _to(np.concatenate(pens), flat.device)
            flat[k] = (flat[k].double() - pen).float()

    def _draw(self, x: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
        """Sampled tokens for ``x`` (processed logits, overwritten); ``rows`` in _layout order."""
        vocab, dev = self.vocab_size, x.device
        params = [row.params for row in rows]
        x.sub_(_finite(x.amax(-1, keepdim=True)))
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x.div_(_floats(temps, dev).unsqueeze(1))
        x.exp_()  # unnormalised probabilities; each row's largest is exactly 1

        # min_p and top_k both zero what lies below a per-row cut: min_p (times the max, 1) and
        # the k-th largest probability. Zeroing below the larger equals applying one, then the
        # other; like the numpy sampler, tokens tied with the k-th are kept.
        place = [_layout(p, vocab) for p in params]
        cut_rows = [j for j, g in enumerate(place) if g <= _MIN_P_AND_TOP_P]
        zero = torch.zeros((), device=dev)
        if cut_rows:
            sub = _block(x, cut_rows)
            cut = _floats([params[j].min_p for j in cut_rows], dev)
            k_rows = [j for j, g in enumerate(place) if g in (_TOP_K, _TOP_K_AND_TOP_P)]
            if k_rows:
                ks = [params[j].top_k for j in k_rows]
                vals = _block(x, k_rows).topk(max(ks), -1).values
                kth = vals.gather(1, _index([k - 1 for k in ks], dev).unsqueeze(1)).squeeze(1)
                at = slice(k_rows[0] - cut_rows[0], k_rows[-1] + 1 - cut_rows[0])
                cut[at] = torch.maximum(cut[at], kth)
            torch.where(sub < cut.unsqueeze(1), zero, sub, out=sub)

        nucleus_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if nucleus_rows:
            sub = _block(x, nucleus_rows)
            top_p = _floats([params[j].top_p for j in nucleus_rows], dev)
            torch.where(sub < _nucleus_cut(sub, top_p).unsqueeze(1), zero, sub, out=sub)

        # Inverse CDF in token-id order with one uniform per row: cheap (an exponential race
        # needs a random number per token, ~10x the cost on CPU) and independent of the batch.
        u = self._uniforms(rows, dev)
        cdf = x.cumsum_(-1)
        total = cdf[:, -1:].contiguous()
        token = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
        # u * total can round up to total: never step past the last token with mass.
        last = torch.searchsorted(cdf, total, right=False)
        return torch.minimum(token, last).squeeze(1).clamp_(max=vocab - 1)

    def _uniforms(self, rows: list[RowSampling], dev: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: from the row's own generator, else the shared one."""
        shared = [j for j, row in enumerate(rows) if row.generator is None]
        if len(shared) == len(rows):
            return torch.rand(len(rows), generator=self.generator, device=dev)
        own = [j for j, row in enumerate(rows) if row.generator is not None]
        u = torch.empty(len(rows), device=dev)
        if shared:
            u[_index(shared, dev)] = torch.rand(len(shared), generator=self.generator, device=dev)
        u[_index(own, dev)] = torch.cat([torch.rand(1, generator=rows[j].generator, device=dev) for j in own])
        return u

    def _logprobs(
        self, raw: torch.Tensor, rows: Sequence[RowSampling], tokens_t: torch.Tensor, want: list[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The chosen tokens' raw logprobs and the top-k lists, for rows ``want``."""
        r = self._load(1, raw, want)
        chosen = tokens_t if len(want) == len(rows) else tokens_t[_index(want, tokens_t.device)]
        ks = [rows[i].params.logprobs or 0 for i in want]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        for i, lp in zip(want, _token_logprobs(r, chosen, ks)):
            out[i] = lp
        return tokens_t.tolist(), out

    def score(self, logits: torch.Tensor, targets: list[int], k: list[int]) -> list[TokenLogprobs]:
        """Prompt logprobs: row i's raw logprob of ``targets[i]`` and its ``k[i]`` most likely
        tokens (no sampling setting applies: the prompt was not sampled)."""
        r = logits[:, : self.vocab_size].float()
        chosen = torch.tensor(targets, dtype=torch.long, device=r.device)
        return _token_logprobs(r, chosen, k, ranks=True)


def _token_logprobs(r: torch.Tensor, chosen: torch.Tensor, ks: list[int], ranks: bool = False) -> list[TokenLogprobs]:
    """Row i of float32 logits ``r`` (overwritten): the logprob of ``chosen[i]`` and the top
    ``ks[i]`` (id, logprob) pairs, most likely first; with ``ranks``, each chosen token's rank."""
    picked = r.gather(1, chosen.unsqueeze(1)).squeeze(1)
    rank = ((r > picked.unsqueeze(1)).sum(-1) + 1).tolist() if ranks else [None] * len(ks)
    k = min(max(ks), r.shape[1])
    top = r.topk(k, -1) if k else None
    # log-sum-exp in place: torch.logsumexp would allocate two full-size temporaries.
    m = _finite(r.amax(-1))
    lse = r.sub_(m.unsqueeze(1)).exp_().sum(-1).log_().add_(m)
    picked_l = (picked - lse).tolist()
    top_v = (top.values - lse.unsqueeze(1)).tolist() if top else []
    top_i = top.indices.tolist() if top else []
    return [
        TokenLogprobs(picked_l[c], list(zip(top_i[c][: kc], top_v[c][: kc])) if kc else [], rank[c])
        for c, kc in enumerate(ks)
    ]


# -- helpers ---------------------------------------------------------------------------------------


def _shapes_logits(row: RowSampling) -> bool:
    """Whether anything changes this row's logits before its argmax."""
    p = row.params
    return bool(
        p.logit_bias
        or row.suppress
        or row.allowed is not None
        or p.repetition_penalty != 1.0
        or ((p.frequency_penalty or p.presence_penalty) and row.output_ids)
    )


def _layout(p: SamplingParams, vocab: int) -> int:
    """Group of a sampled row. Groups order the work buffer so that each feature's rows form one
    contiguous block, worked on as a view: rows with min_p or top_k are _MIN_P.._MIN_P_AND_TOP_P,
    with top_k _TOP_K.._TOP_K_AND_TOP_P, with top_p _TOP_K_AND_TOP_P.._TOP_P."""
    top_k = 0 < p.top_k < vocab
    top_p = p.top_p < 1.0
    if top_k:
        return _TOP_K_AND_TOP_P if top_p else _TOP_K
    if top_p:
        return _MIN_P_AND_TOP_P if p.min_p > 0.0 else _TOP_P
    return _MIN_P if p.min_p > 0.0 else _PLAIN


def _nucleus_cut(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability in the nucleus: the most likely tokens whose mass first
    reaches ``top_p`` of the row's total. Zeroing below it keeps tokens tied with the last one."""
    vocab = probs.shape[1]
    total = probs.sum(-1)
    cut = torch.empty_like(total)
    todo: torch.Tensor | None = None  # rows still undecided (None: all)
    for width in (*(w for w in _NUCLEUS_PROBES if w < vocab), vocab):
        sub = probs if todo is None else probs.index_select(0, todo)
        tot = total if todo is None else total[todo]
        tp = top_p if todo is None else top_p[todo]
        vals = sub.topk(width, -1).values if width < vocab else sub.sort(-1, descending=True).values
        mass = vals.cumsum(-1).div_(tot.unsqueeze(1))
        # numpy's searchsorted(side="left"): the first position whose mass reaches top_p.
        last = torch.searchsorted(mass, tp.unsqueeze(1), right=False).clamp_(max=width - 1)
        found = vals.gather(1, last).squeeze(1)
        if todo is None:
            cut.copy_(found)
        else:
            cut[todo] = found
        if width == vocab:
            break
        short = mass[:, -1] < tp  # the candidates hold too little mass: look wider
        n_short = int(short.sum())
        if n_short == 0:
            break
        if todo is not None:
            todo = todo[short]
        elif 2 * n_short < len(short):
            todo = short.nonzero().squeeze(1)
        # else: most rows are short; redoing all (same result for the rest) beats a gather
    return cut


def _runs(idx: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in ``idx``, first value, length) of each run of consecutive values."""
    start, m = 0, len(idx)
    while start < m:
        end = start + 1
        while end < m and idx[end] == idx[end - 1] + 1:
            end += 1
        yield start, idx[start], end - start
        start = end


def _block(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows ``idx`` of ``t`` as a view; _layout makes every row set asked for here contiguous."""
    first = idx[0]
    assert idx == list(range(first, first + len(idx))), "rows out of _layout order"
    return t[first : first + len(idx)]


def _finite(m: torch.Tensor) -> torch.Tensor:
    """Row maxima with -inf (every token masked) as 0, so the row turns to zeros, not NaN."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _index(values: list[int], dev: torch.device) -> torch.Tensor:
    return _to(np.asarray(values, dtype=np.int64), dev)


def _floats(values: list[float], dev: torch.device) -> torch.Tensor:
    return _to(np.asarray(values, dtype=np.float32), dev)


def _to(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if dev.type == "cuda":
        # From pageable memory the copy would wait for every kernel already queued (the forward
        # pass); staged in (cached) pinned memory it doesn't, and the host runs ahead.
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)
