"""Speculative decoding with a draft model inside the torch engine: with the model itself as its
draft every guess holds; with another model the output is still the output without drafts,
greedy or sampled, alone or in a batch, under preemption; and drafts only where they may be."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from backends.torch import SpeculativeConfig
from router.engine import EngineRequest, SamplingParams
from test_torch_engine import engine_for, generate, random_prompts, run
from torch_models import hf_greedy, tiny_checkpoint


def draft_config(folder, k=4, **more):
    return SpeculativeConfig(method="draft_model", model=str(folder), num_speculative_tokens=k, **more)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama, and a tiny Qwen3 of other head sizes (the same tokenizer) as a draft."""
    root = tmp_path_factory.mktemp("draft")
    return tiny_checkpoint(root / "llama", "llama"), tiny_checkpoint(root / "qwen3", "qwen3", seed=3)


def small(folder, **options):
    return engine_for(folder, block_size=4, max_batched_tokens=32, **options)


def spec_stats(engine):
    stats = engine.stats()
    return stats["spec_draft_tokens"], stats["spec_accepted_tokens"]


def test_the_model_as_its_own_draft_keeps_every_guess_and_matches_transformers(models, monkeypatch):
    from backends.torch import attention

    batched = []  # (rows of the pass, rows batched): the draft's guessing passes batch their one-token chunks
    real = attention._prefill_batch
    monkeypatch.setattr(attention, "_prefill_batch", lambda q, k, v, b, *a: batched.append((q.shape[0], b.rows.numel()))
                        or real(q, k, v, b, *a))
    target, _ = models
    engine = small(target, speculative_config=draft_config(target))
    prompts = random_prompts(5, [9, 23, 5, 14])
    try:
        steps = engine.steps
        alone = run(generate(engine, prompts[0], 20))[0]
        assert engine.steps - steps < 12  # 20 tokens in fewer steps: 1 prompt step + drafts of 4
        async def batch():
            return await asyncio.gather(*(generate(engine, p, 16) for p in prompts))
        together = [out for out, _ in run(batch())]
        drafted, kept = spec_stats(engine)
    finally:
        run(engine.stop())
    assert alone == hf_greedy(target, prompts[0], 20)
    assert together == [hf_greedy(target, p, 16) for p in prompts]
    assert drafted > 40 and kept == drafted  # greedy against itself: every guess holds
    assert (len(prompts), len(prompts)) in batched  # a guessing pass of the four sequences, one batch


@pytest.fixture(scope="module")
def pair(models):
    """The tiny Llama without drafts, and with the Qwen3 drafting for it."""
    target, draft = models
    plain, spec = small(target), small(target, speculative_config=draft_config(draft))
    yield plain, spec
    run(plain.stop())
    run(spec.stop())


@pytest.mark.parametrize("sampling", [
    {},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 1.2, "top_p": 0.9, "top_k": 50, "seed": 3, "presence_penalty": 0.5},
])
def test_another_draft_model_changes_no_output(pair, sampling):
    plain, spec = pair
    prompts = random_prompts(7, [6, 17, 11])

    async def batch(engine):
        return await asyncio.gather(*(generate(engine, p, 18, **sampling) for p in prompts))

    drafted_before, _ = spec_stats(spec)
    assert run(batch(spec)) == run(batch(plain))
    drafted, kept = spec_stats(spec)
    assert drafted > drafted_before and kept < drafted  # a random draft model: some guesses fail


def test_logprobs_are_those_without_drafts(pair):
    plain, spec = pair
    prompt = random_prompts(2, [12])[0]

    async def one(engine):
        req = EngineRequest("l", prompt, SamplingParams(temperature=0.0, logprobs=3), 10, ignore_eos=True)
        return [(s.token_ids, [(lp.logprob, [t for t, _ in lp.top]) for lp in s.logprobs])
                async for s in engine.generate(req)]

    def flat(steps):
        tokens = [t for ids, _ in steps for t in ids]
        entries = [e for _, lps in steps for e in lps]
        return tokens, entries

    (want, want_lp), (got, got_lp) = flat(run(one(plain))), flat(run(one(spec)))
    assert got == want
    assert [top for _, top in got_lp] == [top for _, top in want_lp]
    assert [lp for lp, _ in got_lp] == pytest.approx([lp for lp, _ in want_lp], abs=1e-4)


def test_preemption_under_a_tiny_budget_and_cancellation_with_drafts(models):
    target, draft = models
    prompts = random_prompts(9, [20, 13, 27, 9, 16, 22])
    plain = small(target)
    try:
        want = [run(generate(plain, p, 24))[0] for p in prompts]
    finally:
        run(plain.stop())
    tight = small(target, kv_cache_gb=0.00025, speculative_config=draft_config(draft))  # a few dozen blocks
    try:
        async def batch():
            return await asyncio.gather(*(generate(tight, p, 24) for p in prompts))
        got = [out for out, _ in run(batch())]
        assert tight.scheduler.preemptions > 0

        async def cancelled():
            async def first_tokens(p):
                req = EngineRequest("c", p, SamplingParams(temperature=0.0), 40, ignore_eos=True)
                async for _ in tight.generate(req):
                    return
            await asyncio.gather(*(first_tokens(p) for p in prompts))
            for _ in range(200):
                await asyncio.sleep(0.01)
                if tight.pool.num_used == 0:
                    break
        run(cancelled())
        assert tight.pool.num_used == 0
    finally:
        run(tight.stop())
    assert got == want


def test_the_budget_holds_both_caches(models):
    target, draft = models
    plain = small(target, kv_cache_gb=0.001)
    spec = small(target, kv_cache_gb=0.001, speculative_config=draft_config(draft))
    try:
        # Per block: the Llama's keys and values (2 layers x 2 heads x 16), the Qwen3's (2 x 2 x 24).
        assert spec.pool.num_blocks < plain.pool.num_blocks
        assert spec.stats()["kv_cache_bytes"] <= 0.001 * (1 << 30)
        assert spec.draft.kv.num_blocks == spec.kv.num_blocks
    finally:
        run(plain.stop())
        run(spec.stop())


def test_a_draft_model_with_another_tokenizer_is_refused(models, tmp_path):
    target, draft = models
    other = tmp_path / "other"
    shutil.copytree(draft, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    for entry in tokenizer["added_tokens"]:
        if entry["id"] == 0:
            entry["content"] = "<|renamed|>"
    vocab = tokenizer["model"]["vocab"]
    vocab["<|renamed|>"] = vocab.pop(next(t for t, i in vocab.items() if i == 0))
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="its tokenizer is not the model's"):
        small(target, speculative_config=draft_config(other))


def test_a_draft_model_of_learned_positions_serves_only_the_context_they_reach(models, tmp_path):
    """A GPT-2 draft whose table holds 256 positions: refused for the target's 512-token context
    (naming the setting), and under max_model_len 256 it drafts without changing the output."""
    from safetensors.torch import load_file, save_file

    target = models[0]
    gpt2 = tiny_checkpoint(tmp_path / "gpt2", "gpt2")
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "n_positions": 256}))
    state = load_file(str(gpt2 / "model.safetensors"))
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:256].clone()
    save_file(state, str(gpt2 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="its learned positions end at 256, short of the model's context of 512 tokens; "
                                         "set max_model_len to at most 256"):
        small(target, speculative_config=draft_config(gpt2))
    engine = small(target, max_model_len=256, speculative_config=draft_config(gpt2))
    try:
        prompt = random_prompts(5, (200,))[0]
        assert run(generate(engine, prompt, 40))[0] == hf_greedy(target, prompt, 40)
        drafted, _ = spec_stats(engine)
        assert drafted > 0
    finally:
        run(engine.stop())


@pytest.mark.parametrize("fields, message", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'method "draft_model" needs `model`'),
    ({"num_speculative_tokens": 3}, "`method` is required"),
    ({"method": "ngram", "model": "m", "num_speculative_tokens": 3}, '`model` is for method "draft_model"'),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     'prompt_lookup_min and prompt_lookup_max are for method "ngram"'),
])
def test_speculative_config_rules(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)


def test_a_model_without_a_method_is_a_draft_model_as_in_vllm():
    assert SpeculativeConfig(model="m", num_speculative_tokens=3).method == "draft_model"


def _draft_model(folder, max_catch_up, blocks=64, block_size=4):
    from backends.torch.draft import DraftModel
    from backends.torch.kv_cache import BlockPool, KVCache
    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM

    ckpt = load_checkpoint(folder)
    spec = ckpt.spec
    model = CausalLM.from_state_dict(spec, 256, ckpt.weights).eval()

    def cache():
        return KVCache.for_model(spec, blocks, block_size, torch.float32, torch.device("cpu"))

    draft = DraftModel(model, cache(), ckpt.tokenizer.vocab_size, torch.device("cpu"), max_catch_up)
    return draft, BlockPool(blocks, block_size, prefix_caching=False), cache


def _tracked(seq) -> int:
    """The positions the sequence's tracking says hold right draft keys (as propose reads it)."""
    valid = seq.draft_valid
    for drafted, token in zip(seq.draft_tail, seq.tokens[valid:]):
        if drafted != token:
            break
        valid += 1
    return valid


@pytest.mark.parametrize("max_catch_up", [512, 5])
def test_the_draft_keys_the_tracking_trusts_are_those_a_fresh_prefill_writes(models, max_catch_up):
    """Steps as the engine takes them: guesses, some kept and the rest refused (then their blocks
    trimmed), a token the model chose after them. At every step the draft keys and values at the
    positions the sequence's tracking trusts equal a prefill of its tokens from scratch; with a
    small catch-up cap the prompt takes several steps, undrafted meanwhile."""
    from backends.torch.sequence import Sequence

    _, folder = models
    draft, pool, cache = _draft_model(folder, max_catch_up)
    rng = torch.Generator().manual_seed(0)
    prompt = random_prompts(4, [23])[0]
    seq = Sequence(EngineRequest("d", prompt, SamplingParams(), 100), lambda _: None, pool.block_size)
    undrafted, checked = 0, 0
    for _ in range(14):
        n = len(seq.tokens)
        seq.num_computed = n - 1  # the model has every token's keys but the last one's
        seq.grow(pool, 1 + 3)
        (guess,) = draft.propose([(seq, 3)])
        undrafted += not guess
        kept = int(torch.randint(0, len(guess) + 1, (1,), generator=rng)) if guess else 0
        bonus = (guess[kept] + 1) % 1000 + 3 if kept < len(guess) else 7  # never the refused guess
        seq.tokens += guess[:kept] + [bonus]
        seq.num_computed = n + kept
        seq.trim(pool)
        trusted = _tracked(seq)
        if trusted:
            reference = _prefill(draft.model, cache(), seq.tokens[:trusted], pool.block_size)
            slots = torch.tensor([seq.block_table[p // pool.block_size] * pool.block_size + p % pool.block_size
                                  for p in range(trusted)])
            for layer in range(len(draft.kv.k)):
                torch.testing.assert_close(draft.kv.k[layer][slots], reference.k[layer][:trusted], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(draft.kv.v[layer][slots], reference.v[layer][:trusted], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 12
    # At 5 a step while the model adds one: 5, 10, 15, 20, 25 of 24 to 28 tokens; drafted at the sixth.
    assert undrafted == (0 if max_catch_up >= 24 else 5)


def _prefill(model, kv, tokens, block_size):
    """``tokens``' keys and values, computed in one pass into blocks 0, 1, ... of ``kv``."""
    from backends.torch.attention import AttentionMetadata, PrefillSpan

    n = len(tokens)
    ids, positions = torch.tensor(tokens), torch.arange(n)
    meta = AttentionMetadata(kv.k, kv.v, positions.clone(), prefills=[PrefillSpan(0, n, positions.clone(), None)])
    with torch.inference_mode():
        model(ids, positions, meta, torch.tensor([n - 1]))
    return kv


def test_a_failing_draft_model_costs_drafts_not_requests(pair, monkeypatch):
    plain, spec = pair
    prompt = random_prompts(11, [10])[0]
    calls = []

    def broken(items):
        calls.append(len(items))
        raise RuntimeError("draft on fire")

    monkeypatch.setattr(spec.draft, "propose", broken)
    assert run(generate(spec, prompt, 8)) == run(generate(plain, prompt, 8))
    # Tried at every decoding step with room for a draft (6 of 7: the last has none under
    # max_tokens), each of which then ran without drafts.
    assert len(calls) == 6
