"""The torch engine against Hugging Face transformers, and its memory bookkeeping."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from backends.torch import TorchConfig
from backends.torch.setup import build_engine
from router.engine import EngineError, EngineRequest, SamplingParams
from torch_models import hf_greedy, hf_greedy_stepwise, smollm2_folder, tiny_checkpoint

PROMPTS = [
    "<|im_start|>user\nWrite a story about a cat.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n",
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "<|im_start|>user\nTranslate 'good morning' to French.<|im_end|>\n<|im_start|>assistant\n",
]


def engine_for(path, **options):
    options = {"max_model_len": 512, "kv_cache_gb": 0.05, **options}
    cfg = TorchConfig(name="t", backend="torch", path=str(path), **options)
    return build_engine(cfg, path)


async def generate(engine, prompt, n, adapter=None, cache_salt=None, **sampling):
    req = EngineRequest("t", prompt, SamplingParams(**{"temperature": 0.0, **sampling}), n, ignore_eos=True,
                        adapter=adapter, cache_salt=cache_salt)
    out, cached = [], None
    async for step in engine.generate(req):
        out += step.token_ids
        if step.cached_tokens is not None:
            cached = step.cached_tokens
    return out, cached


def run(coro):
    return asyncio.run(coro)


def random_prompts(seed, lengths):
    """Prompts of random token ids (tiny random models have no text worth writing)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(length)] for length in lengths]


def generate_all(engine, prompts, n):
    """Every prompt at once (one continuous batch), greedy, ``n`` tokens each; the outputs."""
    async def all_at_once():
        return await asyncio.gather(*(generate(engine, p, n) for p in prompts))

    return [out for out, _ in run(all_at_once())]


def assert_prefix_hits_match_no_cache(folder, inspect=None):
    """Two prompts sharing 32 tokens through a small-steps engine: the second reports the 32
    cached and both give the tokens an engine without the prefix cache gives. ``inspect``:
    called with the caching engine before it generates."""
    shared = random_prompts(5, (32,))[0]
    prompts = [shared + [11, 12, 13], shared + [14, 15]]
    plain = small_steps_engine(folder, prefix_caching=False)
    try:
        expected = [run(generate(plain, p, 10))[0] for p in prompts]
    finally:
        run(plain.stop())
    engine = small_steps_engine(folder)
    try:
        if inspect is not None:
            inspect(engine)
        first, _ = run(generate(engine, prompts[0], 10))
        second, cached = run(generate(engine, prompts[1], 10))
    finally:
        run(engine.stop())
    assert cached == 32 and [first, second] == expected


def assert_preemption_and_cancelling(roomy, tight, idle=lambda engine: engine.pool.num_used == 0):
    """Five sequences growing to 5 to 11 blocks of 4 through ``tight`` (an engine of 12 such
    blocks) and ``roomy``: the same outputs, with preemptions in the tight one; then 30 requests
    cancelled mid-generation in the roomy one. ``idle``: whether an engine holds nothing (no
    block in use) once its requests are done, checked after each."""
    prompts = random_prompts(9, (9, 17, 5, 21, 13))
    lengths = [20, 12, 25, 8, 16]

    async def all_at_once(engine):
        return await asyncio.gather(*(generate(engine, p, n) for p, n in zip(prompts, lengths)))

    assert tight.pool.num_blocks == 12
    squeezed = run(all_at_once(tight))
    assert tight.scheduler.preemptions > 0
    assert [out for out, _ in squeezed] == [out for out, _ in run(all_at_once(roomy))]
    assert idle(tight)

    async def cancelled(engine, prompt):
        task = asyncio.ensure_future(generate(engine, prompt, 200))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def many(engine):
        await asyncio.gather(*(cancelled(engine, p) for p in random_prompts(3, [7, 15, 30] * 10)))

    run(many(roomy))
    for _ in range(100):  # the engine thread frees a cancelled sequence at its next step
        if idle(roomy):
            break
        run(asyncio.sleep(0.02))
    assert idle(roomy)


def small_steps_engine(folder, **options):
    """An engine of 16-token steps over blocks of 4: prompt chunks and decode rows share steps."""
    return engine_for(folder, block_size=4, max_batched_tokens=16, **options)


def assert_greedy_matches_transformers(folder):
    """Four prompts (5 to 40 tokens) of a float32 engine in small steps, one alone and all four in
    one batch: 20 greedy tokens each, transformers' own."""
    engine = small_steps_engine(folder)
    try:
        prompts = random_prompts(1, (5, 23, 40, 11))
        alone, _ = run(generate(engine, prompts[1], 20))
        batched = generate_all(engine, prompts, 20)
    finally:
        run(engine.stop())
    assert alone == hf_greedy(folder, prompts[1], 20)
    for ours, p in zip(batched, prompts):
        assert ours == hf_greedy(folder, p, 20)


@pytest.fixture(scope="module")
def smol():
    engine = engine_for(smollm2_folder())
    yield engine
    run(engine.stop())


@pytest.fixture(scope="module")
def smol_ids(smol):
    return [smol.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


LENGTHS = [24, 9, 17, 30, 5, 21, 13, 26]


def test_greedy_matches_transformers_alone(smol, smol_ids):
    folder = smollm2_folder()
    for ids, n in list(zip(smol_ids, LENGTHS))[:3]:
        ours, _ = run(generate(smol, ids, n))
        assert ours == hf_greedy(folder, ids, n)


def test_greedy_matches_transformers_in_a_mixed_batch_of_8(smol, smol_ids):
    folder = smollm2_folder()

    async def all_at_once():
        return await asyncio.gather(*(generate(smol, ids, n) for ids, n in zip(smol_ids, LENGTHS)))

    results = run(all_at_once())
    for (ours, _), ids, n in zip(results, smol_ids, LENGTHS):
        assert ours == hf_greedy(folder, ids, n), smol.tokenizer.decode(ids)


def test_a_16_bit_kv_cache_holds_twice_the_tokens_and_stays_with_float32(smol, smol_ids):
    """kv_cache_dtype = "float16" under the float32 model: the same budget holds twice the
    blocks, and greedy output stays with the float32 cache's. Measured: all 8 prompts agree on
    all 64 tokens (bfloat16: 7 of 8, one parting at 35); the bounds leave room for one near-tie."""
    half = engine_for(smollm2_folder(), kv_cache_dtype="float16")
    try:
        assert {t.dtype for t in (*half.kv.k, *half.kv.v)} == {torch.float16}
        full, halved = smol.stats(), half.stats()
        assert halved["kv_blocks_total"] // 2 == full["kv_blocks_total"]
        assert full["kv_cache_bytes"] <= 0.05 * 2**30 and halved["kv_cache_bytes"] <= 0.05 * 2**30
        want = generate_all(smol, smol_ids, 32)
        got = generate_all(half, smol_ids, 32)
    finally:
        run(half.stop())
    agree = [next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), 32) for ours, ref in zip(got, want)]
    assert min(agree) >= 16 and sum(a == 32 for a in agree) >= 7, agree


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama-odd", "qwen2-window", "qwen2-yarn", "qwen3",
                                  "phi3"])
def test_tiny_random_architectures_match_transformers(tmp_path, arch):
    # llama: llama3 rope; qwen2: qkv bias, tied embeddings; mistral: a window of 8 on every layer;
    # qwen2-window: on layer 1 only; qwen2-yarn: YaRN rope (factor 4); qwen3: query and key norms;
    # phi3: fused projections in the checkpoint, a window of 12.
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = engine_for(folder, block_size=4, max_batched_tokens=16)
    try:
        prompts = random_prompts(1, (5, 23, 40, 11))
        for ours, p in zip(generate_all(engine, prompts, 20), prompts):
            assert ours == hf_greedy(folder, p, 20)
    finally:
        run(engine.stop())


@pytest.mark.parametrize("arch", ["phi3-longrope", "llama-dynamic"])
def test_ropes_that_change_with_length_match_transformers_past_the_original_context(tmp_path, arch):
    # phi3-longrope: Phi-4-mini's rope (12 of 16 dimensions rotate; LongRoPE's long factors past
    # 32 positions); llama-dynamic: dynamic NTK past max_position_embeddings 32, serving 4x as
    # many. Prompts within the first 32 positions, outputs running past them; each position
    # rotates as transformers rotates it when it generates that token.
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = engine_for(folder, block_size=4, max_batched_tokens=16)
    try:
        assert engine.max_model_len == (512 if arch == "phi3-longrope" else 128)
        prompts = random_prompts(1, (5, 23, 30, 11))
        for ours, p in zip(generate_all(engine, prompts, 24), prompts):
            assert ours == hf_greedy_stepwise(folder, p, 24)
    finally:
        run(engine.stop())


def test_prefix_cache_hits_and_same_output(smol):
    system = "<|im_start|>system\n" + "You answer questions about geography with care. " * 20 + "<|im_end|>\n"
    q1 = smol.tokenizer.encode(system + "<|im_start|>user\nWhere is Peru?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    q2 = smol.tokenizer.encode(system + "<|im_start|>user\nWhere is Chad?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    run(generate(smol, q1, 4))
    cached_out, cached = run(generate(smol, q2, 12))
    assert cached >= 100 and cached % 16 == 0
    fresh = engine_for(smollm2_folder(), prefix_caching=False)
    try:
        plain_out, plain_cached = run(generate(fresh, q2, 12))
    finally:
        run(fresh.stop())
    assert plain_cached == 0 and plain_out == cached_out


def test_a_cache_salt_shares_prefix_cache_entries_only_with_the_same_salt(smol):
    system = "<|im_start|>system\n" + "You answer questions about rivers and their deltas. " * 20 + "<|im_end|>\n"
    prompt = smol.tokenizer.encode(system + "<|im_start|>user\nHow long is the Nile?<|im_end|>\n", add_special_tokens=False)
    first, none_first = run(generate(smol, prompt, 6))
    got = {}
    for step, salt in enumerate([None, "a", "a", "b", None, "b"]):
        out, got[step] = run(generate(smol, prompt, 6, cache_salt=salt))
        assert out == first
    # unsalted reuses unsalted; "a" finds nothing at first, then its own; "b" the same; the
    # unsalted entries are still there for unsalted requests
    assert none_first == 0 and got[1] == 0 and got[3] == 0
    assert min(got[0], got[2], got[4], got[5]) >= 100


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_correct(smol, smol_ids):
    # 8 blocks of 16 tokens for 6 sequences growing to ~5 blocks each: constant preemption.
    tight = engine_for(smollm2_folder(), kv_cache_gb=8 * 16 * 46080 / 2**30)
    assert tight.pool.num_blocks == 8
    lengths = [60, 50, 70, 40, 55, 45]
    try:
        async def all_at_once(engine):
            return await asyncio.gather(*(generate(engine, ids, n) for ids, n in zip(smol_ids, lengths)))

        squeezed = run(all_at_once(tight))
        assert tight.scheduler.preemptions > 0
        roomy = run(all_at_once(smol))
        assert [out for out, _ in squeezed] == [out for out, _ in roomy]
        assert tight.pool.num_used == 0
    finally:
        run(tight.stop())


def test_seeded_sampling_is_reproducible_whatever_the_batch(smol, smol_ids):
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    alone, _ = run(generate(smol, smol_ids[0], 20, **params))

    async def crowded():
        others = [generate(smol, ids, 20, temperature=1.0) for ids in smol_ids[1:6]]
        return await asyncio.gather(generate(smol, smol_ids[0], 20, **params), *others)

    assert run(crowded())[0][0] == alone


def test_a_thousand_cancelled_requests_leave_no_blocks_in_use(smol, smol_ids):
    async def cancel_many():
        async def one(i):
            req = EngineRequest(f"c{i}", smol_ids[i % 8], SamplingParams(temperature=1.0), 200, ignore_eos=True)
            gen = smol.generate(req)
            async for _ in gen:
                break  # first token, then the client goes away
            await gen.aclose()

        async def cancelled_while_waiting(i):
            task = asyncio.ensure_future(one(i))
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        jobs = [one(i) if i % 2 else cancelled_while_waiting(i) for i in range(1000)]
        for k in range(0, 1000, 100):
            await asyncio.gather(*jobs[k : k + 100])
        for _ in range(200):
            stats = smol.stats()
            if stats["running"] == 0 and stats["waiting"] == 0:
                break
            await asyncio.sleep(0.02)

    run(cancel_many())
    stats = smol.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0


def test_stop_token_ids_min_tokens_and_logprobs(smol, smol_ids):
    out, _ = run(generate(smol, smol_ids[1], 10))
    stop = out[2]

    async def with_stop():
        req = EngineRequest("s", smol_ids[1], SamplingParams(temperature=0.0, logprobs=2), 10,
                            stop_token_ids=frozenset({stop}), min_tokens=1)
        return [s async for s in smol.generate(req)]

    steps = run(with_stop())
    assert [t for s in steps for t in s.token_ids] == out[: out.index(stop) + 1]
    assert steps[-1].finish_reason == "stop" and steps[-1].stop_token == stop
    lp = steps[0].logprobs[0]
    assert len(lp.top) == 2 and lp.top[0][0] == out[0] and lp.logprob == pytest.approx(lp.top[0][1])


@pytest.mark.parametrize("method", ["schedule", "add"])
def test_a_failing_scheduler_fails_its_requests_instead_of_hanging_them(tmp_path, method):
    """A bug outside a step (here: scheduling, or taking in a new request, raises) ends the
    engine loop: the waiting request gets an EngineError naming it, and later requests are
    refused, where they would wait forever."""
    engine = engine_for(tiny_checkpoint(tmp_path / "llama", "llama-plain"))

    def broken(*args):
        raise RuntimeError("a scheduling bug")

    setattr(engine.scheduler, method, broken)
    try:
        with pytest.raises(EngineError, match="the engine stopped: RuntimeError: a scheduling bug"):
            run(asyncio.wait_for(generate(engine, [5, 6, 7], 4), 60))
        with pytest.raises(EngineError, match="the engine is shutting down"):
            run(generate(engine, [5, 6], 2))
    finally:
        run(engine.stop())


def test_cuda_without_an_index_names_the_current_device(monkeypatch):
    """``torch.cuda.set_device`` refuses a bare ``cuda`` (torch 2.11 on the H200): the engine's
    device always carries an index, the current device's, and an index past the GPUs is refused."""
    from backends.torch.setup import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda") == pick_device("auto") == torch.device("cuda", 1)
    assert pick_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="cuda:2.*has 2 CUDA device"):
        pick_device("cuda:2")
    assert pick_device("cpu") == torch.device("cpu")
