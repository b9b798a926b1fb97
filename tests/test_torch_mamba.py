"""Granite 4's hybrids, Nemotron-H and Falcon-H1: Mamba2 layers beside attention, each sequence's state in a slot of its own
(:mod:`backends.torch.mamba`, :mod:`backends.torch.state`). The rule without its correction
against the token-by-token one, the states' layout, the spec and what is refused; greedy output,
prompt logprobs, preemption and cancelling are test_torch_delta.py's, for every model with
per-sequence states."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.torch.delta import delta_rule_chunked, delta_rule_step
from backends.torch.mamba import MambaShape
from backends.torch.model import CausalLM, ModelError, ModelSpec
from backends.torch.weights import scaled_rows
from router.engine import EngineRequest, SamplingParams
from test_torch_delta import _random_rule_inputs
from test_torch_engine import generate, random_prompts, run, small_steps_engine
from test_torch_gemma import packed_torch_path_distance
from torch_models import assert_built_with_config_refused, hf_greedy, tiny_checkpoint

@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("dense") / "granite4-hybrid", "granite4-hybrid")


@pytest.mark.parametrize("length,chunk", [(1, 64), (40, 64), (64, 64), (150, 64), (37, 8)])
def test_the_rule_without_correction_is_the_token_by_token_rule(length, chunk):
    q, k, v, g, _, state = _random_rule_inputs(length, 3, length)
    out, end = delta_rule_chunked(q, k, v, g, None, state, chunk=chunk)
    expected, s = [], state[None]
    for t in range(length):
        row, s = delta_rule_step(q[:, t][None], k[:, t][None], v[:, t][None], g[:, t][None], None, s)
        expected.append(row[0])
    torch.testing.assert_close(out, torch.stack(expected, dim=1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, s[0], atol=1e-4, rtol=1e-4)


def test_the_states_and_the_cache(dense):
    """Mamba layers keep nothing a token (the blocks hold the attention layer's keys and values
    alone) and a state a sequence: 3 taps of 192 channels, 4 heads of 16 x 32 in float32."""
    engine = small_steps_engine(dense, max_num_seqs=3)
    try:
        assert [tuple(k.shape[1:]) for k in engine.kv.k] == [(0, 0), (2, 16), (0, 0), (0, 0)]
        assert tuple(engine.states.conv[0].shape) == (9, 192, 3) and tuple(engine.states.ssm[3].shape) == (9, 4, 16, 32)
        assert engine._state_bytes == 3 * 9 * (192 * 3 * 4 + 4 * 16 * 32 * 4)  # 3 running, 6 kept (prefix cache)
        assert engine.runner.graphs is None and engine.pool.prefix_caching and engine.state_cache.count == 6
        prompts = random_prompts(6, (9, 30, 5, 17))
        assert [run(generate(engine, p, 8))[0] for p in prompts] == [hf_greedy(dense, p, 8) for p in prompts]
    finally:
        run(engine.stop())


def _config(**changes):
    base = dict(model_type="granitemoehybrid", vocab_size=100, hidden_size=64, intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, num_local_experts=0,
                shared_intermediate_size=40, position_embedding_type=None,
                layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_head="auto", mamba_d_conv=4,
                mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=[0.0, float("inf")])
    return SimpleNamespace(**{**base, **changes})


def test_granite4_hybrid_specs():
    s = ModelSpec.from_hf_config(_config())
    assert s.linear_layers == (0, 2, 3) and s.delta is None and s.recurrence is s.mamba
    assert s.mamba == MambaShape(4, 32, 2, 16, 4, True, False, (0.0, float("inf")))
    assert (s.mamba.inner, s.mamba.conv_size, s.mamba.state_shape) == (128, 192, (4, 16, 32))
    assert not s.gated_attention and s.nope_layers == (0, 1, 2, 3)
    limited = ModelSpec.from_hf_config(_config(time_step_limit=[0.001, 0.1], mamba_proj_bias=True))
    assert limited.mamba.dt_limit == (0.001, 0.1) and limited.mamba.proj_bias


@pytest.mark.parametrize("changes,message", [
    ({"mamba_n_groups": 3}, "mamba_n_heads 4 must be a multiple of mamba_n_groups 3"),
    ({"mamba_d_head": 24}, "mamba_d_head 24 times mamba_n_heads 4 must be mamba_expand . hidden_size, 128"),
    ({"mamba_d_state": 0}, "mamba_d_state 0 must be a positive integer"),
    ({"time_step_limit": [0.5, 0.1]}, r"time_step_limit \(0.5, 0.1\) must be two numbers, 0 <= low <= high"),
    ({"layer_types": ["linear_attention"] * 4}, "names no `attention` layer; a model of Mamba layers alone"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act `gelu_pytorch_tanh`: Granite 4's Mamba layers are supported with"),
])
def test_what_granite4_hybrid_configs_are_refused_for(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(_config(**changes))


def test_int8_runs_as_torch_operations(dense):
    """The C step has no Mamba layers: under int8 the packed projections run as torch
    operations, near the float engine (measured 0.002)."""
    assert packed_torch_path_distance(dense, "int8") < 0.1


def test_a_filter_of_another_shape_is_refused(dense, tmp_path):
    assert_built_with_config_refused(dense, tmp_path / "bad", {"mamba_d_conv": 3},
                                     r"mamba.conv1d.weight` has shape \(192, 1, 4\), expected \(192, 1, 3\)")


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("nemotron") / "nemotron_h-moe", "nemotron_h-moe")


def test_nemotron_blocks_keep_keys_and_values_in_their_attention_block_alone(nemotron):
    """Six blocks of one kind each: the cache holds the attention block's keys and values, the
    states the two Mamba2 blocks'; MLP and expert blocks keep nothing."""
    engine = small_steps_engine(nemotron, max_num_seqs=2)
    try:
        assert [tuple(k.shape[1:]) for k in engine.kv.k] == [(0, 0), (0, 0), (2, 16), (0, 0), (0, 0), (0, 0)]
        assert [t is not None for t in engine.states.ssm] == [True, False, False, False, True, False]
        assert [layer.block for layer in engine.model.layers] == ["mamba", "mlp", "attention", "moe", "mamba", "mlp"]
    finally:
        run(engine.stop())


def test_time_steps_are_held_within_time_step_limit_in_prompts(dense, tmp_path):
    """Granite with time_step_limit [2, inf] (most of the tiny model's time steps are below 2):
    transformers' output changes and the engine's with it: a prompt's time steps held at 2 or
    more, decoded tokens' not (transformers' one-token update ignores the limit, as mamba_ssm's
    does). A 29-token prompt again, from the state kept at 28: its last prompt token runs alone
    in a step, as decode rows do, and is still held (the same logprobs as the first time)."""
    import json
    import shutil

    folder = tmp_path / "floor"
    shutil.copytree(dense, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "time_step_limit": [2.0, 1e9]}))
    prompt, short = random_prompts(3, (30, 29))
    engine = small_steps_engine(folder)

    async def first_logprobs(prompt):
        request = EngineRequest("t", prompt, SamplingParams(temperature=0.0, logprobs=5), 1, ignore_eos=True)
        steps = [step async for step in engine.generate(request)]
        return steps[0].cached_tokens, steps[0].logprobs[0]

    try:
        got = run(generate(engine, prompt, 10))[0]
        (cold, fresh), (warm, again) = run(first_logprobs(short)), run(first_logprobs(short))
    finally:
        run(engine.stop())
    assert got == hf_greedy(folder, prompt, 10) != hf_greedy(dense, prompt, 10)
    assert (cold, warm) == (0, 28) and again.top[0][0] == fresh.top[0][0]
    assert abs(again.logprob - fresh.logprob) < 1e-5 and [t for t, _ in again.top] == [t for t, _ in fresh.top]


def _nemotron(**changes):
    base = dict(model_type="nemotron_h", vocab_size=100, hidden_size=64, num_hidden_layers=4,
                layers_block_type=["linear_attention", "mlp", "full_attention", "moe"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, mlp_hidden_act="relu2", mlp_bias=False,
                max_position_embeddings=4096, layer_norm_epsilon=1e-5, tie_word_embeddings=False, attention_bias=True,
                mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4, use_conv_bias=True,
                use_bias=False, time_step_min=0.001, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=24, moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5, n_group=2,
                topk_group=1, norm_topk_prob=True, moe_latent_size=None)
    return SimpleNamespace(**{**base, **changes})


def test_nemotron_h_specs():
    s = ModelSpec.from_hf_config(_nemotron())
    assert s.block_kinds == ("mamba", "mlp", "attention", "moe") and s.linear_layers == (0,)
    # time_step_limit as NVIDIA's code reads it (none here), not transformers 5's time_step_min floor
    assert s.mamba == MambaShape(4, 32, 2, 16, 4, True, False, (0.0, float("inf")))
    assert ModelSpec.from_hf_config(_nemotron(time_step_limit=[0.01, 1.0])).mamba.dt_limit == (0.01, 1.0)
    assert s.activation == "relu2" and s.float_norms and s.nope_layers == (0, 1, 2, 3) and s.rms_norm_eps == 1e-5
    assert not s.qkv_bias and not s.o_bias  # transformers' Nemotron-H has none, whatever attention_bias says
    assert (s.num_experts, s.experts_per_token, s.expert_size, s.shared_expert_size) == (8, 2, 24, 40)
    assert s.sigmoid_routing and s.routing_bias and s.float_router and s.routed_scale == 2.5
    assert s.expert_groups == (2, 1) and s.normalize_routing and not s.shared_expert_gated and s.dense_layers == (0, 1, 2)
    assert [s.kv_entry(i)["kv_heads"] for i in range(4)] == [0, 0, 2, 0]
    dense = ModelSpec.from_hf_config(_nemotron(layers_block_type=["mamba", "mlp", "attention", "mlp"]))
    assert dense.block_kinds == ("mamba", "mlp", "attention", "mlp") and not dense.is_moe
    # mlp_bias: the MLP blocks' and the shared expert's biases; routed experts never have any
    biased = CausalLM(ModelSpec.from_hf_config(_nemotron(mlp_bias=True)), 8)
    moe = biased.layers[3].mlp
    assert moe.experts[0].up_proj.bias is None and moe.shared_expert.up_proj.bias is not None
    assert biased.layers[1].mlp.down_proj.bias is not None


@pytest.mark.parametrize("changes,message", [
    ({"layers_block_type": ["linear_attention", "mlp", "conv", "moe"]}, "layers_block_type .* must name each of the 4"),
    ({"layers_block_type": ["linear_attention", "mlp", "mlp", "moe"]}, "names no `full_attention` layer"),
    ({"moe_latent_size": 32}, "moe_latent_size 32: experts in a latent space are not supported"),
    ({"mlp_hidden_act": "silu"}, "hidden_act `silu` is not supported"),
    ({"n_groups": 3}, "mamba_num_heads 4 must be a multiple of n_groups 3"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act `gelu` is not supported; supported: silu"),
])
def test_what_nemotron_h_configs_are_refused_for(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(_nemotron(**changes))


def test_nemotron_int8_runs_as_torch_operations(nemotron):
    """Its ungated experts and MLPs packed too: near the float engine (measured 0.01)."""
    assert packed_torch_path_distance(nemotron, "int8") < 0.1


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("falcon") / "falcon_h1", "falcon_h1")


def test_falcon_h1_layers_keep_keys_and_values_and_a_state_each(falcon):
    """Every Falcon-H1 layer runs attention and a Mamba2 mixer side by side: the cache holds
    both layers' keys and values (2 heads of 24), the states both layers' (3 taps of 160
    channels: 96 of x and 2 x 2 x 16 of B and C)."""
    engine = small_steps_engine(falcon, max_num_seqs=2)
    try:
        assert [tuple(k.shape[1:]) for k in engine.kv.k] == [(2, 24), (2, 24)]
        assert [tuple(c.shape[1:]) for c in engine.states.conv] == [(160, 3), (160, 3)]
        assert [layer.mamba is not None and layer.self_attn.rotates for layer in engine.model.layers] == [True, True]
    finally:
        run(engine.stop())


def _falcon(**changes):
    base = dict(model_type="falcon_h1", vocab_size=100, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope_theta=1e11, tie_word_embeddings=False, hidden_act="silu",
                attention_bias=False, mlp_bias=False, mamba_d_ssm=96, mamba_n_heads=4, mamba_d_head=24,
                mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
                mamba_proj_bias=False, mamba_rms_norm=False, mamba_norm_before_gate=True, projectors_bias=False,
                time_step_limit=(0.0, float("inf")), embedding_multiplier=1.0, lm_head_multiplier=1.0,
                mlp_multipliers=[1.0, 1.0], key_multiplier=1.0, attention_in_multiplier=1.0,
                attention_out_multiplier=1.0, ssm_multipliers=[1.0] * 5, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0)
    return SimpleNamespace(**{**base, **changes})


def test_falcon_h1_specs():
    s = ModelSpec.from_hf_config(_falcon())
    assert s.parallel_mamba and s.linear_layers == (0, 1, 2) and s.block_kinds == () and s.recurrence is s.mamba
    assert [s.kv_entry(i)["kv_heads"] for i in range(3)] == [2, 2, 2] and s.head_dim == 24
    # the width mamba_d_ssm (not mamba_expand * hidden_size); no norm; out_proj's bias by projectors_bias
    assert s.mamba == MambaShape(4, 24, 2, 16, 4, True, False, gate_norm=None, out_bias=False)
    assert s.weight_scales == () and s.embed_scale is None and s.logit_scale is None  # every multiplier 1
    normed = ModelSpec.from_hf_config(_falcon(mamba_rms_norm=True, projectors_bias=True, mamba_d_ssm=None,
                                              mamba_d_head="auto", mamba_n_heads=8))
    assert normed.mamba.gate_norm == "before_gate" and normed.mamba.has_out_bias and normed.mamba.inner == 128
    after = ModelSpec.from_hf_config(_falcon(mamba_rms_norm=True, mamba_norm_before_gate=False))
    assert after.mamba.gate_norm == "after_gate" and not after.mamba.has_out_bias
    scaled = ModelSpec.from_hf_config(_falcon(
        embedding_multiplier=5.5, lm_head_multiplier=0.04, mlp_multipliers=[0.9, 0.6], key_multiplier=0.4,
        attention_in_multiplier=1.0, attention_out_multiplier=0.9, ssm_multipliers=[0.35, 0.25, 0.5, 1.0, 0.3],
        ssm_in_multiplier=2.0, ssm_out_multiplier=0.25))
    assert scaled.embed_scale == 5.5 and scaled.logit_scale == 0.04
    assert dict(scaled.weight_scales) == {
        "self_attn.k_proj.weight": ((-1, 0.4),), "self_attn.k_proj.bias": ((-1, 0.4),),
        "self_attn.o_proj.weight": ((-1, 0.9),), "self_attn.o_proj.bias": ((-1, 0.9),),
        # z, x, B, C, the time steps; the input's factor on the weight's rows only
        "mamba.in_proj.weight": ((96, 0.7), (96, 0.5), (32, 1.0), (32, 2.0), (-1, 0.6)),
        "mamba.in_proj.bias": ((96, 0.35), (96, 0.25), (32, 0.5), (32, 1.0), (-1, 0.3)),
        "mamba.out_proj.weight": ((-1, 0.25),), "mamba.out_proj.bias": ((-1, 0.25),),
        "mlp.gate_proj.weight": ((-1, 0.9),), "mlp.gate_proj.bias": ((-1, 0.9),),
        "mlp.down_proj.weight": ((-1, 0.6),), "mlp.down_proj.bias": ((-1, 0.6),)}


@pytest.mark.parametrize("changes,message", [
    ({"mamba_d_head": 16}, r"mamba_d_head 16 times mamba_n_heads 4 must be the Mamba layers' width, 96 \(mamba_d_ssm"),
    ({"mamba_d_ssm": 0}, "mamba_d_ssm 0 must be a positive integer"),
    ({"mamba_n_groups": 3}, "mamba_n_heads 4 must be a multiple of mamba_n_groups 3"),
    ({"ssm_multipliers": [1.0] * 4}, r"ssm_multipliers \[1.0, 1.0, 1.0, 1.0\] must be a list of 5 numbers"),
    ({"mlp_multipliers": [1.0, "x"]}, "mlp_multipliers .* must be a list of 2 numbers"),
    ({"key_multiplier": -1.0}, "key_multiplier -1.0 must be a positive number"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act `gelu_pytorch_tanh`: Falcon-H1's Mamba layers are supported with"),
])
def test_what_falcon_h1_configs_are_refused_for(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(_falcon(**changes))


def test_rows_scale_by_section():
    weight = torch.ones(7, 2, dtype=torch.bfloat16)
    scaled = scaled_rows(weight, ((2, 0.5), (1, 3.0), (-1, 0.25)))
    assert scaled.dtype == torch.float32 and scaled[:, 0].tolist() == [0.5, 0.5, 3.0, 0.25, 0.25, 0.25, 0.25]
    assert scaled_rows(torch.ones(3), ((-1, 2.0),)).tolist() == [2.0, 2.0, 2.0]  # a bias


def test_falcon_h1_int8_runs_as_torch_operations(falcon):
    """Its multipliers folded into the weights before they are packed: near the float engine."""
    assert packed_torch_path_distance(falcon, "int8") < 0.1


def test_a_falcon_h1_checkpoint_with_fused_projections_is_refused(falcon):
    """Its multipliers scale q, k and v (gate and up) apart, by name: a fused q/k/v would load
    unscaled."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(falcon), local_files_only=True))
    state = load_file(str(falcon / "model.safetensors"))
    p = "model.layers.0.self_attn."
    state[p + "qkv_proj.weight"] = torch.cat([state.pop(p + f"{n}_proj.weight") for n in "qkv"])
    with pytest.raises(ModelError, match="weight `model.layers.0.self_attn.qkv_proj.weight`: a fused projection"):
        CausalLM.from_state_dict(spec, 8, state)
