"""Llama variants on the torch engine: SmolLM3 (layers without rotary, "NoPE"), Granite 3
(multipliers on the embeddings, the attention scores, each block's output and the logits), dense
and as a mixture of experts (Granite-MoE: a softmax over the top-k router logits), and OLMo 2
and 3 (no input norms, each block's output normalised, query and key norms over whole
projections; OLMo 3's sliding layers with a rotary of their own; OLMoE, a mixture of experts
with OLMo's query and key norms), and GLM-4 (rotary pairs of adjacent dimensions on half of each
head, and with glm4 norms around each block's output too), Ministral (a window on the layers
``layer_types`` names) and Ministral 3 (queries scaled by position past the original context),
also inside its image-text checkpoint (``mistral3``)), and ERNIE 4.5 (GLM's rotary pairs over
whole heads, in float32; biases on every projection), EXAONE 4 (OLMo 2's output norms, per-head
query and key norms, the full-attention layers of its hybrid models without rotary), Seed-OSS
(biases on q, k, v and o), Granite-MoE with a shared MLP and Granite 4's attention-only models,
and Cohere's Command models (``cohere``, ``cohere2``: mean-centred norms, attention and MLP in
parallel from one norm, logits scaled; Command R+'s per-head query and key norms; Cohere 2's
full-attention layers without rotary), and Granite SWA (windows, attention sinks, a rotary base a layer),
and the LayerNorm families (torch_models.LAYER_NORMED_ARCHS), BLOOM, MPT and Falcon-RW with ALiBi among them.
Greedy output and prompt logprobs against transformers, the C step against the packed torch
path, and what the configs say."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from backends.torch.model import ModelError, ModelSpec
from test_torch_engine import assert_greedy_matches_transformers, engine_for, generate_all, random_prompts, run
from test_torch_gemma import (
    assert_c_steps_match_the_torch_path, assert_prompt_logprobs_match_transformers, distance, engine_prompt_logprobs,
    hf_prompt_logprobs, packed_torch_path_distance, prompt_logprobs,
)
from torch_models import LAYER_NORMED_ARCHS, tiny_checkpoint

ARCHS = ["smollm3", "granite", "granitemoe", "olmo2", "olmo3", "olmoe", "glm", "glm4", "ministral", "ministral3",
         "ernie4_5", "exaone4", "seed_oss", "granitemoeshared", "granite4", "granite4-moe", "cohere", "cohere2",
         "hunyuan", "apertus", "granite_swa", "granitemoe_swa", "arcee", "internlm3", "vaultgemma", "helium",
         "hunyuan_moe", "jais2", *LAYER_NORMED_ARCHS]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(checkpoints, arch):
    # smollm3: layer 1 of 2 without rotary; granite: embeddings times 2, scores times 0.1 (not
    # 16 ** -0.5), each block's output times 0.5, logits divided by 1.5; granitemoe: the same
    # around 4 experts, 2 a token; olmo2: norms of the blocks' outputs only, of whole query and
    # key projections; olmo3: the same, layer 0 sliding over 8 with base 1e4, layer 1 with YaRN;
    # olmoe: Llama's norms, OLMo's query and key norms, 8 experts, 2 a token, not renormalised;
    # glm: 8 of 16 dimensions of each head rotating in adjacent pairs, q/k/v biases, fused gate
    # and up; glm4: the same with norms of both blocks' outputs (GLM-4's names); ministral: a
    # window of 8 on layer 0 only; ministral3: YaRN past 32 positions, queries scaled from there;
    # ernie4_5: every dimension rotating in adjacent pairs, in float32; biases on every projection;
    # exaone4: output norms only, per-head q/k norms, layer 0 sliding over 8, layer 1 without
    # rotary; seed_oss: q, k, v and o biases; granitemoeshared: Granite-MoE and a shared MLP added
    # ungated; granite4: Granite 4's dense attention-only shape (its shared MLP as the MLP);
    # granite4-moe: experts and the shared MLP, no rotary anywhere; cohere: mean-centred norms,
    # parallel blocks, adjacent rotary pairs in float32, logits times 0.3, biases, per-head q/k
    # norm weights; cohere2: layer 0 sliding over 8, layer 1 without rotary, logits times 0.5;
    # hunyuan: per-head q/k norms after the rotary, whose base an NTK alpha of 1000 stretches;
    # apertus: ungated MLPs through xIELU with slopes of their own, per-head q/k norms; arcee:
    # ungated MLPs of squared ReLU; internlm3: biases on q, k, v, o and the MLP; vaultgemma: Gemma
    # 2 without its blocks' output norms (a window of 8 on layer 0, capped scores and logits);
    # helium: adjacent rotary pairs, norms scaled in float32, q/k/v biases without o's;
    # hunyuan_moe: Hunyuan's attention, 2 of 4 experts by a float32 softmax router, a shared MLP;
    # jais2: LayerNorms with biases, ungated squared-ReLU MLPs, biases on every projection;
    # bloom, mpt, falcon-rw: ALiBi's biases over 6, 6 and 4 heads (the others: _layer_normed_config).
    assert_greedy_matches_transformers(checkpoints[arch])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
def test_prompt_logprobs_match_transformers(checkpoints, arch, dtype, within):
    # Greedy tokens cannot see Granite's logits_scaling (a division keeps their order);
    # logprobs see it. Measured: about 1e-6 from transformers in float32, 5e-7 in bfloat16 (each
    # step rounds where transformers rounds); leaving out any one of what these configs
    # set moves some logprob by more than 0.05 (test_the_tiny_configs_exercise_what_they_set).
    # The prompt: 60 tokens, past Ministral 3's original 32 positions. Granite SWA's sinks join
    # the float32 softmax as one more logit (gpt-oss's); transformers rounds the probabilities to
    # bfloat16 and scales them by the sink's sigmoid, rounded too: 0.004 and 0.009 apart in
    # bfloat16, where its own bfloat16 is 0.003 from its float32.
    if dtype == torch.bfloat16 and arch.endswith("_swa"):
        within = 0.02
    if dtype == torch.bfloat16 and arch == "falcon-40b":  # its biases (none of the released rotary Falcons has
        within = 0.01  # any) added to the rounded product, ours in it: 0.004 apart, its fused bias split shown in float32
    if dtype == torch.bfloat16 and arch in ("bloom", "falcon-rw"):
        # transformers adds their ALiBi biases (slope times absolute position) to the scores in
        # bfloat16, rounding the sums at the biases' size; ours join in float32 (MPT's do in
        # transformers too: 6e-7 apart). Measured: BLOOM 0.0051 from transformers' bfloat16 and
        # 0.0057 from its float32, where its own bfloat16 is 0.0061 from its float32; Falcon-RW
        # (with Falcon's biases, falcon-40b above) 0.0057, 0.0070 and 0.0054.
        within = 0.01
    assert_prompt_logprobs_match_transformers(checkpoints[arch], dtype, within)


@pytest.mark.parametrize("arch,config", [
    ("smollm3", {"no_rope_layers": [1, 1]}),
    ("granite", {"embedding_multiplier": 1.0}),
    ("granite", {"attention_multiplier": 0.25}),
    ("granite", {"residual_multiplier": 1.0}),
    ("granite", {"logits_scaling": 1.0}),
    ("olmo3", {"layer_types": ["full_attention", "full_attention"]}),
    ("olmo3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                      "original_max_position_embeddings": 128},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}}),
    ("glm4", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
    ("ernie4_5", {"use_bias": False}),
    ("exaone4", {"sliding_window": None, "layer_types": ["full_attention", "full_attention"]}),
    ("seed_oss", {"attention_out_bias": False}),
    ("granite4-moe", {"position_embedding_type": "rope"}),
    ("cohere", {"logit_scale": 1.0}),
    ("cohere", {"use_qk_norm": False}),
    ("cohere2", {"layer_types": ["sliding_attention", "sliding_attention"]}),
    ("hunyuan", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    ("vaultgemma", {"attn_logit_softcapping": None}),
    ("vaultgemma", {"sliding_window": 4}),
    ("internlm3", {"attention_bias": False, "mlp_bias": False}),
    ("hunyuan_moe", {"moe_topk": 1}),
    ("ministral", {"layer_types": ["full_attention", "full_attention"]}),
    ("starcoder2", {"sliding_window": None}),
    ("nemotron", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
    ("stablelm", {"use_qkv_bias": False}),
    ("stablelm-parallel", {"qk_layernorm": False}),
    ("phi", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}),
    ("gpt_neox", {"use_parallel_residual": False}),
    ("olmo", {"clip_qkv": None}),
    ("mpt", {"attn_config": {"clip_qkv": None}}),
    ("mpt", {"attn_config": {"clip_qkv": 0.4, "softmax_scale": 0.5}}),
    ("falcon-rw", {"alibi": False}),
    ("ministral3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 32,
        "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.0}}),
])
def test_the_tiny_configs_exercise_what_they_set(checkpoints, arch, config):
    # Each feature moves transformers' own float32 logprobs on these weights by 200 times what
    # test_prompt_logprobs_match_transformers allows (measured: SmolLM3's NoPE layer 0.9;
    # Granite's multipliers 0.14, 0.08, 0.14, 0.29; Command R+'s query and key norms 0.029):
    # an engine ignoring it cannot pass that test.
    folder = checkpoints[arch]
    prompt = random_prompts(7, (60,))[0]
    assert distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, **config)) > 0.02


# hunyuan_moe and solar_open take float16 keys: with bfloat16 ones the two paths' differently rounded
# keys moved a near-tied router score to another expert at one position (0.0345 on solar_open's
# first token, every other within 0.0011; hunyuan_moe's flat tiny logits reordered), which says
# nothing of the C step. Mixtures of experts under bfloat16 keys stay covered by the other rows.
@pytest.mark.parametrize("arch,fmt,kv", [("smollm3", "int4", "auto"), ("smollm3", "int8", "bfloat16"),
                                         ("granite", "int8", "auto"), ("granite", "int4", "float16"),
                                         ("granitemoe", "int8", "auto"), ("granitemoe", "int4", "auto"),
                                         ("olmo2", "int8", "auto"), ("olmo2", "int4", "bfloat16"),
                                         ("olmo3", "int4", "auto"), ("olmoe", "int8", "auto"), ("olmoe", "int4", "auto"),
                                         ("glm", "int8", "auto"), ("glm4", "int4", "auto"),
                                         ("ministral3", "int4", "auto"), ("ministral3", "int8", "float16"),
                                         ("ernie4_5", "int8", "auto"), ("ernie4_5", "int4", "bfloat16"),
                                         ("exaone4", "int8", "auto"), ("exaone4", "int4", "float16"),
                                         ("seed_oss", "int8", "auto"), ("seed_oss", "int4", "auto"),
                                         ("granitemoeshared", "int8", "auto"), ("granite4", "int4", "auto"),
                                         ("granite4-moe", "int8", "bfloat16"), ("granite_swa", "int8", "auto"),
                                         ("granite_swa", "int4", "bfloat16"), ("granitemoe_swa", "int4", "auto"),
                                         ("hunyuan", "int8", "auto"), ("hunyuan", "int4", "bfloat16"),
                                         ("internlm3", "int8", "auto"), ("vaultgemma", "int4", "auto"),
                                         ("vaultgemma", "int8", "float16"), ("helium", "int8", "auto"),
                                         ("helium", "int4", "bfloat16"), ("hunyuan_moe", "int8", "auto"),
                                         ("hunyuan_moe", "int4", "float16"), ("cohere2", "int8", "auto"),
                                         ("arcee", "int4", "auto"), ("jais2", "int8", "bfloat16"),
                                         ("starcoder2", "int8", "auto"), ("starcoder2", "int4", "float16"),
                                         ("nemotron", "int4", "auto"), ("stablelm", "int8", "auto"),
                                         ("phi", "int4", "auto"), ("phi", "int8", "bfloat16"), ("gpt_neox", "int8", "auto"),
                                         ("gpt_neox-serial", "int4", "auto"), ("falcon", "int4", "auto"),
                                         ("falcon-40b", "int8", "auto"), ("falcon2", "int4", "bfloat16"),
                                         ("gptj", "int8", "auto"), ("gpt2", "int4", "auto"), ("gpt2", "int8", "float16"),
                                         ("gpt_bigcode", "int8", "auto"), ("gpt_bigcode-mha", "int4", "auto"),
                                         ("olmo", "int8", "auto"), ("opt", "int4", "auto"), ("opt", "int8", "bfloat16"),
                                         ("bloom", "int4", "auto"), ("bloom", "int8", "bfloat16"), ("mpt", "int8", "auto"),
                                         ("mpt", "int4", "float16"), ("falcon-rw", "int4", "auto")])
def test_c_steps_match_the_packed_torch_path(checkpoints, arch, fmt, kv):
    """The one C call per step (NoPE layers pass no rotary tables; Granite's block outputs land
    in a branch and are added scaled, its experts' sum scaled in moe_block; OLMo's blocks take
    the residual unnormalised, its query and key norms span whole projections; the LayerNorm
    families' norms with their biases, ungated MLPs, parallel blocks from one norm or two, the LM
    head's bias, OLMo 1's clamped projections, learned positions added before the call) gives
    the packed torch path's tokens, logprobs within 0.02."""
    assert_c_steps_match_the_torch_path(checkpoints[arch], weight_format=fmt, kv_cache_dtype=kv)


@pytest.mark.parametrize("config", [
    {"layer_rope_theta": [1e4] * 4},  # no layer without rotary, the full layer's base the sliding layers'
    {"layer_rope_theta": [5e5, 1e4, 1e4, 5e5]},  # layer 0 rotating
    {"layer_rope_theta": [0, 5e5, 5e5, 5e5]},  # the sliding layers' base the full layer's
    {"layer_types": ["full_attention"] * 4},  # no window
])
def test_the_tiny_granite_swa_exercises_what_it_sets(checkpoints, config):
    """Each of the layer without rotary, the two bases and the window moves transformers' own
    float32 logprobs by 100 times what the comparison allows or more (measured 0.022, 0.019,
    0.012, 0.21); without the sinks the engine's own are 0.2 away."""
    folder = checkpoints["granite_swa"]
    prompt = random_prompts(7, (60,))[0]
    assert distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, **config)) > 0.01


def test_granite_swa_specs():
    s = ModelSpec.from_hf_config(_config("granite_swa", num_hidden_layers=4, sliding_window=16, attention_multiplier=0.5,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         layer_rope_theta=[1e4, 0, 1e4, 2e5]))
    assert s.attention_sinks and s.sliding_window == 16 and s.sliding_layers == (0, 2) and s.nope_layers == (1,)
    assert (s.rope_theta, s.local_rope_theta, s.query_scale) == (2e5, 1e4, 0.5)
    same = ModelSpec.from_hf_config(_config("granite_swa", num_hidden_layers=2, sliding_window=16,
                                            layer_types=["sliding_attention", "full_attention"], layer_rope_theta=None))
    assert same.local_rope_theta is None and same.nope_layers == () and same.rope_theta == 10000.0
    for thetas, message in (([1e4, 2e4, 1e4, 3e4], "one rotary base for the full layers and one for the sliding"),
                            ([1e4, 2e4], "must be a base .0: none. for each of the 4 layers")):
        with pytest.raises(ModelError, match=message):
            ModelSpec.from_hf_config(_config("granite_swa", num_hidden_layers=4, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"] * 2,
                                             layer_rope_theta=thetas))


def _config(model_type, **changes):
    base = dict(model_type=model_type, vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=True)
    return SimpleNamespace(**{**base, **changes})


def test_smollm3_nope_layers_from_the_config_or_its_interval():
    assert ModelSpec.from_hf_config(_config("smollm3", no_rope_layers=[1, 1, 0, 1, 1, 1, 0, 0])).nope_layers == (2, 6, 7)
    # Without the list, every 4th layer (SmolLM3-3B's shape), or the interval the config gives.
    assert ModelSpec.from_hf_config(_config("smollm3")).nope_layers == (3, 7)
    assert ModelSpec.from_hf_config(_config("smollm3", no_rope_layer_interval=2)).nope_layers == (1, 3, 5, 7)
    with pytest.raises(ModelError, match="no_rope_layers has 3 entries; it needs one for each of the 8 layers"):
        ModelSpec.from_hf_config(_config("smollm3", no_rope_layers=[1, 0, 1]))
    assert ModelSpec.from_hf_config(_config("llama", no_rope_layers=[0] * 8)).nope_layers == ()  # not Llama's key


def test_granite_multipliers_and_their_refusals():
    s = ModelSpec.from_hf_config(_config("granite", embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                         residual_multiplier=0.22, logits_scaling=16.0))
    assert (s.embed_scale, s.attention_scale, s.residual_scale, s.logits_scaling) == (12.0, 0.0078125, 0.22, 16.0)
    assert not s.embed_scale_rounded
    # At 1 they change nothing, but the attention's 1 is a scale of 1 (not head_dim ** -0.5).
    ones = ModelSpec.from_hf_config(_config("granite", embedding_multiplier=1, attention_multiplier=1,
                                            residual_multiplier=1, logits_scaling=1))
    assert (ones.embed_scale, ones.attention_scale, ones.residual_scale, ones.logits_scaling) == (None, 1.0, None, None)
    for key, bad in (("logits_scaling", 0), ("residual_multiplier", -0.5), ("embedding_multiplier", "12")):
        with pytest.raises(ModelError, match=f"{key} {bad!r} must be a positive number"):
            ModelSpec.from_hf_config(_config("granite", **{key: bad}))
    # Llama's config never reads them.
    llama = ModelSpec.from_hf_config(_config("llama", logits_scaling=16.0, residual_multiplier=0.2))
    assert (llama.logits_scaling, llama.residual_scale, llama.attention_scale) == (None, None, 16**-0.5)


def test_olmo_specs():
    s = ModelSpec.from_hf_config(_config("olmo2"))
    assert s.qk_norm and s.qk_norm_whole and s.sandwich_norms and not s.input_norms and s.float_norms
    assert not s.float16_overflows  # vLLM serves OLMo 2 in float16; Gemma 2/3 alone are refused
    # OLMo 3 without layer_types (transformers 4): three layers of every four slide.
    olmo3 = ModelSpec.from_hf_config(_config("olmo3", sliding_window=16))
    assert [olmo3.window_of(i) for i in range(8)] == [16, 16, 16, None] * 2
    # A flat YaRN rope_scaling (transformers 4's form): the full layers' only, as transformers 5
    # splits it; the sliding layers rotate unscaled with the same base.
    flat = ModelSpec.from_hf_config(_config("olmo3", sliding_window=16, rope_theta=5e5, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}))
    assert flat.rope_scaling["rope_type"] == "yarn" and flat.local_rope_theta == 5e5
    assert flat.local_rope_scaling["rope_type"] == "default"
    from transformers import Olmo3Config

    split = Olmo3Config(rope_theta=5e5, rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                      "original_max_position_embeddings": 1024})
    assert split.rope_parameters["sliding_attention"]["rope_type"] == "default"  # what transformers 5 makes of it
    with pytest.raises(ModelError, match="partial_rotary_factor is not supported for model_type `olmo2`"):
        ModelSpec.from_hf_config(_config("olmo2", partial_rotary_factor=0.5))


def test_olmoe_spec_and_its_clip_refused():
    s = ModelSpec.from_hf_config(_config("olmoe", num_experts=64, num_experts_per_tok=8, norm_topk_prob=False))
    assert s.qk_norm and s.qk_norm_whole and s.input_norms and not s.sandwich_norms and not s.float_norms
    assert (s.num_experts, s.experts_per_token, s.expert_size, s.normalize_routing) == (64, 8, 128, False)
    assert not s.float_rotary and not s.softmax_top_k
    with pytest.raises(ModelError, match="clip_qkv 8.0: clamping queries, keys and values is not supported"):
        ModelSpec.from_hf_config(_config("olmoe", num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                         clip_qkv=8.0))


@pytest.mark.parametrize("arch", ["mistral3-mm", "qwen3-vl-mm", "qwen2_5-vl-mm", "qwen3-vl-moe-mm", "glm4v-mm", "glm4v-moe-mm"])
def test_the_language_model_of_an_image_text_checkpoint(tmp_path, arch):
    """Ministral 3's releases are image-text checkpoints (``mistral3``), and Qwen3-VL's (dense and
    experts), Qwen2.5-VL's (as their releases name its weights: ``model.layers`` beside
    ``visual``), GLM-4.1V's (q/k/v biases its config does not mention) and GLM-4.5V's: the
    language model is served, with transformers' image-text model's own prompt
    logprobs (measured 1.2e-6 from them) and greedy output on text; the vision tower is never
    read."""
    from transformers import AutoModelForImageTextToText

    from backends.torch.loader import load_checkpoint

    folder = tiny_checkpoint(tmp_path / "mm", arch)
    assert not any("visual" in key or "vision" in key for key in load_checkpoint(folder).weights)
    prompt = random_prompts(7, (60,))[0]
    prompts = random_prompts(1, (5, 23))
    engine = engine_for(folder, block_size=4, max_batched_tokens=16)
    try:
        got = run(prompt_logprobs(engine, prompt))
        outs = generate_all(engine, prompts, 20)
    finally:
        run(engine.stop())
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        for out, p in zip(outs, prompts):
            ids = torch.tensor([p])
            assert out == model.generate(input_ids=ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    assert distance(got, lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()) < 1e-4


def test_ministral_specs_and_an_unsupported_language_model():
    from transformers import Mistral3Config

    s = ModelSpec.from_hf_config(_config("ministral3", sliding_window=64, rope_parameters={
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384, "llama_4_scaling_beta": 0.1}))
    assert s.query_position_scaling == (0.1, 16384) and s.sliding_window == 64 and s.sliding_layers is None
    assert ModelSpec.from_hf_config(_config("ministral3")).query_position_scaling is None  # no beta: no scaling
    for rope, why in (({"rope_type": "yarn", "factor": 4.0, "llama_4_scaling_beta": "0.1"}, "llama_4_scaling_beta '0.1'"),
                      ({"llama_4_scaling_beta": 0.1}, "original_max_position_embeddings, a positive integer; got None")):
        with pytest.raises(ModelError, match=why):
            ModelSpec.from_hf_config(_config("ministral3", rope_parameters=rope))
    ministral = ModelSpec.from_hf_config(_config("ministral", sliding_window=16, num_hidden_layers=3))
    assert [ministral.window_of(i) for i in range(3)] == [16, 16, 16]  # no layer_types (transformers 4): every layer
    with pytest.raises(ModelError, match="the language model of a `mistral3` checkpoint is a `pixtral`"):
        ModelSpec.from_hf_config(Mistral3Config(text_config={"model_type": "pixtral"}))


def test_qwen3_vl_moe_experts_as_released_and_as_saved(tmp_path):
    """Qwen3-VL-MoE's releases stack each layer's experts as [E, hidden, 2 x inter] and [E, inter,
    hidden]; transformers saves them [E, 2 x inter, hidden] and [E, hidden, inter]. Both read to
    the same model: the same prompt logprobs."""
    from safetensors.torch import load_file, save_file

    saved = tiny_checkpoint(tmp_path / "saved", "qwen3-vl-moe-mm")
    released = tmp_path / "released"
    shutil.copytree(saved, released)
    state = load_file(str(saved / "model.safetensors"))
    stacked = [key for key in state if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked and all(state[key].shape[1] != state[key].shape[2] for key in stacked)
    state.update({key: state[key].transpose(1, 2).contiguous() for key in stacked})
    save_file(state, str(released / "model.safetensors"), metadata={"format": "pt"})
    prompt, got = engine_prompt_logprobs(released)
    assert engine_prompt_logprobs(saved) == (prompt, got)


def test_qwen2_5_vl_as_released_with_a_flat_config(tmp_path):
    """Qwen2.5-VL's releases carry a flat config.json (the language model's keys at the top, no
    text_config; rope_scaling {"type": "mrope"}) beside an LM head of their own: read as the
    nested config transformers 5 saves, the same prompt logprobs."""
    nested = tiny_checkpoint(tmp_path / "nested", "qwen2_5-vl-mm")
    flat = tmp_path / "flat"
    shutil.copytree(nested, flat)
    config = json.loads((nested / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (flat / "config.json").write_text(json.dumps(config))
    assert engine_prompt_logprobs(flat) == engine_prompt_logprobs(nested)


def test_qwen_vl_specs():
    """Qwen3-VL's language model is Qwen3's (query and key norms), Qwen2.5-VL's Qwen2's (q, k, v
    biases); their multimodal rotary sections change nothing on text; whether the embeddings are
    tied is the outer config's say."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    text = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                     "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    for tied in (True, False):
        s = ModelSpec.from_hf_config(Qwen3VLConfig(text_config=text, tie_word_embeddings=tied))
        assert s.qk_norm and not s.qkv_bias and s.tie_word_embeddings == tied and s.rope_theta == 5e6
    # Qwen2.5-VL's releases say rope_scaling {"type": "mrope", ...}: the plain rotary on text.
    text.pop("rope_parameters")
    old = ModelSpec.from_hf_config(Qwen2_5_VLConfig(text_config={**text, "rope_scaling": {"type": "mrope",
                                                                                        "mrope_section": [2, 3, 3]}}))
    assert old.qkv_bias and not old.o_bias and not old.qk_norm and old.rope_scaling["rope_type"] == "default"


@pytest.mark.parametrize("model_type,quant", [
    ("ministral3", {"quant_method": "awq", "bits": 4}),
    ("llama", {"quant_method": "gptq", "bits": 4}),
    ("gpt_oss", {"quant_method": "fp8", "fmt": "e5m2"}),  # FP8's e4m3 is read (test_torch_fp8.py)
])
def test_quantized_checkpoints_are_refused_by_their_method(model_type, quant):
    # Their weights would load as raw values without their scales: garbage, silently.
    with pytest.raises(ModelError, match=f"quantization_config quant_method `{quant['quant_method']}`"):
        ModelSpec.from_hf_config(_config(model_type, quantization_config=quant))
    from transformers import Mistral3Config

    text = {"model_type": "ministral3", "quantization_config": quant}
    with pytest.raises(ModelError, match="quantization_config quant_method"):
        ModelSpec.from_hf_config(Mistral3Config(text_config=text, quantization_config=quant))


def test_exaone4_and_seed_oss_specs():
    # EXAONE 4.0 32B's shape: three sliding layers of every four ("LLLG" or 4), the fourth full
    # attention without rotary; the 1.2B model, no window, rotates everywhere.
    for pattern in ("LLLG", 4):
        s = ModelSpec.from_hf_config(_config("exaone4", sliding_window=16, sliding_window_pattern=pattern))
        assert [s.window_of(i) for i in range(8)] == [16, 16, 16, None] * 2 and s.nope_layers == (3, 7)
        assert s.sandwich_norms and not s.input_norms and s.qk_norm and not s.qk_norm_whole and not s.float_norms
    small = ModelSpec.from_hf_config(_config("exaone4", sliding_window=None, layer_types=["full_attention"] * 8))
    assert small.sliding_window is None and small.nope_layers == ()
    seed = ModelSpec.from_hf_config(_config("seed_oss", attention_bias=True, attention_out_bias=False))
    assert seed.qkv_bias and not seed.o_bias
    assert ModelSpec.from_hf_config(_config("seed_oss", attention_bias=True, attention_out_bias=True)).o_bias


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["cohere", "apertus", "stablelm-parallel"])
def test_what_the_c_step_lacks_runs_as_torch_operations(checkpoints, arch, fmt):
    """The C step has no query and key norms a head (Command R+, StableLM 2 12B) nor xIELU
    (Apertus): under int8 and int4 their packed projections run as torch operations, near the
    float engine's logprobs (measured 0.002 and 0.009 int8, 0.02 and 0.17 int4 for the first two)."""
    assert packed_torch_path_distance(checkpoints[arch], fmt) < (0.05 if fmt == "int8" else 0.3)


def test_the_c_step_refuses_combinations_it_has_no_arithmetic_for():
    """The C step's experts, query and key norms and output norms are RMSNorms, and its parallel
    blocks neither normalise nor scale their outputs: a spec with one of those beside LayerNorms
    or parallel blocks (no released model has one) runs as torch operations."""
    from dataclasses import replace

    from transformers import AutoConfig

    from backends.torch.cpu_decode import c_step_refusal

    phi = ModelSpec.from_hf_config(AutoConfig.for_model("phi", vocab_size=100))
    starcoder2 = ModelSpec.from_hf_config(AutoConfig.for_model("starcoder2", vocab_size=100))
    granite = ModelSpec.from_hf_config(_config("granite", residual_multiplier=0.5))
    assert c_step_refusal(phi) is None and c_step_refusal(starcoder2) is None and c_step_refusal(granite) is None
    for spec in (replace(phi, num_experts=4, experts_per_token=2), replace(starcoder2, qk_norm=True),
                 replace(starcoder2, sandwich_norms=True), replace(granite, parallel_blocks=True),
                 replace(starcoder2, num_experts=4, experts_per_token=2)):
        assert c_step_refusal(spec).startswith("LayerNorms with experts, query and key norms or output norms")


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 48, 56, 64, 71, 112])
def test_alibi_slopes_are_transformers(heads):
    # BLOOM's (6 heads in the tiny one; BLOOM 176B's 112, two of its slopes' series) and MPT's
    # (its own series, odd ones first where the heads are no power of two) for many head counts;
    # MPT's alibi_bias_max as its own code and vLLM read it (transformers' model always takes 8,
    # as every MPT release says).
    from transformers import BloomConfig, FalconConfig, MptConfig
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bloom = ModelSpec.from_hf_config(BloomConfig(hidden_size=8 * heads, n_head=heads, n_layer=3)).alibi
    assert bloom == pytest.approx(_get_alibi_slopes(heads, "cpu").tolist(), rel=1e-6)
    for most in (8, 16):
        mpt = ModelSpec.from_hf_config(MptConfig(d_model=8 * heads, n_heads=heads, attn_config={"alibi_bias_max": most}))
        assert mpt.alibi == pytest.approx((-build_mpt_alibi_tensor(heads, 2, most)[:, 0, 0]).tolist(), rel=1e-6)
    falcon = ModelSpec.from_hf_config(FalconConfig(hidden_size=8 * heads, num_attention_heads=heads, alibi=True,
                                                   multi_query=False, parallel_attn=False))
    assert falcon.alibi == pytest.approx([s / 8**0.5 for s in bloom], rel=1e-6)
    assert falcon.nope_layers == tuple(range(falcon.num_layers))


@pytest.mark.parametrize("arch", ["bloom", "mpt", "falcon-rw-mq"])
def test_alibi_prompt_rows_a_few_at_a_time(checkpoints, arch, monkeypatch, tmp_path):
    # A long context's prefill takes its scores' rows a few at a time (CAPPED_SCORES): each
    # block of rows keeps its own heads' slopes. falcon-rw-mq: Falcon-RW's ALiBi over Falcon 7B's
    # one key-value head (no release has both), so that the rows of a block are of several heads.
    monkeypatch.setattr("backends.torch.attention.CAPPED_SCORES", 100)
    folder = checkpoints.get(arch) or tiny_checkpoint(tmp_path / arch, arch)
    assert_prompt_logprobs_match_transformers(folder, torch.float32, 1e-4)


def test_alibi_specs():
    from transformers import BloomConfig, MptConfig

    bloom = ModelSpec.from_hf_config(BloomConfig(hidden_size=64, n_head=4, n_layer=3))
    assert (bloom.max_position, bloom.nope_layers, bloom.embedding_norm, bloom.intermediate_size) == (2048, (0, 1, 2), True, 256)
    assert (bloom.qkv_bias, bloom.o_bias, bloom.mlp_bias, bloom.norm_bias, bloom.ungated_mlp, bloom.activation) == (
        True, True, True, True, True, "bloom_gelu")
    assert ModelSpec.from_hf_config(BloomConfig(hidden_size=64, n_head=4, seq_length=4096)).max_position == 4096
    with pytest.raises(ModelError, match="apply_residual_connection_post_layernorm"):
        ModelSpec.from_hf_config(BloomConfig(hidden_size=64, n_head=4, apply_residual_connection_post_layernorm=True))
    mpt = ModelSpec.from_hf_config(MptConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=8192))
    assert (mpt.max_position, mpt.nope_layers, mpt.clip_qkv, mpt.attention_scale, mpt.activation) == (8192, (0, 1), None,
                                                                                                   0.25, "gelu")
    assert (mpt.qkv_bias, mpt.o_bias, mpt.mlp_bias, mpt.norm_bias, mpt.centered_norms) == (False, False, False, False, True)
    mpt = ModelSpec.from_hf_config(MptConfig(d_model=64, n_heads=4, attn_config={"clip_qkv": 6.0, "softmax_scale": 0.1}))
    assert (mpt.clip_qkv, mpt.attention_scale) == (6.0, 0.1)
    for changes, message in (({"attn_config": {"prefix_lm": True}}, "prefix_lm"), ({"attn_config": {"qk_ln": True}}, "qk_ln"),
                             ({"attn_config": {"alibi": False}}, "alibi false"),
                             ({"attn_config": {"attn_type": "multiquery_attention"}}, "multiquery_attention"),
                             ({"no_bias": False}, "no_bias false"), ({"logit_scale": 0.5}, "logit_scale"),
                             ({"expansion_ratio": 3}, "expansion_ratio 3"),
                             ({"attn_config": {"sliding_window_size": 16}}, "sliding_window_size 16"),
                             ({"attn_config": {"rope": True}}, "rope: a rotary"),
                             ({"ffn_config": {"ffn_type": "mptglu"}}, "ffn_type `mptglu`")):
        with pytest.raises(ModelError, match=message):
            ModelSpec.from_hf_config(MptConfig(d_model=64, n_heads=4, **changes))


def test_layer_normed_specs():
    """The LayerNorm families: each config's names for its epsilon, biases and MLP, the ungated
    MLPs' activations (no other); OLMo 1's weightless norms and clamped projections; Phi's query
    and key LayerNorms and Falcon's ALiBi refused."""
    from transformers import AutoConfig

    def spec(model_type, **changes):
        return ModelSpec.from_hf_config(AutoConfig.for_model(model_type, vocab_size=100, **changes))

    s = spec("starcoder2", norm_epsilon=1e-3, use_bias=False, sliding_window=16)
    assert s.centered_norms and s.norm_bias and s.ungated_mlp and s.activation == "gelu_tanh"
    assert s.rms_norm_eps == 1e-3 and not (s.qkv_bias or s.o_bias or s.mlp_bias) and s.sliding_window == 16
    assert s.sliding_layers is None and s.tie_word_embeddings
    s = spec("nemotron", norm_eps=1e-4, attention_bias=True)
    assert s.norms_less_one and s.activation == "relu2" and s.rms_norm_eps == 1e-4 and s.qkv_bias and s.o_bias
    assert s.rotary_dim == s.head_dim // 2 and not s.mlp_bias
    s = spec("stablelm", use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True, layer_norm_eps=1e-3)
    assert s.qkv_bias and not s.o_bias and s.parallel_blocks and not s.parallel_residual_last and s.qk_norm_per_head
    assert not s.ungated_mlp and s.activation == "silu" and s.rotary_dim == s.head_dim // 4 and s.rms_norm_eps == 1e-3
    s = spec("phi")
    assert s.parallel_blocks and s.parallel_residual_last and not s.parallel_mlp_norm and s.lm_head_bias
    assert s.qkv_bias and s.o_bias and s.mlp_bias and s.activation == "gelu_new"
    with pytest.raises(ModelError, match="qk_layernorm: Phi's query and key LayerNorms are not supported"):
        spec("phi", qk_layernorm=True)
    s = spec("gpt_neox")
    assert s.parallel_blocks and s.parallel_residual_last and s.parallel_mlp_norm and s.activation == "gelu"
    assert s.num_kv_heads == s.num_heads and s.rotary_dim == s.head_dim // 4
    s = spec("gpt_neox", use_parallel_residual=False, attention_bias=False)
    assert not (s.parallel_blocks or s.parallel_residual_last or s.parallel_mlp_norm or s.qkv_bias or s.o_bias)
    assert s.mlp_bias
    s = spec("falcon", hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, layer_norm_epsilon=1e-3)
    assert s.num_kv_heads == 1 and s.intermediate_size == 96 and s.activation == "gelu" and s.rms_norm_eps == 1e-3
    assert s.parallel_blocks and s.parallel_residual_last and not s.parallel_mlp_norm and s.tie_word_embeddings
    s = spec("falcon", hidden_size=64, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, bias=True,
             activation="gelu_pytorch_tanh")
    assert s.num_kv_heads == 2 and s.parallel_mlp_norm and s.qkv_bias and s.o_bias and s.mlp_bias
    assert s.activation == "gelu_tanh" and s.intermediate_size == 256
    assert not spec("falcon", new_decoder_architecture=True, num_ln_in_parallel_attn=1).parallel_mlp_norm
    s = spec("gptj", n_embd=64, n_head=4, rotary_dim=8, activation_function="gelu_new", layer_norm_epsilon=1e-3)
    assert s.rotary_dim == 8 and s.interleaved_rotary and s.intermediate_size == 256 and s.activation == "gelu_new"
    assert s.parallel_residual_last and s.lm_head_bias and s.mlp_bias and not (s.qkv_bias or s.o_bias)
    assert s.rms_norm_eps == 1e-3 and s.rope_theta == 10000.0
    s = spec("gptj", n_embd=64, n_head=4, rotary_dim=16, n_inner=96)
    assert s.rotary_dim is None and s.intermediate_size == 96  # the whole head rotating
    s = spec("gpt2", n_embd=64, n_head=4, n_layer=3, n_positions=256, scale_attn_weights=False)
    assert s.learned_positions and s.nope_layers == (0, 1, 2) and s.max_position == s.context_length == 256
    assert s.attention_scale == 1.0 and s.intermediate_size == 256 and s.activation == "gelu_new" and s.tie_word_embeddings
    assert s.qkv_bias and s.o_bias and s.mlp_bias and spec("gpt2", n_embd=64, n_head=4).attention_scale == 16**-0.5
    with pytest.raises(ModelError, match="scale_attn_by_inverse_layer_idx: scores scaled by their layer's index"):
        spec("gpt2", scale_attn_by_inverse_layer_idx=True)
    assert spec("gpt_bigcode", n_embd=64, n_head=4).num_kv_heads == 1
    assert spec("gpt_bigcode", n_embd=64, n_head=4, multi_query=False).num_kv_heads == 4
    s = spec("olmo", clip_qkv=8.0)
    assert s.weightless_norms and s.centered_norms and not s.norm_bias and s.rms_norm_eps == 1e-5 and s.clip_qkv == 8.0
    assert s.float_rotary and not s.ungated_mlp and spec("olmo").clip_qkv is None
    s = spec("opt", hidden_size=64, num_attention_heads=4, ffn_dim=96, word_embed_proj_dim=64, enable_bias=False)
    assert s.learned_positions and s.position_table_offset == 2 and s.activation == "relu" and s.intermediate_size == 96
    assert not (s.qkv_bias or s.o_bias or s.mlp_bias) and s.rms_norm_eps == 1e-5 and s.ungated_mlp
    for changes, message in (({"do_layer_norm_before": False}, "do_layer_norm_before false: norms after each block"),
                             ({"word_embed_proj_dim": 32}, "word_embed_proj_dim 32: embeddings projected in and out"),
                             ({"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine false"),
                             ({"_remove_final_layer_norm": True}, "_remove_final_layer_norm: no final norm")):
        with pytest.raises(ModelError, match=message):
            spec("opt", **{"hidden_size": 64, "num_attention_heads": 4, "word_embed_proj_dim": 64, **changes})
    assert spec("opt", hidden_size=64, num_attention_heads=4, word_embed_proj_dim=64,
                activation_function="gelu").activation == "gelu"  # Galactica's
    assert spec("gptj", n_embd=240, n_head=4, rotary_dim=18).rotary_dim == 18  # by number, not through 0.3
    with pytest.raises(ModelError, match="num_kv_heads 2: Falcon's layers without new_decoder_architecture or multi_query"):
        spec("falcon", hidden_size=64, num_attention_heads=4, num_kv_heads=2, multi_query=False)
    falcon_rw = spec("falcon", alibi=True).alibi  # transformers' default Falcon: 71 heads of 64
    assert len(falcon_rw) == 71 and falcon_rw[0] == pytest.approx(2 ** (-8 / 64) / 8)
    with pytest.raises(ModelError, match="new_decoder_architecture with parallel_attn false"):
        spec("falcon", new_decoder_architecture=True, parallel_attn=False)
    with pytest.raises(ModelError, match="hidden_act `relu` is not supported"):
        spec("falcon", activation="relu")
    with pytest.raises(ModelError, match=r"hidden_act `silu` is not supported; supported: gelu_pytorch_tanh, gelu_new, "
                                         r"gelu \(`starcoder2`'s MLPs are ungated\)"):
        spec("starcoder2", hidden_act="silu")
    with pytest.raises(ModelError, match="hidden_act `gelu` is not supported; supported: relu2"):
        spec("nemotron", hidden_act="gelu")
    with pytest.raises(ModelError, match="hidden_act `gelu_new` is not supported; supported: silu, gelu_pytorch_tanh$"):
        spec("stablelm", hidden_act="gelu_new")


def test_ungated_gelus_are_transformers_activations():
    """The ungated MLPs' GELUs are transformers' ``gelu_pytorch_tanh``, ``gelu_new`` (bit for
    bit in bfloat16, where it rounds step by step) and ``gelu``."""
    from transformers.activations import ACT2FN

    from backends.torch.model import GELUS, PlainMLP

    x = torch.linspace(-6, 6, 400).view(100, 4)
    for theirs, ours in GELUS.items():
        mlp = PlainMLP(4, 4, activation=ours)
        with torch.no_grad():
            mlp.up_proj.weight.copy_(torch.eye(4))
            mlp.down_proj.weight.copy_(torch.eye(4))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(mlp.to(dtype)(x.to(dtype)), ACT2FN[theirs](x.to(dtype))), (theirs, dtype)


@pytest.mark.parametrize("arch,prefix", [("gpt2", "transformer."), ("opt", "model.")])
def test_first_releases_names(checkpoints, tmp_path, arch, prefix):
    """GPT-2's first releases name their weights without ``transformer.`` and hold each layer's
    causal mask (``h.N.attn.bias``, ``masked_bias``), OPT's without ``model.``: the same model,
    logprobs for logprobs."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / f"{arch}-first"
    shutil.copytree(checkpoints[arch], folder)
    state = load_file(str(folder / "model.safetensors"))
    assert sum(k.startswith(prefix) for k in state) > 10
    renamed = {k.removeprefix(prefix): v for k, v in state.items()}
    for layer in range(2 if arch == "gpt2" else 0):
        renamed[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(512, 512, dtype=torch.bool)).view(1, 1, 512, 512)
        renamed[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompt, first = engine_prompt_logprobs(folder)
    assert engine_prompt_logprobs(checkpoints[arch]) == (prompt, first)


def test_apertus_specs_and_xielu():
    """Apertus: xIELU with per-layer slopes, its MLP ungated; xIELU is read for Apertus only; a
    checkpoint without the activation's beta and eps takes transformers' defaults."""
    from transformers.activations import XIELUActivation

    from backends.torch.model import XieluMLP

    s = ModelSpec.from_hf_config(_config("apertus", hidden_act="xielu"))
    assert s.activation == "xielu" and s.qk_norm and not s.qk_norm_after_rotary
    with pytest.raises(ModelError, match="hidden_act `xielu` is not supported; supported: silu, gelu_pytorch_tanh"):
        ModelSpec.from_hf_config(_config("llama", hidden_act="xielu"))
    ref = XIELUActivation(alpha_p_init=0.6, alpha_n_init=1.1, dtype=torch.float32)
    mlp = XieluMLP(4, 6)
    with torch.no_grad():
        mlp.up_proj.weight.copy_(torch.eye(6, 4))  # the first 4 channels are x itself
        mlp.down_proj.weight.copy_(torch.eye(4, 6))
        mlp.alpha_p.copy_(ref.alpha_p), mlp.alpha_n.copy_(ref.alpha_n), mlp.beta.fill_(0.5), mlp.eps.fill_(-1e-6)
        x = torch.linspace(-6, 6, 400).view(100, 4)
        assert torch.allclose(mlp(x), ref._xielu_python(x), atol=1e-6)


def test_a_config_or_tokenizer_of_custom_code_is_refused_by_name(checkpoints, tmp_path):
    """Hunyuan's dense releases ship their tokenizer as custom code (``tokenization_hy.py``,
    ``hy.tiktoken``, no tokenizer.json), as a config may be (Kimi K2's ``kimi_k2``): the engine
    runs no checkpoint's code, and says so instead of transformers' question or a later failure."""
    from backends.torch.loader import load_checkpoint

    folder = tmp_path / "hy"
    shutil.copytree(checkpoints["hunyuan"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "HYTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_hy.HYTokenizer", None]}}))
    (folder / "tokenization_hy.py").write_text("raise SystemExit('never run')\n")
    with pytest.raises(ValueError, match=r"its tokenizer \(`HYTokenizer`\) is custom code, which is not run; give the "
                                         r"folder a tokenizer.json"):
        load_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_kimi.KimiK2Config"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"its config \(`kimi_k2`\) is custom code, which is not run"):
        load_checkpoint(folder)


def test_exaone_with_a_window_and_no_sliding_layer_rotates_none(checkpoints, tmp_path):
    """EXAONE 4 with sliding_window set and every layer full: transformers rotates none of them (its
    full layers never rotate where the config has a window); so does the engine."""
    folder = shutil.copytree(checkpoints["exaone4"], tmp_path / "all-full")
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "layer_types": ["full_attention"] * 2}))
    spec = ModelSpec.from_hf_config(SimpleNamespace(**{**settings, "layer_types": ["full_attention"] * 2}))
    assert spec.nope_layers == (0, 1) and spec.sliding_window is None
    assert_prompt_logprobs_match_transformers(folder, torch.float32, 1e-4)


def test_what_some_configs_say_and_transformers_does_not_read():
    """Youtu's and EXAONE-MoE's projections have no biases, whatever the config says; Solar Open's
    every layer has experts; Hunyuan-A13B's head size is its attention_head_dim (it has no head_dim)."""
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    youtu = ModelSpec.from_hf_config(SimpleNamespace(**common, model_type="youtu", mlp_bias=True, attention_bias=True,
                                                     kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                                                     qk_rope_head_dim=8, v_head_dim=12))
    assert not youtu.mlp_bias and not youtu.qkv_bias and not youtu.o_bias
    solar = ModelSpec.from_hf_config(SimpleNamespace(**common, model_type="solar_open", first_k_dense_replace=2,
                                                     n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                     n_shared_experts=1, norm_topk_prob=True))
    assert solar.dense_layers == () and solar.num_experts == 8
    hunyuan = ModelSpec.from_hf_config(SimpleNamespace(**common, model_type="hunyuan_v1_moe", head_dim=None,
                                                       attention_head_dim=32, num_experts=[4] * 4, moe_topk=[2] * 4))
    assert hunyuan.head_dim == 32 and (hunyuan.num_experts, hunyuan.experts_per_token) == (4, 2)
    with pytest.raises(ModelError, match=r"moe_topk \[1, 2, 2, 2\]: one positive number for every layer"):
        ModelSpec.from_hf_config(SimpleNamespace(**common, model_type="hunyuan_v1_moe", num_experts=4,
                                                 moe_topk=[1, 2, 2, 2]))


def test_hunyuan_specs():
    # Hunyuan-7B's rope: "dynamic" with alpha 1000, a fixed base of theta * alpha ** (d / (d - 2));
    # a plain "dynamic" (no alpha) is dynamic NTK as anywhere.
    s = ModelSpec.from_hf_config(_config("hunyuan_v1_dense", head_dim=128, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}))
    assert s.rope_scaling is None and s.rope_theta == pytest.approx(10000.0 * 1000.0 ** (128 / 126))
    assert s.qk_norm and s.qk_norm_after_rotary and not s.qk_norm_whole
    plain = ModelSpec.from_hf_config(_config("hunyuan_v1_dense", rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    assert plain.rope_scaling["rope_type"] == "dynamic" and plain.rope_theta == 10000.0


def test_cohere_specs():
    # Command R7B / A's shape: three sliding layers of every four (the pattern, or layer_types),
    # the fourth without rotary; layer_norm_eps is their norms' epsilon.
    r7b = ModelSpec.from_hf_config(_config("cohere2", layer_norm_eps=1e-5, logit_scale=0.25, sliding_window=16,
                                           sliding_window_pattern=4))
    assert [r7b.window_of(i) for i in range(8)] == [16, 16, 16, None] * 2 and r7b.nope_layers == (3, 7)
    assert r7b.rms_norm_eps == 1e-5 and r7b.logit_scale == 0.25 and r7b.centered_norms and r7b.parallel_blocks
    assert r7b.interleaved_rotary and r7b.float_rotary and r7b.rounded_rotary_tables and not r7b.qk_norm
    unwindowed = ModelSpec.from_hf_config(_config("cohere2", layer_norm_eps=1e-5, sliding_window=None))
    assert unwindowed.nope_layers == tuple(range(8))  # transformers rotates only the sliding layers
    plus = ModelSpec.from_hf_config(_config("cohere", layer_norm_eps=1e-5, use_qk_norm=True, logit_scale=1.0))
    assert plus.qk_norm and plus.qk_norm_per_head and plus.logit_scale is None and plus.nope_layers == ()
    with pytest.raises(ModelError, match="logit_scale 0 must be a positive number"):
        ModelSpec.from_hf_config(_config("cohere", layer_norm_eps=1e-5, logit_scale=0))


def test_granite4_specs():
    dense = ModelSpec.from_hf_config(_config("granitemoehybrid", num_local_experts=0, shared_intermediate_size=96,
                                             layer_types=["attention"] * 8, position_embedding_type="rope",
                                             attention_multiplier=0.015625))
    assert not dense.is_moe and dense.intermediate_size == 96 and dense.nope_layers == ()
    moe = ModelSpec.from_hf_config(_config("granitemoehybrid", num_local_experts=8, num_experts_per_tok=2,
                                           shared_intermediate_size=96, layer_types=["attention"] * 8,
                                           position_embedding_type=None))
    assert moe.is_moe and moe.shared_expert_size == 96 and not moe.shared_expert_gated and moe.softmax_top_k
    assert moe.nope_layers == tuple(range(8))
    # Its hybrids (test_torch_mamba.py): Mamba2 layers, by their old name or transformers 5's
    for kinds in (["mamba", "attention"] * 4, ["linear_attention", "full_attention"] * 4):
        hybrid = ModelSpec.from_hf_config(_config("granitemoehybrid", num_local_experts=0, shared_intermediate_size=96,
                                                  layer_types=kinds, mamba_n_heads=8, mamba_n_groups=1,
                                                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2))
        assert hybrid.linear_layers == (0, 2, 4, 6) and hybrid.mamba.head_dim == 16 and hybrid.recurrent
    with pytest.raises(ModelError, match="layer 0 is a `conv` layer; Granite 4's layers are `mamba` or `attention`"):
        ModelSpec.from_hf_config(_config("granitemoehybrid", num_local_experts=0, shared_intermediate_size=96,
                                         layer_types=["conv", "attention"] * 4))
    shared = ModelSpec.from_hf_config(_config("granitemoeshared", num_local_experts=4, num_experts_per_tok=2,
                                              shared_intermediate_size=0))
    assert shared.is_moe and shared.shared_expert_size == 0
