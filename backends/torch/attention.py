"""Attention over the paged KV cache for a flat batch of tokens.

A step's tokens are laid out decode-first: ``num_decode`` sequences with one new token each, then
the prefill chunks, one span per sequence. Each layer writes the new keys and values into their
cache slots, then attends:

- decode tokens together, over each sequence's cached keys (padded to the longest, masked);
- each prefill chunk over its sequence's cached prefix plus itself, causally; where a step holds
  several chunks, those of like sizes together in one padded batch (:class:`PrefillBatch`), so a
  layer launches each kernel once for all of them, not once a chunk (on the H200 an eager step
  cost up to some 16 microseconds an operation, and 64 prompts' spans in 30 layers made 30,000).

Keys and values live in ``[num_slots, kv_heads, head_dim]`` tensors per layer; a sequence's slots
are ``block * block_size + offset`` for the blocks of its block table. Under multi-head latent
attention (:mod:`.latent`) one tensor holds both: keys of one head, and values that are their
first dimensions (the value tensor views the key tensor's). The cache may hold a
narrower type than the model computes in (``kv_cache_dtype``): new keys and values are rounded
into it, gathered ones widened back.

Layers with a sliding window (all of Mistral's, some of Qwen2's, Qwen3's or Gemma's) take the
step's window masks, the others its full ones; the runner builds only the kinds the model has.
Llama 4's chunked layers take the window masks too, built ``chunked``: a position attends to the
earlier keys of its own chunk of ``window`` positions (``p - p % window`` to ``p``).

Gemma 2 caps its scores (``cap * tanh(score / cap)``) before the softmax, and gpt-oss adds a
learned logit per head to each softmax (a "sink" that takes some of the weight and passes no
value), neither of which SDPA can do: those layers compute the scores, the cap or the sink and
the softmax as separate operations, as transformers' eager attention does. The ALiBi models
(BLOOM, MPT, Falcon-RW) add ``slope * (key position - query position)`` to each head's scores:
a row's keys sit in position order, so each key's bias is its slope times its distance back from
the row's last key, which differs from its distance to the query by the same amount for every key
of the row, and the softmax does not see that. The biases are float32 whatever the model's dtype,
as vLLM's kernels add them (transformers adds BLOOM's, slope times absolute position, in the
model's dtype, and rounds Falcon's to bfloat16 in every dtype), the scores written out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk: rows [start, end) of the step, keys at ``slots``."""

    start: int
    end: int
    slots: torch.Tensor  # [context] slot of every key the chunk attends to, in position order
    mask: torch.Tensor | None  # [chunk, context] True = attend; None = plain causal (no prefix)
    window_mask: torch.Tensor | None = None  # the same for sliding-window layers
    # Models with per-sequence states, the prefix cache keeping some (state.StateCache): for each
    # (tokens, slot), in order of tokens, the state after the chunk's first ``tokens`` tokens is
    # copied to state slot ``slot``.
    keeps: tuple[tuple[int, int], ...] = ()
    batched: bool = False  # attended to in one of the step's PrefillBatches (layers that can)


@dataclass(slots=True)
class PrefillBatch:
    """Prefill chunks of several sequences attended to together: queries padded to the longest
    chunk (``L`` rows a sequence), keys to the widest context (``C``). A padding query sits at
    position 0 (it sees one key, so no row of scores is all masked) and is dropped after.
    Layers with capped scores, sinks or ALiBi keep to the spans."""

    queries: torch.Tensor  # [B * L] the step row of each padded query (padding: its chunk's first row)
    slots: torch.Tensor  # [B, C] cache slot of each key (padding: any of the sequence's, masked)
    mask: torch.Tensor | None  # [B, L, C] True = attend (full attention's; None: no such layers)
    window_mask: torch.Tensor | None  # the same for sliding-window layers
    rows: torch.Tensor  # [n] the step rows the chunks' outputs go to
    picks: torch.Tensor  # [n] where each of those sits among the B * L padded queries
    folded: dict[tuple[bool, int, torch.dtype], torch.Tensor] = field(default_factory=dict)  # by (sliding, group, dtype)

    def folded_mask(self, sliding: bool, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, group * L, C]``: the mask for queries whose ``group`` heads sharing a KV
        head are folded into rows, as :func:`_decode` folds them (equal head counts, which every
        SDPA backend takes), made once a step for all layers: additive (0 or -inf) in the
        queries' ``dtype``, which SDPA would otherwise make of a boolean mask at every call, and
        its rows 16 keys apart in memory (CUDA's memory-efficient kernel asks that, else copies)."""
        key = (sliding, group, dtype)
        if key not in self.folded:
            mask = self.window_mask if sliding else self.mask
            if mask is None:
                raise ValueError("a prefill batch without the mask its layer needs")  # runner: mask_kinds
            b, n, c = mask.shape
            wide = torch.full((b, 1, group * n, -(-c // 16) * 16), float("-inf"), dtype=dtype, device=mask.device)
            wide.view(b, 1, group, n, -1)[..., :c].masked_fill_(mask[:, None, None], 0.0)
            self.folded[key] = wide[..., :c]
        return self.folded[key]


@dataclass(slots=True)
class AttentionMetadata:
    """Where every token of one step goes and what it attends to."""

    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [tokens] cache slot each new token's key/value is written to
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decode, max_context]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_context] or None (no padding)
    decode_window_mask: torch.Tensor | None = None  # the same for sliding-window layers
    prefills: list[PrefillSpan] = field(default_factory=list)
    prefill_batches: list[PrefillBatch] = field(default_factory=list)  # of the spans marked ``batched``
    # Models with short convolutions (:mod:`.conv`): each row's window of cache slots
    # [tokens, kernel] and which of them lie in its sequence.
    conv_slots: torch.Tensor | None = None
    conv_valid: torch.Tensor | None = None
    # Models with linear attention (:mod:`.delta`): the per-sequence states (state.RecurrentState)
    # and each sequence's slot in them, in the step's order (decoding ones, then each prefill's).
    states: Any = None
    state_slots: torch.Tensor | None = None
    # Mamba2 layers with a time_step_limit (:mod:`.mamba`): [tokens] whether each row is one of
    # its sequence's prompt tokens (their time steps are held within the limit).
    prompt_rows: torch.Tensor | None = None
    # The rows whose logits are wanted, on the host (the runner's StepRows.out_rows): Gemma 4's
    # shared layers compute those alone (CausalLM.wanted_rows_from) without reading them back.
    wanted_rows: list[int] | None = None


CAPPED_SCORES = 1 << 22
"""The most scores a prefill written out (caps, sinks) computes at once (16 MiB in float32, a few
copies of it alive): its rows go in blocks, where a whole chunk of Gemma 2 9B over an 8k context
would hold about 70M."""


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    meta: AttentionMetadata,
    layer: int,
    scale: float,
    sliding: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] (both None: attend to ``layer``'s
    cache as an earlier layer left it this step, Gemma 4's shared layers). Returns [tokens, heads, dim].
    ``v`` None: the values are the keys' first dimensions, which the value cache views (latent
    attention: the output has the values' width); ``sliding``: the layer attends within the
    model's sliding window (the window masks); ``softcap``: the scores' tanh cap, if any; ``sinks``: the sink logit of each head ``[heads]``;
    ``alibi``: each head's ALiBi slope ``[heads]``, float32."""
    k_cache, v_cache = meta.k_cache[layer], meta.v_cache[layer]
    if k is not None:  # None: the layer reads ``layer``'s cache, written by that layer this step (Gemma 4)
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    if v is not None:
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    decode_mask = meta.decode_window_mask if sliding else meta.decode_mask
    if meta.num_decode and not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, decode_mask, scale, softcap, sinks, alibi)
    out = q.new_empty(*q.shape[:-1], v_cache.shape[-1])
    if meta.num_decode:
        out[: meta.num_decode] = _decode(
            q[: meta.num_decode], k_cache, v_cache, meta, decode_mask, scale, softcap, sinks, alibi
        )
    batched = softcap is None and sinks is None and alibi is None
    if batched:
        for batch in meta.prefill_batches:
            out.index_copy_(0, batch.rows, _prefill_batch(q, k_cache, v_cache, batch, sliding, scale))
    for span in meta.prefills:
        if batched and span.batched:
            continue
        mask = span.window_mask if sliding else span.mask
        out[span.start : span.end] = _prefill(
            q[span.start : span.end], k_cache, v_cache, span.slots, mask, scale, softcap, sinks, alibi
        )
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, half: int) -> torch.Tensor:
    """Rotary embedding of ``x`` whose dimension ``j`` pairs with ``j + half``, from a table row's
    cos and signed sin (:class:`.model.Rotary`)."""
    return x * cos + x.roll(half, dims=-1) * signed_sin


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None, sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over ``q [..., n, dim]`` and ``keys``, ``values [..., context, dim]`` (equal head
    counts, or one KV head broadcast over a group of query heads), or with ``softcap``, ``sinks``
    (each row's sink logit, shaped as the scores' ``[..., n, 1]``) or ``alibi`` (each row's slope,
    shaped so) the same arithmetic written out as transformers' eager attention does it: scores,
    cap, ALiBi's bias (float32, each key's distance back from the last), mask, the softmax in
    float32 (with sinks: over the scores and the sink, less their maximum, in the scores' dtype;
    the sink's share then dropped). (ALiBi's bias as SDPA's float mask was tried: 2.0 against 1.5 s
    a step of 8 rows over 1,000 positions, BLOOM-560M's shape, torch operations.)"""
    if softcap is None and sinks is None and alibi is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi is not None:
        context = keys.shape[-2]
        scores = scores.float() + alibi * torch.arange(1 - context, 1, device=scores.device, dtype=torch.float32)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
    scores = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def values_in_keys(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the value cache views the key cache's first dimensions (latent attention): the
    gathered keys then hold the values too, and are not gathered twice."""
    return v_cache.data_ptr() == k_cache.data_ptr()


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, mask: torch.Tensor | None,
    scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    n, context = meta.decode_slots.shape
    kv_heads, dim = k_cache.shape[1:]
    idx = meta.decode_slots.reshape(-1)
    keys = k_cache.index_select(0, idx).to(q.dtype).view(n, context, kv_heads, dim).transpose(1, 2)
    if values_in_keys(k_cache, v_cache):
        values = keys[..., : v_cache.shape[-1]]
    else:
        values = v_cache.index_select(0, idx).to(q.dtype).view(n, context, kv_heads, -1).transpose(1, 2)
    # The query heads that share a KV head (heads j*g .. j*g+g-1 use KV head j) stand in for
    # that head's query positions: equal head counts, so every SDPA backend takes it (on CUDA
    # the memory-efficient kernel, which refuses enable_gqa in many torch versions), and one
    # [n, 1, 1, context] mask covers them all.
    group = q.shape[1] // kv_heads
    sink = sinks.view(kv_heads, group, 1) if sinks is not None else None  # head j * group + g's
    slope = alibi.view(kv_heads, group, 1) if alibi is not None else None
    out = _attend(q.reshape(n, kv_heads, group, dim), keys, values, mask, scale, softcap, sink, slope)
    return out.reshape(n, kv_heads * group, -1)


GATHER_BYTES = 512 << 20
"""Keys and values one layer's attention gathers at most in one go: a decode graph's (graphs.py)
or a prefill batch's."""

PREFILL_BATCH_SCORES = 1 << 26
"""The most query-key pairs, times query heads, one prefill batch covers, its padding counted
(256 MiB of float32 scores, where a backend writes them out)."""

SMALL_CHUNKS = 1 << 16
"""A batch whose padded chunk (its longest times its widest context) is at most this many
queries times keys takes any padding: launches, not arithmetic, are what its attention costs."""

BATCHED_CHUNK = 1 << 20
"""Chunks whose queries times keys are more than this (a fresh prompt of over 1,024 tokens) stay
alone: their arithmetic outweighs a few launches, and alone and without a prefix they take
SDPA's plain causal kernels (flash attention on a GPU), which skip the masked half."""


def position_bytes(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> int:
    """Bytes of one position's key and value (latent attention: its key alone, the values
    within it) in the widest layer (Gemma 4's full layers are wider than its sliding ones)."""
    return max((1 if values_in_keys(k, v) else 2) * k.shape[1] * k.shape[2] * k.element_size()
               for k, v in zip(k_caches, v_caches))


class PrefillBatcher:
    """What :func:`batch_prefills` needs of a model and its cache, settled once: whether any of
    its layers can take batches (not where all write their scores out: Gemma 2's caps, gpt-oss's
    sinks, ALiBi), its query heads, and a gathered position's bytes (in the cache's type, and
    again widened to the model's where that is wider). ``spec``: the model's ModelSpec."""

    def __init__(self, spec: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.enabled = spec.attn_softcap is None and not spec.attention_sinks and not spec.alibi
        self.heads = spec.num_heads
        self.full_layers, self.window_layers = spec.mask_kinds
        self.window, self.chunked = spec.sliding_window, spec.chunked_windows
        cache, compute = k_caches[0].element_size(), dtype.itemsize
        self.key_bytes = position_bytes(k_caches, v_caches) * (1 + compute // cache if compute > cache else 1)

    def __call__(self, spans: list[PrefillSpan], contexts: list[int], tables: list[list[int]],
                 offsets: torch.Tensor) -> list[PrefillBatch]:
        """The batches of a step's ``spans`` (:func:`batch_prefills`), none where it has one."""
        if not self.enabled or len(spans) < 2:
            return []
        return batch_prefills(spans, contexts, tables, offsets, self.full_layers, self.window_layers, self.window,
                              self.chunked, self.heads, self.key_bytes)


def batch_prefills(spans: list[PrefillSpan], contexts: list[int], tables: list[list[int]], offsets: torch.Tensor,
                   full: bool, windowed: bool, window: int | None, chunked: bool, heads: int,
                   key_bytes: int) -> list[PrefillBatch]:
    """The step's prefill ``spans`` (each ending at position ``contexts[i]`` of a sequence whose
    blocks are ``tables[i]``; ``offsets``: ``arange(block size)`` on the device) in batches of
    like sizes: the widest contexts first, each span joining the first batch it fits (the most
    recent :data:`_GROUPS_TRIED`), else starting one (:class:`_Group` says what fits). Chunks over
    :data:`BATCHED_CHUNK` stay alone. A span left alone stays a span; those batched are marked
    ``batched``."""
    groups: list[_Group] = []
    sizes = [(span.end - span.start) * context for span, context in zip(spans, contexts)]
    for i in sorted((i for i in range(len(spans)) if sizes[i] <= BATCHED_CHUNK), key=lambda i: -contexts[i]):
        length = spans[i].end - spans[i].start
        group = next((g for g in reversed(groups[-_GROUPS_TRIED:]) if g.admits(length, sizes[i], heads, key_bytes)), None)
        if group is None:
            groups.append(_Group(i, length, contexts[i], sizes[i]))
        else:
            group.add(i, length, sizes[i])
    return [_prefill_batch_of(sorted(g.members), spans, contexts, tables, offsets, full, windowed, window, chunked)
            for g in groups if len(g.members) > 1]


_GROUPS_TRIED = 16
"""The batches a span tries to join, the most recent first (a step of many unlike chunks stays
linear in them)."""


class _Group:
    """A prefill batch being formed: its spans, its longest chunk, its context (its first span's,
    the widest) and its members' least work (a chunk's queries times keys)."""

    __slots__ = ("members", "length", "context", "least")

    def __init__(self, i: int, length: int, context: int, size: int) -> None:
        self.members, self.length, self.context, self.least = [i], length, context, size

    def admits(self, length: int, size: int, heads: int, key_bytes: int) -> bool:
        """Whether a chunk of ``length`` queries and ``size`` queries times keys fits: the padded
        scores within :data:`PREFILL_BATCH_SCORES` (``heads`` query heads), the keys within
        :data:`GATHER_BYTES` (``key_bytes`` a position), and no member's padded chunk more than
        twice its own work, unless the padded chunk is at most :data:`SMALL_CHUNKS`."""
        n, longest, least = len(self.members) + 1, max(self.length, length), min(self.least, size)
        return (n * longest * self.context * heads <= PREFILL_BATCH_SCORES
                and n * self.context * key_bytes <= GATHER_BYTES
                and longest * self.context <= max(SMALL_CHUNKS, 2 * least))

    def add(self, i: int, length: int, size: int) -> None:
        self.members.append(i)
        self.length, self.least = max(self.length, length), min(self.least, size)


def _prefill_batch_of(group: list[int], spans: list[PrefillSpan], contexts: list[int], tables: list[list[int]],
                      offsets: torch.Tensor, full: bool, windowed: bool, window: int | None,
                      chunked: bool) -> PrefillBatch:
    dev, bs = offsets.device, offsets.numel()
    length = max(spans[i].end - spans[i].start for i in group)
    context = max(contexts[i] for i in group)
    blocks = -(-context // bs)
    queries: list[int] = []
    rows: list[int] = []
    picks: list[int] = []
    padded_tables, info = [], []
    for k, i in enumerate(group):
        span = spans[i]
        n = span.end - span.start
        queries += [*range(span.start, span.end), *[span.start] * (length - n)]
        rows += range(span.start, span.end)
        picks += range(k * length, k * length + n)
        table = tables[i][:blocks]
        padded_tables.append(table + [table[0]] * (blocks - len(table)))
        info.append((contexts[i] - n, n))  # the chunk's first position, its length
        span.batched = True
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long).to(dev, non_blocking=True)  # noqa: E731
    table, info_ = as_tensor(padded_tables), as_tensor(info)
    slots = (table[:, :, None] * bs + offsets).view(len(group), -1)[:, :context]
    col = torch.arange(length, device=dev)[None, :]
    q_pos = torch.where(col < info_[:, 1:2], info_[:, 0:1] + col, 0)[:, :, None]  # padding queries at position 0
    k_pos = torch.arange(context, device=dev)[None, None, :]
    mask = k_pos <= q_pos  # a real query's keys past its context are past its position too
    return PrefillBatch(as_tensor(queries), slots, mask if full else None,
                        mask & in_window(q_pos, k_pos, window, chunked) if windowed else None,
                        as_tensor(rows), as_tensor(picks))


def _prefill_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PrefillBatch,
                   sliding: bool, scale: float) -> torch.Tensor:
    """``[n, heads, dim]``: the outputs of ``batch``'s chunks, in the order of ``batch.rows``."""
    b, context = batch.slots.shape
    length = batch.queries.numel() // b
    heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    idx = batch.slots.reshape(-1)
    keys = k_cache.index_select(0, idx).to(q.dtype).view(b, context, kv_heads, -1).transpose(1, 2)
    if values_in_keys(k_cache, v_cache):
        values = keys[..., : v_cache.shape[-1]]
    else:
        values = v_cache.index_select(0, idx).to(q.dtype).view(b, context, kv_heads, -1).transpose(1, 2)
    # [B, kv_heads, group * L, dim]: row g * L + i is query i of head j * group + g.
    rows = q.index_select(0, batch.queries).view(b, length, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    out = F.scaled_dot_product_attention(rows.reshape(b, kv_heads, group * length, dim), keys, values,
                                         attn_mask=batch.folded_mask(sliding, group, q.dtype), scale=scale)
    out = out.view(b, kv_heads, group, length, -1).permute(0, 3, 1, 2, 4).reshape(b * length, heads, -1)
    return out.index_select(0, batch.picks)


def _prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
    scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    keys = k_cache.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
    if values_in_keys(k_cache, v_cache):
        values = keys[..., : v_cache.shape[-1]]
    else:
        values = v_cache.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
    if softcap is not None or sinks is not None or alibi is not None:
        # The chunk's query heads that share a KV head as one [group x chunk] block of rows.
        chunk, heads, dim = q.shape
        kv_heads, context = keys.shape[1], keys.shape[2]
        group = heads // kv_heads
        if mask is None:  # plain causal over a chunk that is the whole context
            mask = causal_mask(chunk, context, q.device)
        rows, mask = q.transpose(0, 1).reshape(kv_heads, group * chunk, dim), mask.repeat(group, 1)
        # Row g * chunk + c of KV head j: head j * group + g's sink and slope.
        sink, slope = (None if each is None else
                       each.view(kv_heads, group, 1, 1).expand(kv_heads, group, chunk, 1).reshape(kv_heads, -1, 1)
                       for each in (sinks, alibi))
        step = max(1, CAPPED_SCORES // (kv_heads * context))  # rows at a time: the scores' memory bounded
        out = torch.cat([
            _attend(rows[:, i : i + step], keys[0], values[0], mask[i : i + step], scale, softcap,
                    sink[:, i : i + step] if sink is not None else None,
                    slope[:, i : i + step] if slope is not None else None)
            for i in range(0, rows.shape[1], step)
        ], dim=1)
        return out.reshape(heads, chunk, -1).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, chunked: bool) -> torch.Tensor:
    """Which keys at ``k_pos`` the queries at ``q_pos`` (broadcast together, keys no later) see
    within ``window``: the last ``window`` positions, or (``chunked``, Llama 4) those of the
    query's own chunk of ``window`` positions."""
    return q_pos // window == k_pos // window if chunked else q_pos - k_pos < window


def causal_mask(chunk: int, context: int, device: torch.device) -> torch.Tensor:
    """``[chunk, context]``: the plain causal mask of a chunk ending the context (what a span's
    None mask stands for)."""
    return torch.ones(chunk, context, dtype=torch.bool, device=device).tril(context - chunk)


def prefill_mask(chunk: int, context: int, window: int | None, device: torch.device,
                 chunked: bool = False) -> torch.Tensor | None:
    """Causal mask of a chunk whose first token sits at position ``context - chunk`` (within
    ``window``: :func:`in_window`)."""
    if chunk == context and window is None:
        return None
    q_pos = torch.arange(context - chunk, context, device=device)[:, None]
    k_pos = torch.arange(context, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= in_window(q_pos, k_pos, window, chunked)
    return mask


def prefill_span(row: int, block_table: list[int], num_new: int, context: int, offsets: torch.Tensor,
                 full: bool, windowed: bool, window: int | None, chunked: bool = False) -> PrefillSpan:
    """The span of a chunk of ``num_new`` tokens at rows ``row`` on, ending at position
    ``context`` of a sequence whose blocks are ``block_table`` (``offsets``: ``arange(block
    size)`` on the device), with the masks its layers need: full attention's, the window's
    (``chunked``: Llama 4's)."""
    dev = offsets.device
    table = torch.tensor(block_table, dtype=torch.long).to(dev, non_blocking=True)
    slots = (table[:, None] * offsets.numel() + offsets).view(-1)[:context]
    span = PrefillSpan(row, row + num_new, slots, None)
    if full:
        span.mask = prefill_mask(num_new, context, None, dev)
    if windowed:
        span.window_mask = prefill_mask(num_new, context, window, dev, chunked)
    return span


def only_rows(meta: AttentionMetadata, rows: list[int]) -> AttentionMetadata | None:
    """The step's metadata for its ``rows`` alone (ascending), as layers that write no keys or
    values of their own see it once the other rows are dropped (Gemma 4's shared layers); None
    where the rows do not cut cleanly: some decoding row left out, or a chunk's rows that are
    not one run."""
    decoding = meta.num_decode
    if rows[:decoding] != list(range(decoding)):
        return None
    spans, i = [], decoding
    for span in meta.prefills:
        j = i
        while j < len(rows) and rows[j] < span.end:
            j += 1
        mine, i = rows[i:j], j
        if not mine:
            continue
        if mine[0] < span.start or mine[-1] - mine[0] + 1 != len(mine):
            return None
        first, count, start = mine[0] - span.start, len(mine), spans[-1].end if spans else decoding
        mask = span.mask
        if mask is None:  # plain causal over a chunk that is its whole context
            mask = causal_mask(span.end - span.start, span.end - span.start, span.slots.device)
        window = span.window_mask[first : first + count] if span.window_mask is not None else None
        spans.append(PrefillSpan(start, start + count, span.slots, mask[first : first + count], window))
    if i != len(rows):
        return None
    index = torch.tensor(rows, dtype=torch.long).to(meta.slot_mapping.device, non_blocking=True)
    # Per-row state (convolution windows, state slots, prompt rows, kept states) is not cut: no
    # model with layers that keep no cache of their own has any.
    return replace(meta, slot_mapping=meta.slot_mapping[index], prefills=spans, prefill_batches=[], wanted_rows=None)


def decode_mask(lengths: torch.Tensor, context: int, window: int | None, chunked: bool = False) -> torch.Tensor | None:
    """Which of the padded keys each decoding sequence attends to (None: all of them)."""
    k_pos = torch.arange(context, device=lengths.device)[None, :]
    mask = k_pos < lengths[:, None]
    if window is not None:
        mask &= in_window(lengths[:, None] - 1, k_pos, window, chunked)
    if bool(mask.all()):
        return None
    return mask[:, None, None, :]
