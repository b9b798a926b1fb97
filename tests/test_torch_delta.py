"""Qwen3-Next and Qwen3.5: Gated DeltaNet linear attention beside gated attention, each sequence's
state in a slot of its own (:mod:`backends.torch.delta`, :mod:`backends.torch.state`). Greedy
output and prompt logprobs against transformers (Granite 4's Mamba2 hybrids too, whose own
tests are in test_torch_mamba.py), the chunked rule against the token-by-token one, what the
engine does with states (slots reused, preemption, cancelling, no prefix cache, memory), the
spec and what is refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from backends.torch.delta import DeltaShape, delta_rule_chunked, delta_rule_step
from backends.torch.graphs import DecodeGraphs
from backends.torch.model import ModelError, ModelSpec
from backends.torch.state import RecurrentState, StateSlots
from test_torch_engine import (
    assert_greedy_matches_transformers, assert_preemption_and_cancelling, engine_for, generate, random_prompts, run,
    small_steps_engine,
)
from test_torch_gemma import assert_prompt_logprobs_match_transformers, packed_torch_path_distance
from torch_models import assert_built_with_config_refused, hf_greedy, tiny_checkpoint, write_lora

ARCHS = ["qwen3_next", "qwen3_5-mm", "qwen3_5_moe-mm", "granite4-hybrid", "granite4-hybrid-moe", "nemotron_h",
         "nemotron_h-moe"]
"""Every model with per-sequence states: Gated DeltaNet's and Mamba2's (Granite 4's hybrids, Nemotron-H)."""


@pytest.fixture(scope="module", params=ARCHS)
def delta(request, tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("delta") / request.param, request.param)


@pytest.fixture(scope="module")
def next_folder(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("next") / "qwen3_next", "qwen3_next")


def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(delta):
    # Qwen: layers 0, 1 and 3 linear attention, layer 2 gated attention; Granite: layers 0, 2
    # and 3 Mamba2, layer 1 attention; Nemotron-H: Mamba2, MLP, attention, MLP or experts,
    # Mamba2, MLP blocks. Prompts of 5 to 40 tokens in 16-token steps: states
    # carried from chunk to chunk, decode rows beside prompt chunks.
    assert_greedy_matches_transformers(delta)


def test_a_long_prompt_in_one_step_matches_transformers(delta):
    """150 tokens in one step: the chunked rule (Mamba2's scan) over three blocks of 64, the last
    one partial."""
    prompt = random_prompts(4, (150,))[0]
    engine = engine_for(delta, max_batched_tokens=512)
    try:
        assert run(generate(engine, prompt, 12))[0] == hf_greedy(delta, prompt, 12)
    finally:
        run(engine.stop())


@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 0.01)])
def test_prompt_logprobs_match_transformers(delta, dtype, within):
    # Measured in float32: 1e-6 to 2e-6. In bfloat16 (the states and the rules in float32 on
    # both sides, the convolution rounded before its SiLU on both): Qwen3-Next 7e-7, Granite's
    # hybrids 5e-7; Qwen3.5 0.0015 in 16-token chunks (8e-7 in one step: the chunks' sums round
    # elsewhere), Qwen3.5-MoE 0.004 (an attention layer's output a bfloat16 rounding apart).
    # These tiny Qwen3.5 models are sensitive: transformers' own bfloat16 is 0.15 and 0.58
    # from its float32.
    assert_prompt_logprobs_match_transformers(delta, dtype, within)


def _random_rule_inputs(seed, heads, length, key_dim=8, value_dim=12):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(heads, length, key_dim, generator=gen), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(heads, length, key_dim, generator=gen), dim=-1)
    v = torch.randn(heads, length, value_dim, generator=gen)
    g = -torch.rand(heads, length, generator=gen) * 2  # decays from 1 down to e^-2 a token
    beta = torch.rand(heads, length, generator=gen)
    state = torch.randn(heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


def _token_by_token(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[1]):
        out, state = delta_rule_step(q[:, t][None], k[:, t][None], v[:, t][None], g[:, t][None], beta[:, t][None],
                                     state[None])
        outs.append(out[0])
        state = state[0]
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 64), (63, 64), (64, 64), (65, 64), (200, 64), (37, 8), (16, 4)])
def test_the_chunked_rule_is_the_token_by_token_rule(length, chunk):
    inputs = _random_rule_inputs(length, 3, length)
    out, state = delta_rule_chunked(*inputs, chunk=chunk)
    ref_out, ref_state = _token_by_token(*inputs)
    assert out.shape == ref_out.shape == (3, length, 12)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


def test_the_rule_in_two_pieces_is_the_rule_in_one():
    """A prompt in two chunks (the state handed from the first to the second) and in one."""
    q, k, v, g, beta, state = _random_rule_inputs(9, 2, 90)
    whole, end = delta_rule_chunked(q, k, v, g, beta, state)
    first, middle = delta_rule_chunked(q[:, :41], k[:, :41], v[:, :41], g[:, :41], beta[:, :41], state)
    second, end2 = delta_rule_chunked(q[:, 41:], k[:, 41:], v[:, 41:], g[:, 41:], beta[:, 41:], middle)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end2, end, atol=1e-5, rtol=1e-5)


def test_a_step_of_several_sequences_is_each_alone():
    q, k, v, g, beta, state = _random_rule_inputs(3, 4, 3)  # three sequences of 4 heads, a token each
    rows = [t.transpose(0, 1) for t in (q, k, v, g, beta)]  # [sequences, heads, ...]
    states = torch.stack([state, state * 2, -state])
    out, new = delta_rule_step(*rows, states)
    for i in range(3):
        one, alone = delta_rule_step(*(r[i : i + 1] for r in rows), states[i : i + 1])
        torch.testing.assert_close(out[i : i + 1], one)
        torch.testing.assert_close(new[i : i + 1], alone)


def test_states_are_slots_of_the_running_sequences_and_no_prefix_cache(next_folder):
    """Linear layers keep nothing a token: the KV blocks count the attention layer's keys and
    values alone, and the states of max_num_seqs sequences are set aside first. Two prompts
    sharing 32 tokens: nothing reported cached (a block's tokens do not give the state before
    them), the outputs those of the model."""
    engine = small_steps_engine(next_folder, max_num_seqs=3)
    try:
        kv = engine.kv
        assert [tuple(k.shape[1:]) for k in kv.k] == [(0, 0), (0, 0), (2, 16), (0, 0)]
        assert engine._block_bytes == 4 * (2 * 2 * 16) * 4  # blocks of 4, float32
        # 3 layers x 3 slots x (80 channels x 3 inputs + 4 heads x 8 x 12 float32)
        assert engine._state_bytes == 3 * 3 * (80 * 3 * 4 + 4 * 8 * 12 * 4)
        assert engine.pool.num_blocks == (int(0.05 * 2**30) - engine._state_bytes) // engine._block_bytes
        assert engine.states.ssm[2] is None and tuple(engine.states.ssm[0].shape) == (3, 4, 8, 12)
        assert engine.runner.graphs is None and engine.proposer is None and not engine.pool.prefix_caching
        assert "lora_adapters" not in engine.capabilities and engine.stats()["state_bytes"] == engine._state_bytes
        with pytest.raises(ValueError, match="decode graphs do not run models with linear-attention layers"):
            DecodeGraphs(engine.model, kv, max_batch=2, max_blocks=4, scratch_block=0, capture=False)
        shared = random_prompts(5, (32,))[0]
        prompts = [shared + [11, 12, 13], shared + [14, 15]]
        results = [run(generate(engine, p, 10)) for p in prompts]
        assert [cached for _, cached in results] == [0, 0]
        assert [out for out, _ in results] == [hf_greedy(next_folder, p, 10) for p in prompts]
        assert engine.scheduler.state_slots.num_free == 3
    finally:
        run(engine.stop())


def test_more_requests_than_slots_reuse_them_from_a_clean_state(next_folder):
    """Two slots for six requests at once: each waits for a slot, starts from a zeroed state
    (a reused slot's previous owner left its own there), and gives transformers' tokens."""
    prompts = random_prompts(6, (9, 30, 5, 17, 24, 12))
    engine = small_steps_engine(next_folder, max_num_seqs=2)

    async def all_at_once():
        return await asyncio.gather(*(generate(engine, p, 8) for p in prompts))

    try:
        got = [out for out, _ in run(all_at_once())]
        assert engine.scheduler.state_slots.num_free == 2
    finally:
        run(engine.stop())
    assert got == [hf_greedy(next_folder, p, 8) for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3_next", "granite4-hybrid"])
def test_preemption_and_cancelling_under_a_tiny_budget(arch, tmp_path):
    """12 blocks of 4 tokens for 5 sequences growing to 5 to 11 blocks: preempted sequences
    give their slots back, recompute their states from their tokens, and still give their full
    outputs; every block and slot is free after, and after 30 requests cancelled mid-generation."""
    folder = tiny_checkpoint(tmp_path / arch, arch)
    roomy = small_steps_engine(folder)
    tight = small_steps_engine(folder, kv_cache_gb=(roomy._state_bytes + 12 * roomy._block_bytes) / 2**30)
    try:
        assert_preemption_and_cancelling(
            roomy, tight, lambda engine: engine.pool.num_used == 0 and engine.scheduler.state_slots.num_free == 64)
    finally:
        run(tight.stop())
        run(roomy.stop())


def test_states_that_would_take_the_whole_budget_lower_max_num_seqs(next_folder):
    """64 sequences' states in a budget that holds 40 of them: max_num_seqs becomes 20 (half the
    budget), and the states and the scheduler's slots are sized so; a budget that holds less
    than two sequences' states is refused."""
    per_sequence = RecurrentState.bytes_for(ModelSpec.from_hf_config(SimpleNamespace(**_config())), 1, torch.float32)
    engine = small_steps_engine(next_folder, kv_cache_gb=40 * per_sequence / 2**30)
    try:
        assert engine.options.max_num_seqs == engine.scheduler.max_num_seqs == 20
        assert engine.states.ssm[0].shape[0] == 20 and engine.scheduler.state_slots.num_free == 20
        assert engine._state_bytes == 20 * per_sequence
        prompts = random_prompts(2, (9, 14))
        assert [run(generate(engine, p, 6))[0] for p in prompts] == [hf_greedy(next_folder, p, 6) for p in prompts]
    finally:
        run(engine.stop())
    with pytest.raises(ValueError, match="a sequence's linear-attention states take .* more than half the KV budget"):
        engine_for(next_folder, kv_cache_gb=1.5 * per_sequence / 2**30)


def test_state_slots_are_handed_out_once_each():
    slots = StateSlots(3)
    taken = [slots.take() for _ in range(3)]
    assert sorted(taken) == [0, 1, 2] and slots.num_free == 0
    with pytest.raises(MemoryError):
        slots.take()
    slots.give(taken[1])
    assert slots.take() == taken[1]


def test_reset_zeroes_only_the_given_slots():
    spec = ModelSpec.from_hf_config(SimpleNamespace(**_config()))
    states = RecurrentState.for_model(spec, 3, torch.float32, torch.device("cpu"))
    for t in (*states.conv, *states.ssm):
        if t is not None:
            t.fill_(1.0)
    states.reset(torch.tensor([0, 2]))
    assert states.conv[1][[0, 2]].abs().sum() == 0 and states.ssm[3][[0, 2]].abs().sum() == 0
    assert bool((states.conv[1][1] == 1).all()) and bool((states.ssm[3][1] == 1).all())


def _config(**changes):
    base = dict(model_type="qwen3_next", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1, moe_intermediate_size=24,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=0,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
    return {**base, **changes}


def test_qwen3_next_and_qwen3_5_specs():
    s = ModelSpec.from_hf_config(SimpleNamespace(**_config()))
    assert s.linear_layers == (0, 1, 3) and s.recurrent and s.gated_attention and s.qk_norm and s.offset_norms
    assert s.delta == DeltaShape(2, 4, 8, 12, 4) and s.delta.conv_size == 80 and s.rotary_dim == 4
    assert s.kv_entry(0) == dict(kv_heads=0, head_dim=0, values_in_keys=None)
    assert s.kv_entry(2) == dict(kv_heads=2, head_dim=16, values_in_keys=None)
    moe = ModelSpec.from_hf_config(SimpleNamespace(**_config(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                                             shared_expert_intermediate_size=32, mlp_only_layers=[0])))
    assert (moe.num_experts, moe.experts_per_token, moe.expert_size, moe.shared_expert_size) == (8, 2, 24, 32)
    assert moe.shared_expert_gated and not moe.normalize_routing and moe.dense_layers == (0,)
    # Qwen3.5's language model: its outer config says whether the embeddings are tied; its
    # experts always renormalise (its config has no norm_topk_prob).
    text = {k: v for k, v in _config(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                                     shared_expert_intermediate_size=32).items()
            if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings")}
    outer = SimpleNamespace(model_type="qwen3_5_moe", text_config=SimpleNamespace(**text), tie_word_embeddings=True)
    vl = ModelSpec.from_hf_config(outer)
    assert vl.tie_word_embeddings and vl.normalize_routing and vl.num_experts == 8 and vl.linear_layers == (0, 1, 3)


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]},
     "layer_types .* must name each of the 4 layers `linear_attention` or `full_attention`"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types .* must name each of the 4 layers"),
    ({"layer_types": ["linear_attention"] * 4}, "names no `full_attention` layer; a model of linear attention alone"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 must be a multiple of linear_num_key_heads 2"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim 0 must be a positive integer"),
    ({"linear_key_head_dim": None}, "linear_key_head_dim None must be a positive integer"),
])
def test_what_qwen3_next_configs_are_refused_for(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(SimpleNamespace(**_config(**changes)))


def test_int8_runs_as_torch_operations(next_folder):
    """The C step has no linear attention: under int8 the packed projections run as torch
    operations, near the float engine. Measured 0.17 (fp16 weights: 0.008): this tiny random
    model is sensitive (its bfloat16 logprobs are 0.22 from its float32 ones), and the
    in_proj of its linear layers the most (kept float: 0.07); a broken path is nats away."""
    assert packed_torch_path_distance(next_folder, "int8") < 0.3


def test_adapters_speculative_decoding_and_recurrent_draft_models_are_refused(next_folder, tmp_path):
    from transformers import AutoConfig

    from backends.peft import AdapterError
    from backends.torch import SpeculativeConfig
    from backends.torch.lora import load_adapter

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(next_folder), local_files_only=True))
    folder = write_lora(tmp_path / "a", next_folder, targets=("o_proj",))
    with pytest.raises(AdapterError, match=r"adapters of a model with linear-attention or Mamba layers \(Qwen3-Next"):
        load_adapter("a", folder, spec, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="speculative decoding is not supported for a model with linear-attention"):
        engine_for(next_folder, speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                                                     prompt_lookup_max=3))
    target = tiny_checkpoint(tmp_path / "llama", "llama-plain")
    with pytest.raises(ValueError, match="a draft model with linear-attention layers is not supported"):
        engine_for(target, speculative_config=SpeculativeConfig(method="draft_model", model=str(next_folder),
                                                                num_speculative_tokens=2))


@pytest.mark.parametrize("changes,message", [
    ({"linear_conv_kernel_dim": 3}, r"linear_attn.conv1d.weight` has shape \(80, 1, 4\), expected \(80, 1, 3\)"),
    # 2 x 16 + 2 x 40 rows where the checkpoint has 2 x 16 + 2 x 48
    ({"linear_value_head_dim": 10}, r"linear_attn.in_proj_qkvz.weight` has 128 rows; the config's linear_\* sizes make 112"),
])
def test_weights_of_other_shapes_than_the_config_are_refused(next_folder, tmp_path, changes, message):
    assert_built_with_config_refused(next_folder, tmp_path / "bad", changes, message)


def test_over_http_with_the_openai_sdk(next_folder, tmp_path):
    """A Qwen3-Next model served by the router: two greedy choices of one prompt (n = 2, each
    computing the prompt: no prefix cache to share it) equal to transformers' tokens, usage
    adding up with nothing cached, a stream of one chunk a token whose final usage agrees, and
    no runtime LoRA loading offered for it."""
    import httpx
    import openai

    from server import RouterProcess

    router = RouterProcess(f"""
[server]
runtime_lora_updating = true

[[models]]
name = "next"
backend = "torch"
path = "{next_folder}"
max_model_len = 256
kv_cache_gb = 0.05
block_size = 4
max_batched_tokens = 16
""", tmp_path)
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        prompt = random_prompts(8, (20,))[0]
        expected = hf_greedy(next_folder, prompt, 8)
        both = client.completions.create(model="next", prompt=prompt, max_tokens=8, temperature=0, n=2,
                                         logprobs=1, extra_body={"ignore_eos": True})
        assert [len(c.logprobs.tokens) for c in both.choices] == [8, 8]
        assert both.choices[0].text == both.choices[1].text
        assert both.usage.prompt_tokens == 20 and both.usage.completion_tokens == 16
        assert not (both.usage.prompt_tokens_details and both.usage.prompt_tokens_details.cached_tokens)
        ids = client.completions.create(model="next", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert ids.choices[0].token_ids == expected
        chunks = list(client.completions.create(model="next", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert len([t for t in texts if t]) >= 6 and "".join(texts) == both.choices[0].text
        assert chunks[-1].usage.completion_tokens == 8
        refused = httpx.post(router.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        assert refused.status_code == 400 and "take LoRA adapters" in refused.text
    finally:
        router.stop()
