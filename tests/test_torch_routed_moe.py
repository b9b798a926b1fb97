"""Mixtures of experts that choose their experts by scores plus a learned bias, as DeepSeek-V3
routes: GLM-4.5 (``glm4_moe``: sigmoid scores in groups, a scaling factor, a shared expert, a
dense first layer, a partial rotary, q/k/v biases), dots.llm1 (``dots1``: the same with
Qwen3's attention, not renormalised), ERNIE 4.5's (softmax scores, a shared expert) and
MiniMax-M2 (sigmoid scores, query and key norms over whole projections with a partial rotary).
Greedy output and prompt logprobs against transformers, the C step against the packed torch
path, the routing itself against transformers' routers, and what the configs say."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.torch.model import ModelError, ModelSpec
from backends.torch.moe import SparseMoE
from test_torch_engine import assert_greedy_matches_transformers, random_prompts
from test_torch_gemma import assert_c_steps_match_the_torch_path, assert_prompt_logprobs_match_transformers, distance, hf_prompt_logprobs
from torch_models import hf_auto_class, tiny_checkpoint

ARCHS = ["glm4_moe", "dots1", "ernie4_5_moe", "minimax_m2", "solar_open", "exaone_moe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(checkpoints, arch):
    # glm4_moe: layer 1's 8 experts in 4 groups, 2 groups kept, 2 experts a token, weights
    # renormalised and times 2.5, plus a shared expert; a multi-token prediction layer in the
    # file, unread. dots1: 3 of 8 experts from 1 of 2 groups, not renormalised, times 1.5, 2
    # shared experts. ernie4_5_moe: 2 of 6 by softmax plus the bias, a shared expert.
    # minimax_m2: 2 of 4 by sigmoid plus the bias on both layers. solar_open: GLM-4.5's experts
    # (2 of 8 from 2 of 4 groups, times 2.5, a shared expert) on every layer, Llama's attention.
    # exaone_moe: the same experts from layer 1 on (mlp_layer_types), EXAONE 4's attention (layer 0
    # sliding over 8, layers 1 and 3 full without rotary) in Llama's blocks.
    assert_greedy_matches_transformers(checkpoints[arch])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 2e-3)])
def test_prompt_logprobs_match_transformers(checkpoints, arch, dtype, within):
    # The routers work in float32 under bfloat16 too (GLM-4.5's, dots.llm1's and ERNIE's, as
    # transformers keeps them): one rounded router logit can move a token to another expert.
    assert_prompt_logprobs_match_transformers(checkpoints[arch], dtype, within)


@pytest.mark.parametrize("arch,config", [
    ("glm4_moe", {"routed_scaling_factor": 1.0}),
    ("glm4_moe", {"n_group": 1, "topk_group": 1}),
    ("glm4_moe", {"use_qk_norm": False}),
    ("dots1", {"norm_topk_prob": True}),
    ("dots1", {"n_group": 1, "topk_group": 1}),
    ("solar_open", {"n_group": 1, "topk_group": 1}),
    ("exaone_moe", {"n_group": 1, "topk_group": 1}),
    ("exaone_moe", {"layer_types": ["full_attention"] * 4}),
    ("minimax_m2", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 1.0}}),
])
def test_the_tiny_configs_exercise_what_they_set(checkpoints, arch, config):
    # Each feature moves transformers' own float32 logprobs on these weights by at least 200
    # times what test_prompt_logprobs_match_transformers allows (measured: GLM-4.5's scaling
    # factor 0.040, its groups 0.061, its q/k norms 0.12; dots1's renormalising 0.098, its
    # groups 0.21; MiniMax-M2's partial rotary 0.31). (Shared experts and dense layers change
    # the weights' shapes; greedy and logprobs cover them.)
    folder = checkpoints[arch]
    prompt = random_prompts(7, (60,))[0]
    assert distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, **config)) > 0.02


def test_the_choice_bias_changes_choices(checkpoints):
    """Without its bias each of the four routers picks other experts for some tokens: the bias
    is read and used to choose (and only to choose: test_routing_matches_transformers_routers)."""
    from transformers import AutoModelForCausalLM

    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype=torch.float32, local_files_only=True)
        x = torch.randn(64, model.config.hidden_size)
        gate, bias = _router_and_bias(model)
        _, _, chosen = gate(x) if bias is None else gate(x, bias)
        with torch.no_grad():
            saved = (bias if bias is not None else _bias_of(gate)).clone()
            (bias if bias is not None else _bias_of(gate)).zero_()
        _, _, unbiased = gate(x) if bias is None else gate(x, bias)
        assert (chosen.sort(-1).values != unbiased.sort(-1).values).any(dim=-1).sum() >= 8, arch
        assert saved.abs().max() > 0.1


def _router_and_bias(model):
    for module in model.modules():
        if type(module).__name__.endswith("SparseMoeBlock") and hasattr(module, "e_score_correction_bias"):
            return module.gate, module.e_score_correction_bias  # MiniMax-M2 passes its bias to the router
        if type(module).__name__.endswith("SparseMoeBlock") and hasattr(module, "expert_bias"):
            return module.gate, module.expert_bias  # LFM2-MoE's, the same way
        if type(module).__name__.endswith(("TopkRouter", "TopKRouter")):
            return module, None
    raise AssertionError("no router")


def _bias_of(router):
    return router.moe_statics.e_score_correction_bias if hasattr(router, "moe_statics") else router.e_score_correction_bias


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_transformers_routers(checkpoints, arch, dtype):
    """Our SparseMoE.route on the loaded weights against transformers' router on the same rows:
    the same experts (as sets: transformers does not sort them) with the same weights. In
    bfloat16 too: GLM-4.5's, dots.llm1's and ERNIE's routers and biases stay float32,
    MiniMax-M2's are rounded (a float32 bias picks other experts for about 0.2% of rows)."""
    assert_routing_matches_transformers(checkpoints[arch], dtype)


def assert_routing_matches_transformers(folder, dtype):
    """SparseMoE.route on ``folder``'s first sparse layer against transformers' router on 4,000
    rows in ``dtype``: the same experts (as sets) with the same weights."""
    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM

    ref = hf_auto_class(folder).from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    ckpt = load_checkpoint(folder)
    ours = CausalLM.from_state_dict(ckpt.spec, 64, dict(ckpt.weights), dtype)
    moe = next(m for m in ours.modules() if isinstance(m, SparseMoE))
    gate, bias = _router_and_bias(ref)
    x = torch.randn(4000, ref.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        _, ref_weights, ref_chosen = gate(x) if bias is None else gate(x, bias)
        weights, chosen = moe.route(x)
    order, ref_order = chosen.argsort(-1), ref_chosen.argsort(-1)
    assert torch.equal(chosen.gather(1, order), ref_chosen.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order).float(), ref_weights.gather(1, ref_order).float(), atol=1e-6)


# hunyuan_moe and solar_open take float16 keys: with bfloat16 ones the two paths' differently rounded
# keys moved a near-tied router score to another expert at one position (0.0345 on solar_open's
# first token, every other within 0.0011; hunyuan_moe's flat tiny logits reordered), which says
# nothing of the C step. Mixtures of experts under bfloat16 keys stay covered by the other rows.
@pytest.mark.parametrize("arch,fmt,kv", [("glm4_moe", "int8", "auto"), ("glm4_moe", "int4", "bfloat16"),
                                         ("dots1", "int8", "auto"), ("dots1", "int4", "auto"),
                                         ("ernie4_5_moe", "int8", "auto"), ("ernie4_5_moe", "int4", "float16"),
                                         ("minimax_m2", "int8", "auto"), ("minimax_m2", "int4", "auto"),
                                         ("solar_open", "int8", "auto"), ("solar_open", "int4", "float16"),
                                         ("exaone_moe", "int8", "auto"), ("exaone_moe", "int4", "auto")])
def test_c_steps_match_the_packed_torch_path(checkpoints, arch, fmt, kv):
    """The one C call per step (the choice bias, the groups, sigmoid scores, the scaling factor,
    shared experts added ungated) gives the packed torch path's tokens, logprobs within 0.02."""
    assert_c_steps_match_the_torch_path(checkpoints[arch], weight_format=fmt, kv_cache_dtype=kv)


def _config(model_type, **changes):
    base = dict(model_type=model_type, vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False)
    return SimpleNamespace(**{**base, **changes})


GLM = dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
           topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
           partial_rotary_factor=0.5)


def test_glm4_moe_and_dots1_specs():
    s = ModelSpec.from_hf_config(_config("glm4_moe", **GLM))
    assert (s.num_experts, s.experts_per_token, s.expert_size, s.shared_expert_size) == (16, 4, 32, 32)
    assert s.sigmoid_routing and s.routing_bias and s.float_router and s.float_routing_weights
    assert (s.expert_groups, s.routed_scale, s.normalize_routing, s.dense_layers) == ((4, 2), 2.5, True, (0,))
    assert not s.shared_expert_gated and s.qkv_bias and not s.o_bias and s.rotary_dim == 8 and not s.qk_norm
    assert ModelSpec.from_hf_config(_config("glm4_moe", **{**GLM, "use_qk_norm": True})).qk_norm
    one = ModelSpec.from_hf_config(_config("glm4_moe", **{**GLM, "n_group": 1, "topk_group": 1,
                                                          "routed_scaling_factor": 1.0}))
    assert one.expert_groups is None and one.routed_scale is None  # nothing to do for them
    d = ModelSpec.from_hf_config(_config("dots1", **{**GLM, "attention_bias": False, "partial_rotary_factor": None,
                                                     "n_shared_experts": 2, "first_k_dense_replace": 3}))
    assert d.qk_norm and not d.qk_norm_whole and d.shared_expert_size == 64 and d.dense_layers == (0, 1, 2)
    assert d.sliding_window is None
    window = ModelSpec.from_hf_config(_config("dots1", **GLM, sliding_window=32, max_window_layers=2))
    assert [window.window_of(i) for i in range(4)] == [None, None, 32, 32]  # no use_sliding_window for dots1


@pytest.mark.parametrize("changes,why", [
    ({"n_group": 3}, "n_group 3 and topk_group 2 do not fit 16 experts"),
    ({"n_group": 16, "topk_group": 4}, "n_group 16 and topk_group 4 do not fit 16 experts"),  # 1 expert a group
    ({"topk_group": 5}, "n_group 4 and topk_group 5 do not fit"),
    ({"topk_group": 1, "num_experts_per_tok": 5}, "topk_group 1 do not fit 16 experts, 5 a token"),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor -1.0 must be a positive number"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok 0 must be from 1 to the number of experts, 16"),
])
def test_glm4_moe_routing_refusals(changes, why):
    with pytest.raises(ModelError, match=why):
        ModelSpec.from_hf_config(_config("glm4_moe", **{**GLM, **changes}))


def test_ernie_and_minimax_specs():
    ernie = dict(moe_num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_num_shared_experts=2,
                 moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1, use_bias=False)
    s = ModelSpec.from_hf_config(_config("ernie4_5_moe", **ernie))
    assert s.dense_layers == (0,) and s.shared_expert_size == 32 and s.normalize_routing and s.routing_bias
    assert not s.sigmoid_routing and s.float_router and not s.float_routing_weights and s.expert_groups is None
    assert s.interleaved_rotary and s.float_rotary and not s.qkv_bias
    every2 = ModelSpec.from_hf_config(_config("ernie4_5_moe", **{**ernie, "moe_layer_interval": 2,
                                                                "moe_layer_end_index": 2}))
    assert every2.dense_layers == (0, 2, 3)  # sparse: (i + 1) % 2 == 0 from 1 to 2
    with pytest.raises(ModelError, match="use_bias: ERNIE 4.5's mixture of experts with biases is not supported"):
        ModelSpec.from_hf_config(_config("ernie4_5_moe", **{**ernie, "use_bias": True}))
    dense = ModelSpec.from_hf_config(_config("ernie4_5", use_bias=True))
    assert dense.qkv_bias and dense.o_bias and dense.mlp_bias and dense.interleaved_rotary and not dense.is_moe
    m = ModelSpec.from_hf_config(_config("minimax_m2", num_local_experts=8, num_experts_per_tok=2, head_dim=32,
                                         partial_rotary_factor=0.5))
    assert m.qk_norm_whole and m.rotary_dim == 16 and m.sigmoid_routing and m.normalize_routing
    assert not m.float_router and m.float_routing_weights and m.shared_expert_size == 0 and m.dense_layers == ()
