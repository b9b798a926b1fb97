"""Multi-head latent attention (MLA): DeepSeek-V2 (V2-Lite's shape, and V2's with a query
bottleneck, expert groups and YaRN), DeepSeek-V3 (interleaved rotary pairs, YaRN's scale on
the scores, biased sigmoid routing in groups) and GLM-4.7-Flash (``glm4_moe_lite``: V3's
attention with rotate-half pairs). Greedy output and prompt logprobs against transformers, the
cache's one-tensor layout, the routers against transformers', what the configs say and what is
refused."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from backends.torch.latent import LatentShape, latent_scale
from backends.torch.model import ModelError, ModelSpec
from test_torch_engine import assert_greedy_matches_transformers, assert_prefix_hits_match_no_cache, random_prompts
from test_torch_gemma import distance, engine_prompt_logprobs, hf_prompt_logprobs, packed_torch_path_distance
from test_torch_routed_moe import assert_routing_matches_transformers
from torch_models import LATENT_ARCHS, tiny_checkpoint, write_lora

ARCHS = (*LATENT_ARCHS, "youtu")  # Youtu-LLM: V3's latent attention over dense MLPs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("latent")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(checkpoints, arch):
    # Four prompts of 5 to 40 tokens in 8-token steps over blocks of 4: prefill chunks over the
    # cached latents of earlier chunks, then decode steps of four sequences of other lengths.
    assert_greedy_matches_transformers(checkpoints[arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers_in_float32(checkpoints, arch):
    # The absorbed products (queries carried into the latent's space) are transformers' own in
    # another order: measured within 1.3e-6. Within 1e-5, which the latent norms' epsilon
    # (1e-5 instead of 1e-6) exceeds: 1.7e-5.
    prompt, got = engine_prompt_logprobs(checkpoints[arch])
    assert distance(got, hf_prompt_logprobs(checkpoints[arch], prompt)) < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_in_bfloat16_are_as_close_as_bfloat16_allows(checkpoints, arch):
    """In bfloat16 the other order rounds elsewhere: measured against transformers' bfloat16
    forward, 0.004 to 0.008 at the worst position, where transformers' own bfloat16 is 0.005 to
    0.009 from its float32. A token whose experts (or groups) score within a rounding of each
    other can go elsewhere in one of the two (seen once, 0.06, with other random weights). So:
    every position but the worst within 0.015, the worst within 0.1."""
    prompt, got = engine_prompt_logprobs(checkpoints[arch], torch.bfloat16)
    ref = hf_prompt_logprobs(checkpoints[arch], prompt, torch.bfloat16)
    gaps = sorted(abs(a - b) for a, b in zip(got, ref))
    assert gaps[-2] < 0.015 and gaps[-1] < 0.1


@pytest.mark.parametrize("arch,config", [
    ("deepseek_v3", {"rope_interleave": False}),
    ("glm4_moe_lite", {"rope_interleave": True}),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.0,
                                         "beta_fast": 32, "beta_slow": 1}}),
    ("deepseek_v2-groups", {"topk_method": "greedy"}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
    ("mistral4", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "beta_fast": 32, "beta_slow": 1, "partial_rotary_factor": 8 / 24,
                                      "llama_4_scaling_beta": 0.0}}),
    ("mistral4", {"n_group": 1, "topk_group": 1}),
])
def test_the_tiny_configs_exercise_what_they_set(checkpoints, arch, config):
    # Each moves transformers' own float32 logprobs by at least 200 times the 1e-4 the engine
    # keeps to (measured: the rotary pairs' layout 0.50 and 0.15, YaRN's mscale_all_dim on the
    # scores 0.027, V2's groups by their best score 0.072, V3's groups 0.22; Mistral 4's queries scaled by
    # position 0.29, its groups 0.12).
    folder = checkpoints[arch]
    prompt = random_prompts(7, (60,))[0]
    moved = distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, **config))
    assert moved > 0.02


@pytest.mark.parametrize("arch", ["deepseek_v2-groups", "deepseek_v3", "glm4_moe_lite", "mistral4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_transformers_routers(checkpoints, arch, dtype):
    """SparseMoE.route against transformers' router on 4,000 rows: the same experts (as sets),
    the same weights. V2's groups are chosen by their best expert, V3's by their two best."""
    assert_routing_matches_transformers(checkpoints[arch], dtype)


def test_the_cache_holds_one_latent_and_one_rotated_key_a_token(checkpoints):
    """One tensor a layer of kv_lora_rank + qk_rope_head_dim (32 + 8) numbers a token, the values
    a view of its first 32: the budget holds (4 heads x 24 + 4 x 12) / 40 = 3.6 times the tokens
    the expanded keys and values would. Prefix caching reuses the latents: a second prompt
    sharing 32 tokens reports them cached and gives the tokens an engine without the cache gives."""
    def inspect(engine):
        kv = engine.kv
        assert len(kv.k) == 2 and kv.k[0].shape[1:] == (1, 40) and kv.v[0].shape[1:] == (1, 32)
        assert kv.v[0].data_ptr() == kv.k[0].data_ptr() and kv.v[1]._base is kv.k[1]
        assert engine._block_bytes == 2 * 4 * 40 * 4  # layers x block x numbers x float32

    assert_prefix_hits_match_no_cache(checkpoints["deepseek_v3"], inspect)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_weight_formats_run_on_the_torch_path(checkpoints, fmt):
    """int8 and int4 pack the projections (the C step has no latent attention: none is built);
    W_UK and W_UV stay float. Logprobs near the float engine's (measured 0.005 int8, 0.06 int4)."""
    assert packed_torch_path_distance(checkpoints["deepseek_v2"], fmt) < (0.05 if fmt == "int8" else 0.3)


def _config(model_type, **changes):
    base = dict(model_type=model_type, vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, kv_lora_rank=32, q_lora_rank=None,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=False,
                head_dim=8)
    return SimpleNamespace(**{**base, **changes})


def test_latent_specs():
    v2 = ModelSpec.from_hf_config(_config("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                          moe_layer_freq=2, norm_topk_prob=True, routed_scaling_factor=16.0))
    assert v2.latent == LatentShape(q_rank=0, kv_rank=32, nope=16, rope=8, v=12)
    assert v2.head_dim == 8 and v2.interleaved_rotary and v2.float_rotary
    assert v2.kv_entry(0) == v2.kv_entry(3) == dict(kv_heads=1, head_dim=40, values_in_keys=32)
    assert v2.attention_scale == pytest.approx(24**-0.5)
    # dense: layer 0 (first_k_dense_replace) and the odd ones (moe_layer_freq 2)
    assert v2.dense_layers == (0, 1, 3) and v2.expert_groups == (4, 2) and v2.groups_by_best
    assert v2.normalize_routing and v2.routed_scale == 16.0 and not v2.sigmoid_routing and not v2.routing_bias
    assert ModelSpec.from_hf_config(_config("deepseek_v2", n_group=4, topk_group=2)).expert_groups is None  # greedy
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    v3 = ModelSpec.from_hf_config(_config("deepseek_v3", q_lora_rank=24, rope_parameters=yarn, n_group=4,
                                          topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                          attention_bias=True))
    assert v3.latent == LatentShape(q_rank=24, kv_rank=32, nope=16, rope=8, v=12, bias=True) and v3.o_bias
    assert v3.attention_scale == pytest.approx(24**-0.5 * (0.1 * math.log(40.0) + 1) ** 2)
    assert v3.routing_bias and v3.sigmoid_routing and not v3.groups_by_best and v3.dense_layers == (0,)
    assert v3.interleaved_rotary and not v3.float_rotary
    assert not ModelSpec.from_hf_config(_config("deepseek_v3", rope_interleave=False)).interleaved_rotary
    lite = ModelSpec.from_hf_config(_config("glm4_moe_lite", mlp_layer_types=["dense", "sparse", "dense", "sparse"]))
    assert lite.dense_layers == (0, 2)
    plain = ModelSpec.from_hf_config(_config("llama"))
    assert plain.latent is None and plain.kv_entry(0) == dict(kv_heads=4, head_dim=8, values_in_keys=None)


def test_mistral4_specs():
    """Mistral 4 as its config gives it (its rope parameters name the rotated part of a query head)
    and as the language model of an image-text (mistral3) checkpoint; a rotated part other than
    the latent's is refused."""
    from transformers import AutoConfig, Mistral4Config

    text = Mistral4Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2, n_group=4, topk_group=2,
                          routed_scaling_factor=2.0, first_k_dense_replace=1)
    assert text.rope_parameters["partial_rotary_factor"] == 8 / 24 and text.rope_parameters["llama_4_scaling_beta"] == 0.1
    outer = AutoConfig.for_model("mistral3", text_config=text.to_dict(),
                                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, head_dim=16, image_size=28, patch_size=14))
    for config in (text, outer):
        spec = ModelSpec.from_hf_config(config)
        assert spec.latent == LatentShape(q_rank=24, kv_rank=32, nope=16, rope=8, v=12) and spec.rotary_dim is None
        assert spec.query_position_scaling == (0.1, 8192) and spec.rope_scaling["rope_type"] == "yarn"
        assert spec.expert_groups == (4, 2) and spec.routed_scale == 2.0 and spec.normalize_routing
        assert spec.scores_in_model_dtype and not spec.sigmoid_routing and not spec.routing_bias
        assert spec.shared_expert_size == 48 and not spec.shared_expert_gated and spec.dense_layers == (0,)
    with pytest.raises(ModelError, match="partial_rotary_factor 0.5: latent attention rotates qk_rope_head_dim"):
        ModelSpec.from_hf_config(SimpleNamespace(**{**text.to_dict(), "rope_parameters": {
            **text.rope_parameters, "partial_rotary_factor": 0.5}}))


def test_the_latent_norms_take_deepseeks_epsilon():
    """q_a_layernorm and kv_a_layernorm: 1e-6 whatever rms_norm_eps says (GLM-4.7-Flash's 1e-5),
    as DeepSeek's code and transformers build them; the other norms the config's."""
    from backends.torch.model import CausalLM

    spec = ModelSpec.from_hf_config(_config("glm4_moe_lite", rms_norm_eps=1e-5, q_lora_rank=24))
    with torch.device("meta"):
        model = CausalLM(spec, 1)
    attn = model.layers[0].self_attn
    assert attn.q_a_layernorm.eps == attn.kv_a_layernorm.eps == 1e-6
    assert model.norm.eps == model.layers[0].input_layernorm.eps == 1e-5


@pytest.mark.parametrize("changes,message", [
    ({"kv_lora_rank": None}, "kv_lora_rank None must be a positive integer"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
    ({"q_lora_rank": -1}, "q_lora_rank -1 must be a positive integer or null"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5: latent attention rotates qk_rope_head_dim"),
    ({"topk_method": "noaux_tc"}, "topk_method `noaux_tc` is not supported; supported: greedy, group_limited_greedy"),
    ({"moe_layer_freq": 0}, "moe_layer_freq 0 must be a positive integer"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group 3 and topk_group 1 do not fit"),
])
def test_what_latent_configs_are_refused_for(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(_config("deepseek_v2", **changes))


def test_glm_layer_kinds_are_checked():
    with pytest.raises(ModelError, match="mlp_layer_types .* must name each of the 4 layers"):
        ModelSpec.from_hf_config(_config("glm4_moe_lite", mlp_layer_types=["dense", "moe", "sparse", "sparse"]))


def test_latent_scale_follows_yarn_mscale_all_dim():
    shape = LatentShape(q_rank=0, kv_rank=4, nope=6, rope=2, v=4)
    assert latent_scale(shape, None) == 8**-0.5
    assert latent_scale(shape, {"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0}) == 8**-0.5
    assert latent_scale(shape, {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0}) == 8**-0.5
    m = 0.1 * 0.5 * math.log(4.0) + 1
    assert latent_scale(shape, {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.5}) == pytest.approx(8**-0.5 * m * m)
    # Mistral's own format's apply_scale false, as vLLM and SGLang read it: the base scale
    assert latent_scale(shape, {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.5,
                                "apply_yarn_scaling": False}) == 8**-0.5


def test_attention_adapters_are_refused_under_latent_attention(checkpoints, tmp_path):
    """LoRA adapters of the attention's projections have nowhere to go (the latent attention's
    are other matrices): refused by name."""
    from transformers import AutoConfig

    from backends.peft import AdapterError
    from backends.torch.lora import load_adapter

    base = checkpoints["deepseek_v2"]
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(base), local_files_only=True))
    folder = write_lora(tmp_path / "q", base, targets=("q_proj",))
    with pytest.raises(AdapterError, match="module `q_proj` is not supported; supported: gate_proj, up_proj"):
        load_adapter("q", folder, spec, torch.float32, torch.device("cpu"))


def test_a_kv_b_proj_of_another_shape_is_refused(checkpoints, tmp_path):
    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM

    folder = tmp_path / "bad"
    shutil.copytree(checkpoints["deepseek_v2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["v_head_dim"] = 8  # kv_b_proj holds 16 + 12 rows a head
    (folder / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(folder)
    with pytest.raises(ModelError, match=r"kv_b_proj.weight` has shape \(112, 32\), expected \(96, 32\)"):
        CausalLM.from_state_dict(ckpt.spec, 64, dict(ckpt.weights))
