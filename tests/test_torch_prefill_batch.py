"""Prefill chunks of several sequences attended to in one padded batch (attention.PrefillBatch):
the same outputs as attention written out in float64 over each sequence alone, whatever mix of
prefixes, windows, head groups and cache types; and which chunks batch together."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from backends.torch import attention
from backends.torch.attention import AttentionMetadata, PrefillSpan, batch_prefills, paged_attention, prefill_span

BS = 4  # block size
BLOCKS = 96


def reference(q, keys, values, first, scale, window=None, chunked=False):
    """float64 attention of queries at positions first.. over keys 0..(their position)."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(n, heads, values.shape[-1], dtype=torch.float64)
    for i in range(n):
        p = first + i
        k_pos = torch.arange(p + 1)
        seen = k_pos <= p
        if window is not None:
            seen &= attention.in_window(torch.tensor(p), k_pos, window, chunked)
        for h in range(heads):
            k, v = keys[: p + 1, h // group].double(), values[: p + 1, h // group].double()
            scores = (k @ q[i, h].double()) * scale
            scores[~seen] = float("-inf")
            out[i, h] = torch.softmax(scores, 0) @ v
    return out


def step(chunks, heads=6, kv_heads=2, dim=8, v_dim=None, cache_dtype=torch.float32, window=None, chunked=False,
         seed=0, decode=(), spare_blocks=0):
    """A step of ``decode`` rows (one new token after a prefix of each given length) and prefill
    ``chunks`` ((prefix, new) tokens a sequence) over a paged cache holding each prefix: the
    queries, the new keys and values, the metadata with its spans and their batches, and each
    sequence's float64 reference outputs (full attention, and within ``window``), decoding ones
    first. ``spare_blocks``: block tables that long past what their contexts need."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    latent = v_dim is not None  # the values the keys' first v_dim dimensions (one cache)
    k_cache = torch.zeros(BLOCKS * BS, kv_heads, dim, dtype=cache_dtype)
    v_cache = k_cache[..., :v_dim] if latent else torch.zeros(BLOCKS * BS, kv_heads, dim, dtype=cache_dtype)
    free = list(range(BLOCKS))
    rnd.shuffle(free)
    offsets = torch.arange(BS)
    qs, ks, vs, slots, spans, contexts, tables, refs = [], [], [], [], [], [], [], []
    decode_slots = []
    row = 0
    for prefix, new in [*((d, 1) for d in decode), *chunks]:
        context = prefix + new
        table = [free.pop() for _ in range(-(-context // BS) + spare_blocks)]
        seq_slots = [table[p // BS] * BS + p % BS for p in range(context)]
        keys = torch.randn(context, kv_heads, dim, generator=gen).to(cache_dtype).float()
        values = keys[..., :v_dim] if latent else torch.randn(context, kv_heads, dim, generator=gen).to(cache_dtype).float()
        k_cache[seq_slots[:prefix]] = keys[:prefix].to(cache_dtype)
        if not latent:
            v_cache[seq_slots[:prefix]] = values[:prefix].to(cache_dtype)
        q = torch.randn(new, heads, dim, generator=gen)
        qs.append(q)
        ks.append(keys[prefix:])
        vs.append(values[prefix:] if not latent else None)
        slots += seq_slots[prefix:]
        if row < len(decode):
            decode_slots.append(seq_slots)
        else:
            spans.append(prefill_span(row, table, new, context, offsets, True, window is not None, window, chunked))
            contexts.append(context)
            tables.append(table)
        scale = dim**-0.5
        refs.append((reference(q, keys, values, prefix, scale),
                     reference(q, keys, values, prefix, scale, window, chunked) if window is not None else None))
        row += new
    meta = AttentionMetadata([k_cache], [v_cache], torch.tensor(slots), prefills=spans)
    if decode:
        widest = max(len(d) for d in decode_slots)
        meta.num_decode = len(decode)
        meta.decode_slots = torch.tensor([d + [d[0]] * (widest - len(d)) for d in decode_slots])
        lengths = torch.tensor([len(d) for d in decode_slots])
        meta.decode_mask = attention.decode_mask(lengths, widest, None)
        if window is not None:
            meta.decode_window_mask = attention.decode_mask(lengths, widest, window, chunked)
    meta.prefill_batches = batch_prefills(spans, contexts, tables, offsets, True, window is not None, window, chunked,
                                          heads, 2 * kv_heads * dim * 4)
    k, v = torch.cat(ks), (None if latent else torch.cat(vs))
    return torch.cat(qs), k, v, meta, refs


def per_span(meta):
    """The same metadata with no batches: every chunk attended to alone."""
    spans = [PrefillSpan(s.start, s.end, s.slots, s.mask, s.window_mask) for s in meta.prefills]
    return dataclasses.replace(meta, prefills=spans, prefill_batches=[])


def check(q, k, v, meta, refs, sliding=False, atol=1e-5):
    out = paged_attention(q, k, v, meta, 0, q.shape[-1] ** -0.5, sliding=sliding)
    bounds = [*((i, i + 1) for i in range(meta.num_decode)), *((s.start, s.end) for s in meta.prefills)]
    assert len(bounds) == len(refs)
    for (start, end), ref in zip(bounds, refs):
        want = ref[1] if sliding else ref[0]
        assert torch.allclose(out[start:end].double(), want, atol=atol), (start, end)
    return out


MIXES = {
    "fresh prompts": [(0, 5), (0, 3), (0, 7), (0, 1)],
    "prefixes and fresh": [(0, 5), (8, 4), (3, 9), (0, 1), (13, 2)],
    "one row each (drafts' verify rows)": [(9, 1), (2, 1), (17, 1)],
}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (4, 1)])
def test_batched_chunks_match_attention_over_each_sequence(mix, heads, kv_heads):
    q, k, v, meta, refs = step(MIXES[mix], heads=heads, kv_heads=kv_heads)
    assert len(meta.prefill_batches) == 1 and all(s.batched for s in meta.prefills)
    out = check(q, k, v, meta, refs)
    q2, k2, v2, meta2, _ = step(MIXES[mix], heads=heads, kv_heads=kv_heads)
    alone = paged_attention(q2, k2, v2, per_span(meta2), 0, q.shape[-1] ** -0.5)
    assert torch.allclose(out, alone, atol=1e-5)


@pytest.mark.parametrize("chunked", [False, True])
def test_batched_chunks_in_a_sliding_window(chunked):
    """Window layers take the batch's window mask, full layers its full one (Llama 4's chunks too)."""
    mix = MIXES["prefixes and fresh"]
    for sliding in (True, False):
        q, k, v, meta, refs = step(mix, window=3, chunked=chunked)
        assert meta.prefill_batches and meta.prefill_batches[0].window_mask is not None
        check(q, k, v, meta, refs, sliding=sliding)


def test_batched_chunks_with_latent_values_and_a_16_bit_cache():
    """Values read from the keys' first dimensions (multi-head latent attention), and keys
    rounded into a float16 cache, widened back for float32 queries."""
    mix = MIXES["prefixes and fresh"]
    q, k, v, meta, refs = step(mix, heads=4, kv_heads=1, dim=12, v_dim=8)
    assert meta.prefill_batches
    check(q, k, v, meta, refs)
    q, k, v, meta, refs = step(mix, cache_dtype=torch.float16)
    assert meta.prefill_batches
    check(q, k, v, meta, refs, atol=1e-3)


@pytest.mark.parametrize("written_out", ["softcap", "sinks", "alibi"])
def test_layers_that_write_scores_out_keep_to_the_spans(monkeypatch, written_out):
    """Capped scores, sinks and ALiBi are the spans' path (transformers' arithmetic): the batch
    is not used, and every chunk, batched ones too, gets what it gets alone."""
    calls = []
    real = attention._prefill_batch
    monkeypatch.setattr(attention, "_prefill_batch", lambda *a: calls.append(1) or real(*a))
    extra = {"softcap": dict(softcap=0.5), "sinks": dict(sinks=torch.linspace(-1, 1, 6)),
             "alibi": dict(alibi=torch.linspace(0.1, 0.6, 6))}[written_out]
    q, k, v, meta, _ = step(MIXES["prefixes and fresh"], decode=(6,))
    assert meta.prefill_batches
    out = paged_attention(q, k, v, meta, 0, 0.3, **extra)
    assert not calls
    q, k, v, alone, _ = step(MIXES["prefixes and fresh"], decode=(6,))
    assert torch.equal(out, paged_attention(q, k, v, per_span(alone), 0, 0.3, **extra))
    paged_attention(q, k, v, meta, 0, 0.3)
    assert calls == [1]


def test_decode_rows_several_batches_and_spans_left_alone_in_one_step(monkeypatch):
    """Decoding rows first, then chunks that make two batches and two that stay alone (one too
    long to batch, one padded too much beside the rest), block tables longer than their
    contexts need: every row as attention over its own sequence gives it."""
    monkeypatch.setattr(attention, "SMALL_CHUNKS", 16)  # the rules at this test's scale
    monkeypatch.setattr(attention, "BATCHED_CHUNK", 1000)
    mix = [(0, 40), (0, 20), (2, 18), (0, 3), (1, 2), (4, 1), (0, 9)]
    q, k, v, meta, refs = step(mix, decode=(5, 11), spare_blocks=3, window=4)
    assert [s.batched for s in meta.prefills] == [False, True, True, True, True, True, False]
    assert sorted(b.rows.numel() for b in meta.prefill_batches) == [1 + 3 + 2, 20 + 18]
    check(q, k, v, meta, refs)
    q, k, v, meta, refs = step(mix, decode=(5, 11), spare_blocks=3, window=4)
    check(q, k, v, meta, refs, sliding=True)


def spans_of(sizes):
    """Spans of (prefix, new) tokens laid out one after another, and their contexts."""
    spans, row = [], 0
    for prefix, new in sizes:
        spans.append(PrefillSpan(row, row + new, torch.empty(0), None))
        row += new
    return spans, [p + n for p, n in sizes]


def groups(sizes, heads=8, key_bytes=1024):
    spans, contexts = spans_of(sizes)
    tables = [list(range(-(-c // BS))) for c in contexts]
    batches = batch_prefills(spans, contexts, tables, torch.arange(BS), True, False, None, False, heads, key_bytes)
    return sorted(tuple(b.rows.tolist()) for b in batches), spans


def rows_of(spans, *which):
    return tuple(r for i in which for r in range(spans[i].start, spans[i].end))


def test_like_chunks_batch_and_a_long_one_stays_a_span():
    (batch,), spans = groups([(0, 1000), (0, 12), (0, 9), (0, 15)])
    assert batch == rows_of(spans, 1, 2, 3)
    assert not spans[0].batched and all(s.batched for s in spans[1:])


def test_padding_at_most_doubles_a_member_s_work():
    # 300 and 280 fresh tokens: 300 x 300 padded against 280 x 280 of work (1.15x): together;
    # 120 tokens would pad to 300 x 300 against 120 x 120 (6x): alone.
    (batch,), spans = groups([(0, 300), (0, 280), (0, 120)])
    assert batch == rows_of(spans, 0, 1) and not spans[2].batched


def test_a_batch_keeps_its_scores_and_keys_within_budget():
    # 32 heads: a fresh chunk of 1,000 tokens is 32M scores, so 2 make a batch (64M): 5 of them
    # go in batches of 2, 2 and 1 (alone: a span).
    found, spans = groups([(0, 1000)] * 5, heads=32)
    assert sorted(len(b) for b in found) == [2000, 2000] and sum(s.batched for s in spans) == 4
    # Keys: 1 MiB a position lets 512 positions into one batch: two chunks of 200, not three.
    found, _ = groups([(0, 200)] * 3, key_bytes=1 << 20)
    assert [len(b) for b in found] == [400]


def test_chunks_of_over_a_million_scores_stay_spans():
    """Past 1,024 x 1,024 queries x keys a chunk's arithmetic outweighs its launches: alone, a
    fresh one takes the plain causal kernels."""
    found, spans = groups([(0, 1025), (0, 1025), (0, 1000), (0, 1000), (1, 1024)])
    assert found == [rows_of(spans, 2, 3)]
    assert [s.batched for s in spans] == [False, False, True, True, False]


def test_a_newcomer_may_not_pad_an_earlier_member_past_twice_its_work(monkeypatch):
    # Contexts 100, 60 and 50: 20 queries over 100 keys pad the second chunk's 20 x 60 = 1,200
    # to 2,000 (fine); 25 queries would pad it to 2,500, over twice its work, though not the
    # first's (2,000) nor the newcomer's own (1,250).
    monkeypatch.setattr(attention, "SMALL_CHUNKS", 16)
    (batch,), spans = groups([(80, 20), (40, 20), (25, 25)])
    assert batch == rows_of(spans, 0, 1) and not spans[2].batched


def test_a_chunk_joins_the_first_batch_it_fits_not_only_the_last():
    """Drafts' verify rows (5 tokens) interleaved by context with prompt chunks of 300: two
    batches, one of each kind."""
    sizes = [x for i in range(8) for x in ((1995 + 10 * i, 5), (1705 + 10 * i, 300))]
    found, spans = groups(sizes, key_bytes=64)
    assert found == [rows_of(spans, *range(0, 16, 2)), rows_of(spans, *range(1, 16, 2))]


def test_one_chunk_is_never_a_batch():
    found, spans = groups([(5, 7)])
    assert found == [] and not spans[0].batched


@pytest.mark.parametrize("arch", ["llama", "qwen2-window", "deepseek_v2"])
def test_an_engine_step_of_several_prompts_batches_them_and_matches_transformers(tmp_path, arch, monkeypatch):
    """Prompts arriving together prefill in one step, their chunks batched (a window on some
    layers; latent attention), and greedy decoding gives transformers' tokens."""
    from test_torch_engine import engine_for, generate_all, random_prompts, run
    from torch_models import hf_greedy, tiny_checkpoint

    batched = []
    real = attention._prefill_batch
    monkeypatch.setattr(attention, "_prefill_batch", lambda q, *a: batched.append(q.shape[0]) or real(q, *a))
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = engine_for(folder, dtype="float32", block_size=4, max_batched_tokens=128, max_num_seqs=8)
    try:
        prompts = random_prompts(5, (5, 23, 11, 17, 9))
        outs = generate_all(engine, prompts, 8)
    finally:
        run(engine.stop())
    assert batched and max(batched) == sum(len(p) for p in prompts)  # one step held every prompt
    for ours, p in zip(outs, prompts):
        assert ours == hf_greedy(folder, p, 8)
