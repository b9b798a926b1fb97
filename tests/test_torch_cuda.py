"""The torch engine on a GPU: eager steps and CUDA graphs. Skipped where CUDA is not available
(CI has no GPU; run it on a GPU machine: ``pytest tests/test_torch_cuda.py``)."""

from __future__ import annotations


import pytest
import torch

from test_torch_delta import assert_kept_states_serve_a_repeat_and_a_next_turn
from test_torch_engine import engine_for, generate_all, random_prompts, run
from torch_models import hf_greedy, smollm2_folder, tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama-odd", "qwen2-window", "qwen2-yarn", "qwen3",
                                  "phi3", "gemma", "gemma2", "gemma3", "smollm3", "granite",
                                  "olmo2", "olmo3", "glm", "glm4", "ministral", "ministral3", "ernie4_5", "exaone4",
                                  "seed_oss", "granite4", "cohere", "cohere2"])
def test_float32_on_cuda_matches_transformers_on_the_cpu(tmp_path, arch, graphs):
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = engine_for(folder, device="cuda", dtype="float32", block_size=4, max_batched_tokens=16,
                        cuda_graphs=graphs, max_num_seqs=16)
    try:
        prompts = random_prompts(1, (5, 23, 40, 11, 17))
        outs = generate_all(engine, prompts, 20)
        for ours, p in zip(outs, prompts):
            assert ours == hf_greedy(folder, p, 20)
        if graphs:  # every shape captured at start-up, none failed
            g = engine.runner.graphs
            assert len(g.graphs) == len(g.shapes()) > 0 and not g.failed
        else:
            assert engine.runner.graphs is None
        assert engine.stats()["cuda_peak_allocated_bytes"] > 0
    finally:
        run(engine.stop())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "granitemoe", "olmoe", "glm4_moe", "dots1",
                                  "ernie4_5_moe", "minimax_m2", "granitemoeshared", "granite4-moe", "deepseek_v2",
                                  "deepseek_v2-groups", "deepseek_v3", "glm4_moe_lite", "lfm2", "qwen3_next",
                                  "qwen3_5-mm", "granite4-hybrid-moe", "falcon_h1"])
def test_models_without_decode_graphs_run_eagerly_on_cuda_and_match_transformers(tmp_path, arch):
    # Routing reads each expert's row count back to the host, which no graph can hold: with
    # cuda_graphs on, a MoE model's decode steps still run eagerly; LFM2's too (the static
    # path builds no convolution windows), and those with per-sequence states (Qwen3-Next, Qwen3.5,
    # OLMo Hybrid, Granite 4's hybrids, Bamba, Nemotron-H, Falcon-H1).
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = engine_for(folder, device="cuda", dtype="float32", block_size=4, max_batched_tokens=16, max_num_seqs=16)
    try:
        assert engine.runner.graphs is None
        prompts = random_prompts(1, (5, 23, 40, 11, 17))
        for ours, p in zip(generate_all(engine, prompts, 20), prompts):
            assert ours == hf_greedy(folder, p, 20)
    finally:
        run(engine.stop())


@pytest.mark.parametrize("arch", ["granite4-hybrid", "qwen3_next"])
def test_kept_states_on_cuda(tmp_path, arch):
    """The prefix cache of a model with per-sequence states on the GPU: a repeated prompt and a
    chat's next turn start from kept states (copied in and out of their slots on the device)
    and give transformers' tokens."""
    assert_kept_states_serve_a_repeat_and_a_next_turn(tiny_checkpoint(tmp_path / arch, arch), device="cuda",
                                                      dtype="float32")


def test_smollm2_bf16_graphs_and_eager_agree():
    folder = smollm2_folder()
    texts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):"]
    results = {}
    for graphs in (True, False):
        engine = engine_for(folder, device="cuda", cuda_graphs=graphs)
        try:
            ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
            outs = generate_all(engine, ids, 24)
            results[graphs] = outs
            assert "Paris" in engine.tokenizer.decode(outs[0])
        finally:
            run(engine.stop())
    # bf16 sums in other orders can part two greedy paths late; the first tokens must agree.
    for a, b in zip(results[True], results[False]):
        assert a[:8] == b[:8]


def test_a_float16_kv_cache_on_cuda_graphs_and_eager_agree(tmp_path):
    """kv_cache_dtype = "float16" under a float32 model on the GPU: graphs and eager steps round
    keys and values the same way, so their greedy tokens are the same."""
    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    prompts = random_prompts(2, (5, 23, 40, 11, 17))
    results = {}
    for graphs in (True, False):
        engine = engine_for(folder, device="cuda", dtype="float32", kv_cache_dtype="float16", block_size=4,
                            max_batched_tokens=16, cuda_graphs=graphs, max_num_seqs=16)
        try:
            assert engine.kv.k[0].dtype == torch.float16
            results[graphs] = generate_all(engine, prompts, 20)
        finally:
            run(engine.stop())
    assert results[True] == results[False]


def test_prompt_logprobs_on_cuda_match_transformers_on_the_cpu():
    from test_torch_prompt_logprobs import assert_matches_reference, scored

    folder = smollm2_folder()
    engine = engine_for(folder, device="cuda", dtype="float32", max_batched_tokens=32)
    try:
        text = "<|im_start|>system\n" + "You are a careful assistant who answers in one sentence. " * 5
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        _, entries, _ = run(scored(engine, prompt, k=2))
    finally:
        run(engine.stop())
    assert_matches_reference(entries, prompt, 2)


@pytest.mark.parametrize("graphs", [True, False])
def test_lora_adapters_on_cuda_match_transformers_with_them_merged(tmp_path, graphs):
    """Adapter rows run eagerly beside captured base-model decode steps; float32 on the GPU."""
    from test_torch_lora import all_at_once, engine_with
    from torch_models import merged_checkpoint, write_lora

    base = tiny_checkpoint(tmp_path / "llama", "llama")
    adapter = write_lora(tmp_path / "ad", base)
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    engine = engine_with(base, {"ad": adapter}, device="cuda", dtype="float32", cuda_graphs=graphs, max_num_seqs=16)
    try:
        prompts = random_prompts(1, (5, 23, 40, 11))
        jobs = [(p, a) for p in prompts for a in (None, "ad")]
        outs = all_at_once(engine, jobs, 16)
    finally:
        run(engine.stop())
    for (p, a), out in zip(jobs, outs):
        assert out == hf_greedy(base if a is None else merged, p, 16)


@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_drafts_on_cuda_match_transformers_on_the_cpu(tmp_path, graphs):
    """Steps with draft rows run eagerly beside captured decode steps; float32 on the GPU."""
    from backends.torch import SpeculativeConfig

    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = engine_for(folder, device="cuda", dtype="float32", block_size=4, max_batched_tokens=32,
                        cuda_graphs=graphs, max_num_seqs=16, speculative_config=ngram)
    try:
        prompts = [[5, 6, 7, 8, 9, 10] * 4, *random_prompts(1, (5, 23, 11))]
        outs = generate_all(engine, prompts, 20)
        for ours, p in zip(outs, prompts):
            assert ours == hf_greedy(folder, p, 20)
        assert engine.stats()["spec_accepted_tokens"] > 0
    finally:
        run(engine.stop())


@pytest.mark.parametrize("graphs", [True, False])
def test_predictions_on_cuda(tmp_path, graphs):
    """Without speculative_config a prediction is drafted from on eager steps, and not at all
    where decode steps replay graphs (a drafted step would run every sequence eagerly); the
    output is greedy transformers' either way."""
    from router.engine import EngineRequest, SamplingParams

    folder = tiny_checkpoint(tmp_path / "llama", "llama")
    engine = engine_for(folder, device="cuda", dtype="float32", block_size=4, max_batched_tokens=32,
                        cuda_graphs=graphs, max_num_seqs=16)
    try:
        prompt = random_prompts(3, (11,))[0]
        want = hf_greedy(folder, prompt, 20)

        async def predicted():
            req = EngineRequest("p", prompt, SamplingParams(temperature=0.0), 20, ignore_eos=True, prediction=want)
            return [step async for step in engine.generate(req)]

        steps = run(predicted())
        assert [t for s in steps for t in s.token_ids] == want
        kept = steps[-1].prediction_tokens[0]
        assert (engine.proposer is None and kept == 0) if graphs else kept >= 10
    finally:
        run(engine.stop())
