"""Decode steps on static, padded buffers (the shapes CUDA graphs replay), run eagerly on the CPU.

A captured graph replays exactly the kernels of :meth:`DecodeGraphs._forward`; what can go wrong
is in the padding: batch and context buckets, the scratch block padding rows write to, the masks.
These tests run that path without capturing (``decode_graphs = "eager"``) and hold it to the
engine's ordinary path and to transformers.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from backends.torch.engine import EngineOptions, TorchEngine
from backends.torch.graphs import DecodeGraphs, batch_buckets, block_buckets
from backends.torch.loader import load_checkpoint
from test_torch_engine import LENGTHS, engine_for, generate, generate_all, random_prompts, run
from torch_models import hf_greedy, hf_greedy_stepwise, smollm2_folder, tiny_checkpoint


def static_engine(folder, **options):
    opts = dict(device=torch.device("cpu"), dtype=torch.float32, max_model_len=512,
                kv_cache_bytes=int(0.05 * 2**30), decode_graphs="eager")
    return TorchEngine(lambda: load_checkpoint(folder), EngineOptions(**{**opts, **options}))


def counting(engine):
    """Record the (batch, blocks) bucket of every step the static path runs."""
    graphs = engine.runner.graphs
    shapes = []
    logits = graphs.logits

    def counted(step, shape):
        shapes.append((len(step.work), shape))
        return logits(step, shape)

    graphs.logits = counted
    return shapes


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert block_buckets(1) == [1]
    assert block_buckets(8) == [1, 2, 4, 8]
    assert block_buckets(13) == [1, 2, 4, 8, 13]


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "mistral", "llama-odd", "qwen2-window", "qwen3", "phi3-longrope", "gemma2", "gemma3",
            "smollm3", "granite", "olmo2", "olmo3", "glm4", "ministral3", "ernie4_5", "exaone4", "granite4",
            "deepseek_v2", "deepseek_v3", "cohere", "cohere2", "gemma4", "gemma4-e"]
)
def test_static_decode_matches_transformers_in_a_padded_batch(tmp_path, arch):
    # 5 sequences (padded to 8 rows), contexts from 5 to 60 tokens in blocks of 4 (buckets of
    # 2 to 16 blocks); mistral's sliding window of 8 masks inside the padded context (qwen2-window:
    # on one layer, the other attends to all of it); phi3-longrope: a partial rotary whose
    # factors change past 32 positions (prompts within them, transformers one token at a time);
    # gemma2: capped scores (attention written out, masked where padded); gemma3: the sliding
    # layer's own rotary tables; smollm3: a layer without rotary; granite: scaled block outputs;
    # olmo2: no input norms, whole-projection query and key norms; olmo3: its sliding layer;
    # glm4: interleaved rotary pairs on half of each head; ministral3: queries scaled by position
    # past 32 (a table the static path indexes as the eager one does); ernie4_5: interleaved
    # pairs over whole heads, rotated in float32; exaone4: output norms only, a layer without rotary;
    # deepseek_v2 and v3: latent attention (one cached head, values its first dimensions);
    # cohere: parallel blocks, per-head q/k norm weights; cohere2: a sliding layer, a NoPE one;
    # gemma4: layers of two head sizes; gemma4-e: per-layer embeddings, layers reading earlier ones' caches.
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = static_engine(folder, block_size=4, max_batched_tokens=16, max_num_seqs=16)
    shapes = counting(engine)
    longrope = arch == "phi3-longrope"
    try:
        prompts = random_prompts(1, (5, 23, 30 if longrope else 40, 11, 17))
        reference = hf_greedy_stepwise if longrope else hf_greedy
        for ours, p in zip(generate_all(engine, prompts, 20), prompts):
            assert ours == reference(folder, p, 20)
    finally:
        run(engine.stop())
    assert len(shapes) >= 19
    assert any(n == 5 and batch == 8 for n, (batch, _) in shapes)  # three padding rows
    assert 16 in {blocks for _, (_, blocks) in shapes}  # 10 to 15 blocks, padded
    assert all(batch >= n for n, (batch, _) in shapes)


def test_static_decode_matches_the_eager_engine_on_smollm2():
    folder = smollm2_folder()
    plain = engine_for(folder)
    static = static_engine(folder, max_num_seqs=64)
    shapes = counting(static)
    tokenizer = plain.tokenizer
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "Red, green and"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    try:
        async def all_at_once(engine):
            return await asyncio.gather(*(generate(engine, p, n) for p, n in zip(ids, LENGTHS)))

        assert [o for o, _ in run(all_at_once(static))] == [o for o, _ in run(all_at_once(plain))]
        alone, _ = run(generate(static, ids[0], 12))
        assert alone == hf_greedy(folder, ids[0], 12)
    finally:
        run(plain.stop())
        run(static.stop())
    assert any(batch == 8 and n == 6 for n, (batch, _) in shapes)
    assert any(batch == 1 for _, (batch, _) in shapes)


def test_static_decode_with_a_16_bit_cache_matches_the_eager_engine(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    options = dict(block_size=4, max_batched_tokens=16, max_num_seqs=16)
    static = static_engine(folder, kv_dtype=torch.float16, **options)
    eager = engine_for(folder, kv_cache_dtype="float16", **options)
    shapes = counting(static)
    try:
        assert static.kv.k[0].dtype == torch.float16
        prompts = random_prompts(4, (5, 23, 40, 11, 17))
        assert generate_all(static, prompts, 20) == generate_all(eager, prompts, 20)
    finally:
        run(static.stop())
        run(eager.stop())
    assert len(shapes) >= 19


def test_the_scratch_block_is_outside_the_pool_and_no_block_leaks(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    engine = static_engine(folder, block_size=4, max_batched_tokens=16)
    try:
        graphs = engine.runner.graphs
        assert engine.kv.num_blocks == engine.pool.num_blocks + 1
        assert graphs.scratch_block == engine.pool.num_blocks
        assert engine.max_model_len <= engine.pool.num_blocks * 4
        seen = set()
        allocate = engine.pool.allocate

        def watched():
            block = allocate()
            seen.add(block)
            return block

        engine.pool.allocate = watched

        async def some():
            return await asyncio.gather(*(generate(engine, [5 + i] * (3 + 7 * i), 15) for i in range(6)))

        run(some())
        assert seen and graphs.scratch_block not in seen
        assert engine.pool.num_used == 0
        assert engine.stats()["kv_cache_bytes"] == engine.kv.num_blocks * engine._block_bytes
    finally:
        run(engine.stop())


def test_steps_outside_the_buckets_run_eagerly(tmp_path):
    folder = tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    engine = static_engine(folder, block_size=4, max_batched_tokens=64, max_num_seqs=4)
    graphs = engine.runner.graphs
    try:
        # Room for 16 gathered key positions: 2 sequences over 2 blocks, until they outgrow them.
        small = DecodeGraphs(engine.model, engine.kv, max_batch=4, max_blocks=graphs.blocks[-1],
                             scratch_block=graphs.scratch_block, capture=False, max_gather=16)
        engine.runner.graphs = small
        shapes = counting(engine)

        async def two():
            return await asyncio.gather(generate(engine, [7] * 3, 10), generate(engine, [9] * 4, 10))

        outs = run(two())
        assert shapes and all(batch * blocks * 4 <= 16 for _, (batch, blocks) in shapes)
        assert len(shapes) < 18  # the longer contexts ran eagerly
        engine.runner.graphs = None
        assert [o for o, _ in outs] == [o for o, _ in run(two())]
    finally:
        run(engine.stop())


def test_capture_needs_cuda_and_the_scratch_block_must_exist(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    engine = static_engine(folder, block_size=4)
    try:
        with pytest.raises(ValueError, match="CUDA"):
            DecodeGraphs(engine.model, engine.kv, max_batch=4, max_blocks=4, scratch_block=0, capture=True)
        with pytest.raises(ValueError, match="outside"):
            DecodeGraphs(engine.model, engine.kv, max_batch=4, max_blocks=4,
                         scratch_block=engine.kv.num_blocks, capture=False)
    finally:
        run(engine.stop())


def test_a_shape_that_will_not_capture_runs_eagerly_from_then_on(tmp_path, caplog):
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    engine = static_engine(folder, block_size=4)
    graphs = engine.runner.graphs
    attempts = []

    def broken(batch, blocks):
        attempts.append((batch, blocks))
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    graphs.capture = True  # as on CUDA, with a capture that always fails
    graphs._capture = broken
    try:
        outs = run(generate(engine, [5, 6, 7], 12))[0]
        graphs.capture, engine.runner.graphs = False, None
        assert outs == run(generate(engine, [5, 6, 7], 12))[0]  # the eager path gave the same
    finally:
        run(engine.stop())
    assert attempts and len(attempts) == len(set(attempts))  # each shape tried once, not every step
    assert set(attempts) == graphs.failed
    assert "not captured, runs eagerly" in caplog.text


def test_adapter_rows_leave_the_static_path_and_base_rows_keep_it(tmp_path):
    """Static (graph) steps know only the base weights: a step with LoRA rows runs eagerly, a
    base-only step still runs static; both match transformers (the adapter merged for its rows)."""
    from test_torch_lora import all_at_once
    from torch_models import merged_checkpoint, write_lora

    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    adapter = write_lora(tmp_path / "ad", folder)
    merged = merged_checkpoint(folder, adapter, tmp_path / "merged")
    engine = static_engine(folder, block_size=4, max_batched_tokens=16, lora_modules={"ad": adapter})
    try:
        shapes = counting(engine)
        prompts = random_prompts(9, (6, 14))
        base_only = all_at_once(engine, [(p, None) for p in prompts], 12)
        static_steps = len(shapes)
        jobs = [(p, a) for p in prompts for a in (None, "ad")]
        mixed = all_at_once(engine, jobs, 12)
    finally:
        run(engine.stop())
    assert static_steps >= 11 and len(shapes) == static_steps  # no static step once adapter rows ran
    assert base_only == [hf_greedy(folder, p, 12) for p in prompts]
    assert mixed == [hf_greedy(folder if a is None else merged, p, 12) for p, a in jobs]
