"""Prompt logprobs on the torch engine (completions' ``echo`` with ``logprobs``): every prompt
token after the first scored by the model, against transformers' own forward pass, through
prompt chunks, prefix-cache hits, preemption and the C step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from router.engine import EngineRequest, SamplingParams
from test_torch_engine import PROMPTS, engine_for, run
from torch_models import _hf_model, smollm2_folder


async def scored(engine, prompt, n=4, k=2, **sampling):
    """(generated ids, prompt logprob entries of the first step, every step's entries)."""
    req = EngineRequest("p", prompt, SamplingParams(**{"temperature": 0.0, **sampling}), n, ignore_eos=True,
                        prompt_logprobs=k)
    out, firsts = [], []
    async for step in engine.generate(req):
        out += step.token_ids
        firsts.append(step.prompt_logprobs)
    return out, firsts[0], firsts


def reference(prompt, k):
    """transformers' float32 forward over the whole prompt: (logprob of each next prompt token,
    the top-k ids after each position)."""
    model = _hf_model(smollm2_folder())
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    lp = logits.log_softmax(-1)
    picked = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return picked.tolist(), lp[:-1].topk(k, -1).indices.tolist()


@pytest.fixture(scope="module")
def smol():
    engine = engine_for(smollm2_folder(), max_batched_tokens=32)  # prompts of 40+ tokens take 2+ steps
    yield engine
    run(engine.stop())


@pytest.fixture(scope="module")
def prompts(smol):
    system = "<|im_start|>system\n" + "You are a careful assistant who answers in one sentence. " * 5 + "<|im_end|>\n"
    texts = [system + p for p in PROMPTS[:3]] + ["The capital of France is"]
    return [smol.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def assert_matches_reference(entries, prompt, k):
    want, want_top = reference(prompt, k)
    assert len(entries) == len(prompt) - 1
    got = [e.logprob for e in entries]
    # Measured: at most 2.0e-6 apart on these prompts (float32 against float64 logprobs of
    # transformers' float32 logits); a wrong position or an off-by-one is off by whole units.
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    for e, ids in zip(entries, want_top):
        assert len(e.top) == k
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        assert e.top[0][0] == ids[0] or abs(e.top[0][1] - e.top[1][1]) < 1e-3  # near-ties may swap


def test_prompt_logprobs_match_transformers_across_prompt_chunks(smol, prompts):
    long = prompts[0]
    assert len(long) > 2 * 32  # three or more chunks of at most 32 tokens
    out, entries, steps = run(scored(smol, long, k=3))
    assert_matches_reference(entries, long, 3)
    assert all(s is None for s in steps[1:])  # the first step only
    plain = run(_generate(smol, long, 4))
    assert out == plain  # scoring the prompt changes nothing of what is generated


async def _generate(engine, prompt, n):
    req = EngineRequest("g", prompt, SamplingParams(temperature=0.0), n, ignore_eos=True)
    return [t async for step in engine.generate(req) for t in step.token_ids]


def test_a_cached_prefix_is_recomputed_for_its_logits(smol, prompts):
    shared = prompts[1]
    run(_generate(smol, shared, 2))  # its blocks are now in the prefix cache
    req = EngineRequest("c", shared, SamplingParams(temperature=0.0), 2, ignore_eos=True, prompt_logprobs=1)

    async def first():
        async for step in smol.generate(req):
            return step

    step = run(first())
    assert step.cached_tokens == 0  # no hit: every position's logits were needed
    assert_matches_reference(step.prompt_logprobs, shared, 1)
    again = EngineRequest("d", shared, SamplingParams(temperature=0.0), 2, ignore_eos=True)

    async def hit():
        async for step in smol.generate(again):
            return step.cached_tokens

    assert run(hit()) > 0  # and its blocks still serve the next request


def test_one_token_prompt_and_k_zero(smol):
    _, entries, _ = run(scored(smol, [504], k=0))
    assert entries == []
    _, entries, _ = run(scored(smol, [504, 3458, 282], k=0))
    assert len(entries) == 2 and all(e.top == [] for e in entries)


def test_in_a_mixed_batch_nothing_else_changes(smol, prompts):
    plain = [run(_generate(smol, p, 6)) for p in prompts]

    async def together():
        return await asyncio.gather(
            scored(smol, prompts[0], n=6, k=2), *(_generate(smol, p, 6) for p in prompts[1:])
        )

    first, *others = run(together())
    assert others == plain[1:] and first[0] == plain[0]
    assert_matches_reference(first[1], prompts[0], 2)


def test_preemption_keeps_every_entry_once(prompts):
    # 8 blocks of 16 tokens for 4 sequences of ~30-100 tokens: constant preemption, and the
    # scoring sequence recomputes a prompt it has partly scored.
    tight = engine_for(smollm2_folder(), kv_cache_gb=8 * 16 * 46080 / 2**30, max_batched_tokens=32)
    try:
        async def all_at_once():
            return await asyncio.gather(*(scored(tight, p, n=24, k=1) for p in prompts))

        results = run(all_at_once())
        assert tight.scheduler.preemptions > 0
        for (_, entries, _), p in zip(results, prompts):
            assert_matches_reference(entries, p, 1)
        assert tight.pool.num_used == 0
    finally:
        run(tight.stop())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_c_step_scores_as_the_packed_torch_path_does(prompts, fmt):
    engine = engine_for(smollm2_folder(), weight_format=fmt, max_batched_tokens=32)
    try:
        calls = []
        logits = engine.runner.decoder.logits
        engine.runner.decoder.logits = lambda step, *rest: calls.append(1) or logits(step, *rest)
        c_out, c_entries, _ = run(scored(engine, prompts[0], k=2))
        assert calls  # the prompt's chunks ran in C
        engine.runner.decoder = None
        t_out, t_entries, _ = run(scored(engine, prompts[0], k=2))
    finally:
        run(engine.stop())
    assert c_out == t_out and len(c_entries) == len(t_entries) == len(prompts[0]) - 1
    # int16 activations in C, float ones in torch: close, not equal (measured at most 0.0082).
    assert max(abs(a.logprob - b.logprob) for a, b in zip(c_entries, t_entries)) < 0.05


def test_scored_rows_per_step_are_capped(smol, prompts):
    steps = []
    run_step = smol.runner.run
    smol.runner.run = lambda step: steps.append([w.num_new for w in step.work]) or run_step(step)
    cap, smol.scheduler.scored_rows = smol.scheduler.scored_rows, 7
    try:
        _, entries, _ = run(scored(smol, prompts[1], k=1))
    finally:
        smol.scheduler.scored_rows = cap
        smol.runner.run = run_step
    assert_matches_reference(entries, prompts[1], 1)
    prefill = [n for n in (s[0] for s in steps) if n > 1]
    assert prefill[:3] == [7, 7, 7]  # chunks of 7 where the budget would allow 32
