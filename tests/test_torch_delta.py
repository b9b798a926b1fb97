"""Qwen3-Next and Qwen3.5: Gated DeltaNet linear attention beside gated attention, each sequence's
state in a slot of its own (:mod:`backends.torch.delta`, :mod:`backends.torch.state`). Greedy
output and prompt logprobs against transformers (Granite 4's Mamba2 hybrids too, whose own
tests are in test_torch_mamba.py), the chunked rule against the token-by-token one, what the
engine does with states (slots reused, preemption, cancelling, the prefix cache's kept states,
memory), the spec and what is refused."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from backends.torch.attention import AttentionMetadata, PrefillSpan
from backends.torch.delta import DeltaShape, delta_rule_chunked, delta_rule_step, rule_over_step
from backends.torch.graphs import DecodeGraphs
from backends.torch.kv_cache import BlockPool
from backends.torch.model import ModelError, ModelSpec
from backends.torch.state import RecurrentState, StateCache, StateSlots, causal_conv, kept_boundary
from router.engine import EngineError
from test_torch_engine import (
    assert_greedy_matches_transformers, assert_preemption_and_cancelling, assert_prefix_hits_match_no_cache,
    engine_for, generate, random_prompts, run, small_steps_engine,
)
from test_torch_gemma import (assert_prompt_logprobs_match_transformers, distance, hf_prompt_logprobs,
                              packed_torch_path_distance, prompt_logprobs)
from torch_models import assert_built_with_config_refused, hf_greedy, tiny_checkpoint, write_lora

ARCHS = ["qwen3_next", "qwen3_5-mm", "qwen3_5_moe-mm", "granite4-hybrid", "granite4-hybrid-moe", "bamba", "nemotron_h",
         "nemotron_h-moe", "falcon_h1", "falcon_h1-norm", "olmo_hybrid"]
"""Every model with per-sequence states: Gated DeltaNet's (Qwen3-Next, Qwen3.5, OLMo Hybrid) and Mamba2's (Granite 4's
hybrids, Bamba, Nemotron-H, Falcon-H1)."""


@pytest.fixture(scope="module", params=ARCHS)
def delta(request, tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("delta") / request.param, request.param)


@pytest.fixture(scope="module")
def next_folder(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("next") / "qwen3_next", "qwen3_next")


def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(delta):
    # Qwen: layers 0, 1 and 3 linear attention, layer 2 gated attention; Granite and Bamba:
    # layers 0, 2 and 3 Mamba2, layer 1 attention; Nemotron-H: Mamba2, MLP, attention, MLP or experts,
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
    # from its float32. Falcon-H1's multipliers are folded into its weights, so its bfloat16
    # rounds elsewhere than transformers' (which multiplies activations): 0.013 and 0.018, where
    # transformers' own bfloat16 is 0.021 and 0.024 from its float32.
    if dtype == torch.bfloat16 and delta.name.startswith("falcon_h1"):
        within = 0.03
    # OLMo Hybrid's tiny model: 0.008, where transformers' own bfloat16 is 0.011 from its float32.
    if dtype == torch.bfloat16 and delta.name == "olmo_hybrid":
        within = 0.02
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


def test_states_are_slots_of_the_running_sequences_then_of_the_kept_ones(next_folder):
    """Linear layers keep nothing a token: the KV blocks count the attention layer's keys and
    values alone, and the states of max_num_seqs sequences are set aside first, then twice as
    many for the prefix cache's kept states. Two prompts sharing 32 tokens: the second starts from the
    state kept after them, the outputs those of the model."""
    engine = small_steps_engine(next_folder, max_num_seqs=3)
    try:
        kv = engine.kv
        assert [tuple(k.shape[1:]) for k in kv.k] == [(0, 0), (0, 0), (2, 16), (0, 0)]
        assert engine._block_bytes == 4 * (2 * 2 * 16) * 4  # blocks of 4, float32
        # 3 layers x (3 + 6) slots x (80 channels x 3 inputs + 4 heads x 8 x 12 float32)
        assert engine._state_bytes == 3 * 9 * (80 * 3 * 4 + 4 * 8 * 12 * 4)
        assert engine.pool.num_blocks == (int(0.05 * 2**30) - engine._state_bytes) // engine._block_bytes
        assert engine.states.ssm[2] is None and tuple(engine.states.ssm[0].shape) == (9, 4, 8, 12)
        assert engine.state_cache.count == 6 and engine.pool.prefix_caching
        assert engine.runner.graphs is None and engine.proposer is None
        assert "lora_adapters" not in engine.capabilities and engine.stats()["state_bytes"] == engine._state_bytes
        with pytest.raises(ValueError, match="decode graphs do not run models with linear-attention layers"):
            DecodeGraphs(engine.model, kv, max_batch=2, max_blocks=4, scratch_block=0, capture=False)
        shared = random_prompts(5, (32,))[0]
        prompts = [shared + [11, 12, 13], shared + [14, 15]]
        results = [run(generate(engine, p, 10)) for p in prompts]
        assert [cached for _, cached in results] == [0, 32]
        assert [out for out, _ in results] == [hf_greedy(next_folder, p, 10) for p in prompts]
        assert engine.scheduler.state_slots.num_free == 3
    finally:
        run(engine.stop())


def test_prefix_hits_start_from_the_kept_state(delta):
    """Every model with states: a prompt sharing 32 tokens with an earlier one reports them cached
    and gives the tokens of an engine without the prefix cache (which recomputes them)."""
    assert_prefix_hits_match_no_cache(delta)


def test_a_shared_system_prompt_seen_twice_keeps_its_state_where_its_blocks_end(delta):
    """Three prompts, one 38-token system prompt and 7 tokens of their own, each in one 64-token
    step with blocks of 4. The first keeps its state only at 44 (before its last token). The
    second finds the 36 tokens of shared blocks cached but no state there: it computes them and
    keeps the state at 36 too. The third and fourth start there. Every output transformers'."""
    system = random_prompts(21, (38,))[0]
    prompts = [system + tail for tail in random_prompts(22, (7, 7, 7, 7))]
    engine = engine_for(delta, block_size=4, max_batched_tokens=64, max_num_seqs=4)
    try:
        got = [run(generate(engine, p, 6)) for p in prompts]
        assert engine.stats()["cached_state_hits"] == 2
    finally:
        run(engine.stop())
    assert [cached for _, cached in got] == [0, 0, 36, 36]
    assert [out for out, _ in got] == [hf_greedy(delta, p, 6) for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_a_prompt_scoring_itself_keeps_a_shared_system_prompts_state_too(arch, tmp_path):
    """As above, the second prompt asking for its prompt's logprobs (so it skips no cached block:
    every position's logits score it): it still keeps the state where the shared blocks end, and
    the third starts there. Outputs transformers'; the scores the same as a lone engine's."""
    folder = tiny_checkpoint(tmp_path / arch, arch)
    system = random_prompts(21, (38,))[0]
    prompts = [system + tail for tail in random_prompts(22, (7, 7, 7))]
    engine = engine_for(folder, block_size=4, max_batched_tokens=64, max_num_seqs=4)
    try:
        first = run(generate(engine, prompts[0], 6))
        scored = run(prompt_logprobs(engine, prompts[1]))
        third = run(generate(engine, prompts[2], 6))
    finally:
        run(engine.stop())
    assert first[1] == 0 and third[1] == 36
    assert third[0] == hf_greedy(folder, prompts[2], 6)
    assert distance(scored, hf_prompt_logprobs(folder, prompts[1])) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_a_prompt_computed_in_one_step_keeps_its_state_before_its_last_token(arch, tmp_path):
    """A 35-token prompt in one 64-token step keeps the state at 32 as its layers pass it (the
    block boundary before its last token): the same prompt again starts from there. Then the
    next turn, the prompt and its output and more: it starts from the state its output left at
    52, the latest block boundary it reached (a sequence keeps only its latest past its prompt).
    Every output transformers'."""
    assert_kept_states_serve_a_repeat_and_a_next_turn(tiny_checkpoint(tmp_path / arch, arch))


def assert_kept_states_serve_a_repeat_and_a_next_turn(folder, **options):
    """The test above on any engine options (test_torch_cuda.py runs it on a GPU)."""
    engine = engine_for(folder, block_size=4, max_batched_tokens=64, max_num_seqs=4, **options)
    try:
        prompt = random_prompts(12, (35,))[0]
        first, cached = run(generate(engine, prompt, 20))
        assert cached == 0 and len(engine.state_cache) == 2  # at 32, and at 52 after the 20 tokens
        again, cached = run(generate(engine, prompt, 20))
        assert cached == 32 and again == first == hf_greedy(folder, prompt, 20)
        turn = prompt + first + [21, 22, 23]
        out, cached = run(generate(engine, turn, 8))
        assert cached == 52 and out == hf_greedy(folder, turn, 8)
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
    outputs; every block and slot is free after, and after 30 requests cancelled mid-generation
    (the roomy engine keeping states at block boundaries, the tight one without room for any)."""
    folder = tiny_checkpoint(tmp_path / arch, arch)
    roomy = small_steps_engine(folder)
    # 64 running states and 12 blocks: a quarter of what the states leave holds no state to keep.
    per_sequence = RecurrentState.bytes_for(roomy.model.spec, 1, torch.float32)
    tight = small_steps_engine(folder, kv_cache_gb=(64 * per_sequence + 12 * roomy._block_bytes) / 2**30)
    try:
        assert tight.state_cache is None and not tight.pool.prefix_caching and roomy.state_cache.count == 128
        assert_preemption_and_cancelling(
            roomy, tight, lambda engine: engine.pool.num_used == 0 and engine.scheduler.state_slots.num_free == 64)
    finally:
        run(tight.stop())
        run(roomy.stop())


@pytest.mark.parametrize("arch", ["qwen3_next", "granite4-hybrid"])
def test_preempted_sequences_start_again_from_their_kept_states(arch, tmp_path):
    """Four sequences of 20 to 35 prompt tokens and 50 output tokens through 4 slots, 8 kept
    states and 50 blocks of 4 (short of the ~75 they grow to): preempted ones start again from
    the states they kept (hits counted; the prompts share nothing), and every output is
    transformers'."""
    folder = tiny_checkpoint(tmp_path / arch, arch)
    engine = small_steps_engine(folder, max_num_seqs=4)
    # A tiny model's states are large beside its blocks: a budget of 50 blocks would keep no
    # state (a quarter of what the running states leave). The pool alone is made that small.
    engine.pool = engine.scheduler.pool = BlockPool(50, 4)
    prompts = random_prompts(13, (30, 25, 35, 20))

    async def all_at_once():
        return await asyncio.gather(*(generate(engine, p, 50) for p in prompts))

    try:
        assert engine.state_cache.count == 8
        got = [out for out, _ in run(all_at_once())]
        assert engine.scheduler.preemptions > 0 and engine.stats()["cached_state_hits"] > 0
    finally:
        run(engine.stop())
    assert got == [hf_greedy(folder, p, 50) for p in prompts]


def test_states_that_would_take_the_whole_budget_lower_max_num_seqs(next_folder):
    """64 sequences' states in a budget that holds 40 of them: max_num_seqs becomes 20 (half the
    budget), and the states and the scheduler's slots are sized so; a budget that holds less
    than two sequences' states is refused, and one that holds two has no prefix cache."""
    per_sequence = RecurrentState.bytes_for(ModelSpec.from_hf_config(SimpleNamespace(**_config())), 1, torch.float32)
    engine = small_steps_engine(next_folder, kv_cache_gb=40 * per_sequence / 2**30)
    try:
        assert engine.options.max_num_seqs == engine.scheduler.max_num_seqs == 20
        # the prefix cache's kept states: a quarter of the 20 sequences' states left, 5
        assert engine.states.ssm[0].shape[0] == 25 and engine.scheduler.state_slots.num_free == 20
        assert engine.state_cache.count == 5 and engine._state_bytes == 25 * per_sequence
        prompts = random_prompts(2, (9, 14))
        assert [run(generate(engine, p, 6))[0] for p in prompts] == [hf_greedy(next_folder, p, 6) for p in prompts]
    finally:
        run(engine.stop())
    with pytest.raises(ValueError, match="a sequence's linear-attention states take .* more than half the KV budget"):
        engine_for(next_folder, kv_cache_gb=1.5 * per_sequence / 2**30)
    engine = engine_for(next_folder, kv_cache_gb=2.5 * per_sequence / 2**30)
    try:
        assert engine.options.max_num_seqs == 1 and engine.state_cache is None and not engine.pool.prefix_caching
        assert engine.states.ssm[0].shape[0] == 1
    finally:
        run(engine.stop())


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


def test_olmo_hybrid_spec_and_each_layers_norms(tmp_path):
    """Its linear layers normalise each block's input (Llama's), its attention layer each block's
    output (OLMo 3's); beta doubled (linear_allow_neg_eigval), which moves transformers' own
    logprobs (so matching them shows it)."""
    from transformers import AutoConfig

    from test_torch_gemma import distance, hf_prompt_logprobs

    folder = tiny_checkpoint(tmp_path / "olmo_hybrid", "olmo_hybrid")
    s = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    assert s.linear_layers == (0, 1, 3) and s.prenorm_linear_layers and not s.input_norms and s.sandwich_norms
    assert s.delta.beta_scale == 2.0 and s.delta.norm_eps == 1e-5 and s.qk_norm_whole and not s.offset_norms
    assert not s.gated_attention and s.nope_layers == () and s.float_norms and s.float_rotary
    engine = engine_for(folder)
    try:
        layers = engine.model.layers
        assert [layer.input_layernorm is not None for layer in layers] == [True, True, False, True]
        assert [layer.attn_out_norm is not None for layer in layers] == [False, False, True, False]
        assert [layer.post_attention_layernorm is not None for layer in layers] == [True, True, False, True]
    finally:
        run(engine.stop())
    prompt = random_prompts(4, (40,))[0]
    assert distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, linear_allow_neg_eigval=False)) > 0.01


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
    """A Qwen3-Next model served by the router: two greedy choices of one prompt (n = 2) equal to
    transformers' tokens, usage adding up with nothing cached, the same prompt again with its
    first 16 tokens cached (the state kept there), a stream of one chunk a token whose final
    usage agrees, and no runtime LoRA loading offered for it."""
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
        assert ids.choices[0].token_ids == expected and ids.usage.prompt_tokens_details.cached_tokens == 16
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


def _kept_states(count=3):
    spec = ModelSpec.from_hf_config(SimpleNamespace(**_config()))
    states = RecurrentState.for_model(spec, 2 + count, torch.float32, torch.device("cpu"))
    for slot in range(2):  # the running slots: states 1 and 2
        states.ssm[0][slot] = slot + 1.0
        states.conv[0][slot] = slot + 1.0
    return states, StateCache(states, 2, count, torch.device("cpu"))


def test_kept_states_are_copies_found_by_block_hash():
    states, cache = _kept_states()
    cache.save([(0, 100, None), (1, 101, None)])
    assert len(cache) == 2 and cache.lookup(102) is None
    at = cache.lookup(101)
    assert at >= 2 and float(states.ssm[0][at].mean()) == 2.0 and float(states.conv[0][at].mean()) == 2.0
    states.ssm[0][1] = 7.0  # the sequence moves on; its kept copy does not
    assert float(states.ssm[0][at].mean()) == 2.0
    cache.restore([(cache.lookup(100), 1)])
    assert float(states.ssm[0][1].mean()) == 1.0 and float(states.conv[0][1].mean()) == 1.0
    assert float(states.ssm[0][0].mean()) == 1.0  # the other running slot untouched


def test_the_least_recently_used_kept_state_gives_way():
    states, cache = _kept_states(count=2)
    cache.save([(0, 100, None), (1, 101, None)])
    cache.lookup(100)  # used: 101 is now the oldest
    cache.save([(1, 102, None)])
    assert cache.lookup(101) is None and cache.lookup(100) is not None and len(cache) == 2
    assert float(states.ssm[0][cache.lookup(102)].mean()) == 2.0
    # More saves in one call than slots: the last ones stay, each in its own slot.
    cache.save([(0, 200, None), (1, 201, None), (0, 202, None)])
    assert cache.lookup(200) is None and len(cache) == 2
    assert [float(states.ssm[0][cache.lookup(h)].mean()) for h in (201, 202)] == [2.0, 1.0]


def test_a_generating_sequence_keeps_only_its_latest_state():
    states, cache = _kept_states(count=4)
    cache.save([(0, 100, None)])  # the prompt's
    cache.save([(1, 110, None)])
    cache.save([(1, 111, 110)])  # its next boundary replaces its previous one, in that slot
    assert cache.lookup(110) is None and cache.lookup(111) is not None and len(cache) == 2
    cache.save([(0, 120, None), (0, 121, None)])  # now full; another sequence's state is kept already,
    cache.save([(1, 121, 111)])  # marked used, and its previous copy is gone
    assert cache.lookup(111) is None and len(cache) == 3 and cache.lookup(100) is not None


@pytest.mark.parametrize("start, end, total, expected", [
    (0, 35, 35, 32),  # the whole prompt: the boundary before its last token
    (32, 35, 35, None),  # its rest: no boundary after 32
    (0, 18, 35, 16),  # a chunk inside the prompt: the last boundary it reaches
    (16, 34, 35, 32),
    (30, 35, 35, 32),
    (0, 32, 32, 28),  # a prompt of 32: the boundary before its last token is 28
    (0, 32, 40, 32),  # a chunk ending on a boundary keeps the state at its end
    (0, 3, 35, None),  # no boundary reached
    (0, 5, 5, 4),
    (0, 3, 3, None),
    (32, 33, 33, None),  # a decode row (after a step it is saved where it lands on a boundary)
])
def test_a_prompt_chunk_keeps_the_state_at_its_last_block_boundary(start, end, total, expected):
    assert kept_boundary(start, end, total, 4) == expected


def test_states_placed_for_a_step_that_failed_are_forgotten(next_folder):
    """A step whose forward raises after its prompt chunk's state was placed: nobody starts from
    that state later (the same prompt again reports nothing cached, and gives the model's tokens)."""
    engine = engine_for(next_folder, block_size=4, max_batched_tokens=64)
    model = engine.runner.model

    class FailsOnce:
        failed = False

        def __call__(self, *args):
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("a device error")
            return model(*args)

        def __getattr__(self, name):
            return getattr(model, name)

    prompt = random_prompts(14, (35,))[0]
    try:
        engine.runner.model = FailsOnce()
        with pytest.raises(EngineError, match="a device error"):
            run(generate(engine, prompt, 4))
        assert len(engine.state_cache) == 0
        out, cached = run(generate(engine, prompt, 4))
        # kept: at 32 by the prompt, at 36 by the first token's step
        assert cached == 0 and out == hf_greedy(next_folder, prompt, 4) and len(engine.state_cache) == 2
    finally:
        run(engine.stop())


@pytest.mark.parametrize("keeps", [(1,), (4,), (9,), (10,), (4, 9), (1, 10), (3, 4)])
def test_states_kept_inside_a_chunk_are_the_states_after_their_tokens(keeps):
    """The rule and the short convolution over a 10-token prompt chunk (rows 2 to 12 of a step,
    after two other rows) copy the state after the chunk's first ``keeps[i]`` tokens to slot
    ``2 + i``, and give the same outputs and final state as without keeping any."""
    q, k, v, g, beta, state = _random_rule_inputs(15, 2, 12)
    rows = lambda x: x.transpose(0, 1).contiguous()  # noqa: E731 - [tokens, heads, ...]
    span = PrefillSpan(2, 12, None, None, keeps=tuple((keep, 2 + i) for i, keep in enumerate(keeps)))
    meta = AttentionMetadata([], [], None, prefills=[span], state_slots=torch.tensor([0]))
    ssm = torch.stack([state, *(torch.zeros_like(state),) * 3])
    out = rule_over_step(*(rows(x) for x in (q, k, v, g, beta)), ssm, meta)
    part = lambda x, a, b: x[:, a:b]  # noqa: E731
    for i, keep in enumerate(keeps):
        _, at_keep = delta_rule_chunked(*(part(x, 2, 2 + keep) for x in (q, k, v, g, beta)), state)
        torch.testing.assert_close(ssm[2 + i], at_keep, atol=1e-5, rtol=1e-5)
    whole, end = delta_rule_chunked(*(part(x, 2, 12) for x in (q, k, v, g, beta)), state)
    torch.testing.assert_close(ssm[0], end, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2:12], whole.transpose(0, 1), atol=1e-5, rtol=1e-5)

    x = torch.randn(12, 6)
    taps = torch.randn(6, 4)
    conv_state = torch.randn(4, 6, 3)
    before = conv_state[0].clone()
    plain = causal_conv(x, taps, None, conv_state.clone(), dataclasses.replace(meta, prefills=[
        PrefillSpan(2, 12, None, None)]))
    got = causal_conv(x, taps, None, conv_state, meta)
    torch.testing.assert_close(got[2:12], plain[2:12])
    inputs = torch.cat((before, x[2:12].T), dim=-1)  # 3 earlier inputs, then the chunk's
    for i, keep in enumerate(keeps):
        torch.testing.assert_close(conv_state[2 + i], inputs[:, keep : keep + 3])
    torch.testing.assert_close(conv_state[0], inputs[:, -3:])


def test_no_two_copies_of_one_call_land_in_one_slot():
    """A save whose replaced copy another save of the same call just placed keeps that copy and
    takes another slot; a sequence meeting its own replaced copy again keeps it."""
    states, cache = _kept_states(count=3)
    cache.save([(0, 100, None), (1, 101, None)])
    cache.save([(0, 102, None), (1, 103, 102)])  # 102 placed by this call: not replaced
    assert cache.lookup(102) is not None and cache.lookup(103) is not None and cache.lookup(102) != cache.lookup(103)
    assert [float(states.ssm[0][cache.lookup(h)].mean()) for h in (102, 103)] == [1.0, 2.0]
    assert cache.lookup(100) is None  # the least recently used made room for 103
    cache.save([(1, 103, 103)])  # its own latest met again (a preempted sequence's recompute)
    assert cache.lookup(103) is not None and len(cache) == 3
