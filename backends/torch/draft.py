"""Speculative decoding with a draft model (vLLM's ``"method": "draft_model"``).

A smaller model with the same vocabulary guesses the next ``k`` tokens of each decoding
sequence, greedily, one batched forward pass per token; the model then verifies the guesses in
one step as it verifies n-gram drafts (speculative.py). The draft is one-hot (the draft model's
argmax), so keeping the sampled tokens up to the first that differs from it leaves the output
what it is without a draft, greedy or sampled, seeded included: a better draft model only makes
more of each draft right.

The draft model's keys and values live in a cache of its own with as many blocks as the
model's, addressed through the same block tables (the pool hands out one block id for both).
Which of a sequence's positions hold draft keys and values is tracked on the sequence
(``draft_valid``, ``draft_tail``): the positions up to the last token fed are right; drafted
tokens are right as far as the model kept them. Before drafting, the draft model computes the
rest (the prompt at the first draft, the tokens the model sampled since): positions a prefix-cache
hit brought in are computed again, since a cached block may hold the model's keys without the
draft's. A step's catching up is capped (``max_catch_up`` tokens in all, the step budget): a
sequence further behind catches up over several steps and is drafted for once it has. Nothing
here can change an output: wrong draft keys only make worse guesses.
"""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, PrefillBatcher, prefill_span
from .kv_cache import KVCache
from .model import CausalLM
from .sequence import Sequence


class DraftModel:
    """The draft model, its KV cache (same blocks as the model's), and :meth:`propose`."""

    def __init__(self, model: CausalLM, kv: KVCache, vocab_size: int, device: torch.device, max_catch_up: int) -> None:
        self.model = model
        self.kv = kv
        self.max_catch_up = max_catch_up
        self.vocab_size = vocab_size  # the model's tokenizer's: a draft past it is cut there
        self.device = device
        self.window, self.chunked = model.spec.sliding_window, model.spec.chunked_windows
        self.full_layers, self.window_layers = model.spec.mask_kinds
        self._offsets = torch.arange(kv.block_size, device=device)
        self._batcher = PrefillBatcher(model.spec, kv.k, kv.v, model.embed_tokens.weight.dtype)

    @torch.inference_mode()
    def propose(self, items: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to ``k`` greedy tokens after each sequence's last one (``items``: (sequence, k)),
        their keys and values written at the positions after it, which must have blocks; none
        for a sequence still catching up (module docstring)."""
        feeds: dict[int, tuple[Sequence, int, list[int]]] = {}
        live, behind = [], []  # drafted for; only catching up
        budget = self.max_catch_up
        for i, (seq, _) in enumerate(items):
            n = len(seq.tokens)
            valid = seq.draft_valid
            for drafted, token in zip(seq.draft_tail, seq.tokens[valid:]):
                if drafted != token:
                    break
                valid += 1
            valid = min(valid, n - 1)  # the last token is fed: its logits give the first guess
            if n - valid <= budget:
                budget -= n - valid
                feeds[i] = (seq, valid, seq.tokens[valid:])
                live.append(i)
            elif budget > 0:
                feeds[i] = (seq, valid, seq.tokens[valid : valid + budget])
                behind.append(i)
                budget = 0
        drafts: list[list[int]] = [[] for _ in items]
        # The first pass feeds every sequence what it has not seen; only those caught up guess.
        guesses = self._forward([feeds[i] for i in live + behind])[: len(live)] if feeds else []
        for i in behind:
            seq, start, fed = feeds[i]
            seq.draft_valid, seq.draft_tail = start + len(fed), []
        caught_up = list(live)
        while live:
            still = []
            for i, token in zip(live, guesses):
                seq, k = items[i]
                if token >= self.vocab_size:
                    continue  # a padded row of the draft's embeddings: no token of the model's
                drafts[i].append(token)
                if len(drafts[i]) < k:
                    feeds[i] = (seq, feeds[i][1] + len(feeds[i][2]), [token])
                    still.append(i)
            live = still
            if live:
                guesses = self._forward([feeds[i] for i in live])
        for i in caught_up:
            seq, draft = items[i][0], drafts[i]
            # Fed: every token, then each guess but the last (whose keys nobody computed).
            seq.draft_valid, seq.draft_tail = len(seq.tokens), draft[:-1]
        return drafts

    def _forward(self, feeds: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        """One pass over each (sequence, first position, tokens): the argmax after each's last."""
        bs, dev = self.kv.block_size, self.device
        ids, positions, slots, out_rows = [], [], [], []
        spans, contexts = [], []
        for seq, start, tokens in feeds:
            table = seq.block_table
            context = start + len(tokens)
            spans.append(prefill_span(len(ids), table, len(tokens), context, self._offsets,
                                      self.full_layers, self.window_layers, self.window, self.chunked))
            contexts.append(context)
            for p in range(start, context):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            ids += tokens
            out_rows.append(len(ids) - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        meta = AttentionMetadata(self.kv.k, self.kv.v, as_tensor(slots), prefills=spans)
        # A guessing pass is a one-token chunk a sequence: one batch (attention.PrefillBatch).
        meta.prefill_batches = self._batcher(spans, contexts, [seq.block_table for seq, _, _ in feeds], self._offsets)
        logits = self.model(as_tensor(ids), as_tensor(positions), meta, as_tensor(out_rows))
        return logits.argmax(dim=-1).tolist()
