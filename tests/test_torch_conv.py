"""LFM2: short convolution layers beside attention, their inputs kept in the paged cache a slot a
token (:mod:`backends.torch.conv`). Greedy output and prompt logprobs against transformers (whose
conv layers keep a recurrent state instead), what the cache does for these layers (prefix hits,
preemption, cancelling), the windows' slots, the one-call C step against the packed torch path, the spec
and what is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends.torch.conv import conv_windows
from backends.torch.model import ModelError, ModelSpec
from test_torch_engine import (
    assert_greedy_matches_transformers, assert_preemption_and_cancelling, assert_prefix_hits_match_no_cache, engine_for,
    generate, random_prompts, run,
)
from test_torch_gemma import (
    assert_c_steps_match_the_torch_path, assert_prompt_logprobs_match_transformers, distance, engine_prompt_logprobs,
    hf_prompt_logprobs, packed_torch_path_distance,
)
from test_torch_routed_moe import assert_routing_matches_transformers
from torch_models import assert_built_with_config_refused, gguf_of, hf_greedy, tiny_checkpoint, write_lora


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lfm2") / "lfm2", "lfm2")


@pytest.fixture(scope="module")
def lfm2_moe(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lfm2_moe") / "lfm2_moe", "lfm2_moe")


@pytest.fixture(scope="module")
def lfm3(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lfm3") / "lfm3", "lfm3")


def test_lfm3_greedy_matches_transformers_alone_and_in_a_mixed_batch(lfm3):
    # Conv, sliding attention (window 8), full attention (proportional rotary), conv; prompts of
    # 5 to 40 tokens in 16-token steps.
    assert_greedy_matches_transformers(lfm3)


@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
def test_lfm3_prompt_logprobs_match_transformers(lfm3, dtype, within):
    # Measured 1.2e-6 and 5e-7 (queries and keys rotated in float32 and rounded once, as
    # transformers does).
    assert_prompt_logprobs_match_transformers(lfm3, dtype, within)


@pytest.mark.parametrize("config", [
    {"sliding_window": 64},
    {"use_attention_gate": False},
    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    {"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
])
def test_the_tiny_lfm3_exercises_what_it_sets(lfm3, config):
    """Each of the window, the head gates, the proportional rotary (against turning every pair)
    and the sliding layers' own base moves transformers' own logprobs by far more than the
    comparison above allows (measured 0.49, 0.19, 0.093 and 0.10)."""
    prompt = random_prompts(4, (40,))[0]
    assert distance(hf_prompt_logprobs(lfm3, prompt), hf_prompt_logprobs(lfm3, prompt, **config)) > 0.05


def test_lfm3_prefix_hits_match_no_cache(lfm3):
    assert_prefix_hits_match_no_cache(lfm3)


def test_lfm3_spec(lfm3):
    from transformers import AutoConfig

    s = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(lfm3), local_files_only=True))
    assert s.conv_layers == (0, 3) and s.sliding_window == 8 and s.sliding_layers == (1,) and s.head_gates
    assert s.sandwich_norms and s.float_rotary and s.qk_norm and not s.offset_norms and s.intermediate_size == 96
    assert s.rope_scaling["rope_type"] == "proportional" and s.rotary_dim is None and s.local_rope_theta == 10000.0
    with pytest.raises(ModelError, match="use_sandwich_norm false: LFM3 without its output norms is not supported"):
        ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(lfm3), local_files_only=True, use_sandwich_norm=False))
    with pytest.raises(ModelError, match="sliding_window null: LFM3's sliding_attention layers need a window"):
        ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(lfm3), local_files_only=True, sliding_window=None))
    # transformers' LFM3 takes intermediate_size as it is, and rotates whole heads under a default rotary
    odd = ModelSpec.from_hf_config(AutoConfig.from_pretrained(
        str(lfm3), local_files_only=True, block_auto_adjust_ff_dim=True, partial_rotary_factor=0.5,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    assert odd.intermediate_size == 96 and odd.rotary_dim is None


@pytest.mark.parametrize("fmt,kv", [("int8", "auto"), ("int4", "bfloat16")])
def test_lfm3_c_steps_match_the_packed_torch_path(lfm3, fmt, kv):
    """The one C call per step with LFM3's head gates, output norms, window and conv layers."""
    assert_c_steps_match_the_torch_path(lfm3, weight_format=fmt, kv_cache_dtype=kv)


def test_lfm2_moe_greedy_matches_transformers_alone_and_in_a_mixed_batch(lfm2_moe):
    # LFM2's layers; layer 0's MLP dense, the others' 2 of 4 experts by sigmoid scores plus a
    # choice bias (LFM2-MoE's releases as saved: feed_forward.experts.E.w1, expert_bias).
    assert_greedy_matches_transformers(lfm2_moe)


@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
def test_lfm2_moe_prompt_logprobs_match_transformers(lfm2_moe, dtype, within):
    # Measured 1.2e-6 and 5e-7: the scores, their renormalisation and scaling in bfloat16 as
    # transformers computes them (in float32, 7 of 4,000 rows chose other experts and
    # the distance was 0.09).
    assert_prompt_logprobs_match_transformers(lfm2_moe, dtype, within)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lfm2_moe_routing_matches_transformers_router(lfm2_moe, dtype):
    """The same experts and the same weights as transformers' router on 4,000 rows, and the
    choice bias read (as released, ``feed_forward.expert_bias``) and choosing: without it the
    router picks other experts for some rows."""
    assert_routing_matches_transformers(lfm2_moe, dtype)
    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM
    from backends.torch.moe import SparseMoE

    ckpt = load_checkpoint(lfm2_moe)
    moe = next(m for m in CausalLM.from_state_dict(ckpt.spec, 64, dict(ckpt.weights)).modules() if isinstance(m, SparseMoE))
    x = torch.randn(64, ckpt.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    chosen = moe.route(x)[1].sort(-1).values
    moe.choice_bias.data.zero_()
    assert (chosen != moe.route(x)[1].sort(-1).values).any(-1).sum() >= 8


def test_lfm2_moe_spec(lfm2_moe):
    from transformers import AutoConfig

    s = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(lfm2_moe), local_files_only=True))
    assert s.conv_layers == (0, 1, 3) and s.qk_norm and s.intermediate_size == 80  # no 2/3 adjustment
    assert (s.num_experts, s.experts_per_token, s.expert_size, s.dense_layers) == (4, 2, 24, (0,))
    assert s.sigmoid_routing and s.routing_bias and s.normalize_routing and s.routed_scale == 1.5
    assert s.scores_in_model_dtype and not s.float_router and s.shared_expert_size == 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lfm2_moe_c_steps_match_the_packed_torch_path(lfm2_moe, fmt):
    """Short convolutions and experts in the one C call."""
    assert_c_steps_match_the_torch_path(lfm2_moe, weight_format=fmt)


def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(lfm2):
    # Layers 0, 1 and 3 convolve, layer 2 attends; prompts of 5 to 40 tokens in 16-token steps
    # over blocks of 4: windows that reach into earlier chunks and across blocks.
    assert_greedy_matches_transformers(lfm2)


@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
def test_prompt_logprobs_match_transformers(lfm2, dtype, within):
    # Measured: 1.3e-6 in float32, 5e-7 in bfloat16 (the filters multiply out in float32 and
    # round once, as transformers' conv1d does).
    assert_prompt_logprobs_match_transformers(lfm2, dtype, within)


def test_the_cache_holds_a_convolution_input_a_token_and_serves_prefix_hits(lfm2):
    """A conv layer's cache is one head of hidden_size (64) numbers a token with no values; the
    attention layer's keys and values are as usual. A second prompt sharing 32 tokens reports
    them cached and gives the tokens an engine without the prefix cache gives: its windows read
    the shared blocks' inputs."""
    def inspect(engine):
        kv = engine.kv
        assert [tuple(k.shape[1:]) for k in kv.k] == [(1, 64), (1, 64), (2, 16), (1, 64)]
        assert kv.v[0].shape[-1] == 0 and kv.v[2].data_ptr() != kv.k[2].data_ptr()
        # 3 conv layers x 64 + keys and values of 2 heads x 16, a token; blocks of 4, float32
        assert engine._block_bytes == 4 * (3 * 64 + 2 * 2 * 16) * 4
        assert engine.runner.graphs is None

    assert_prefix_hits_match_no_cache(lfm2, inspect)


def test_preemption_and_cancelling_under_a_tiny_budget(lfm2):
    """12 blocks of 4 tokens for 5 sequences growing to 5 to 11 blocks: preempted sequences
    recompute their convolution inputs and still give their full outputs; every block is free
    after, and after 30 requests cancelled mid-generation."""
    block_bytes = 4 * (3 * 64 + 2 * 2 * 16) * 4
    roomy = engine_for(lfm2, block_size=4, max_batched_tokens=16)
    tight = engine_for(lfm2, block_size=4, max_batched_tokens=16, kv_cache_gb=12 * block_bytes / 2**30)
    try:
        assert_preemption_and_cancelling(roomy, tight)
    finally:
        run(tight.stop())
        run(roomy.stop())


def test_an_lfm2_gguf_file_on_the_torch_engine_and_on_llama_cpp(lfm2, tmp_path, monkeypatch):
    """The same float32 GGUF file (laid out as llama.cpp's converter writes LFM2: its filters
    [hidden, taps], a key-value head count a layer): the torch engine reads it through
    transformers' GGUF reader, the llamacpp backend runs it in llama.cpp; both give
    transformers' greedy tokens of the folder it was written from, and the torch engine its
    logprobs within 1e-4 (measured 1.3e-6)."""
    from backends.llamacpp.engine import LlamaCppEngine

    monkeypatch.setenv("ROUTER_CACHE_DIR", str(tmp_path / "cache"))  # the converted folder
    gguf = gguf_of(lfm2, tmp_path / "lfm2.gguf")
    prompt, got = engine_prompt_logprobs(gguf)
    assert distance(got, hf_prompt_logprobs(lfm2, prompt)) < 1e-4
    prompts = random_prompts(2, (9, 21))
    expected = [hf_greedy(lfm2, p, 12) for p in prompts]
    torch_engine = engine_for(gguf, block_size=4, max_batched_tokens=16)
    llama = LlamaCppEngine(str(gguf), n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=64)
    run(llama.start())
    try:
        assert [run(generate(torch_engine, p, 12))[0] for p in prompts] == expected
        assert [run(generate(llama, p, 12))[0] for p in prompts] == expected
    finally:
        run(torch_engine.stop())
        run(llama.stop())


def test_conv_windows_read_each_rows_positions_by_its_block_table():
    # Two sequences, blocks of 4: rows at positions 0, 1, 5 of the first (blocks 7 and 2) and 9
    # of the second (blocks 3, 8, 6).
    tables = torch.tensor([[7, 2, 0], [3, 8, 6]])
    positions, table_of = torch.tensor([0, 1, 5, 9]), torch.tensor([0, 0, 0, 1])
    slots, valid = conv_windows(positions, tables, table_of, 4, 3)
    assert valid.tolist() == [[False, False, True], [False, True, True], [True, True, True], [True, True, True]]
    # positions p-2, p-1, p; those before the sequence read position 0's slot and are masked
    assert slots.tolist() == [[28, 28, 28], [28, 28, 29], [31, 8, 9], [35, 24, 25]]


def _config(**changes):
    base = dict(model_type="lfm2", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
                rope_theta=1e6, tie_word_embeddings=True, conv_L_cache=3, conv_bias=False,
                layer_types=["conv", "conv", "full_attention", "conv"], block_auto_adjust_ff_dim=True,
                block_ffn_dim_multiplier=None, block_multiple_of=256)
    return SimpleNamespace(**{**base, **changes})


def test_lfm2_specs():
    s = ModelSpec.from_hf_config(_config())
    assert s.conv_layers == (0, 1, 3) and s.conv_kernel == 3 and not s.conv_bias and s.qk_norm
    assert s.intermediate_size == 64 and s.rms_norm_eps == 1e-5
    assert s.kv_entry(0) == dict(kv_heads=1, head_dim=64, values_in_keys=0)
    assert s.kv_entry(2) == dict(kv_heads=2, head_dim=16, values_in_keys=None)
    # LFM2-1.2B's MLP: 8192 * 2/3 = 5461, times 1.0, up to a multiple of 256: 5632
    big = ModelSpec.from_hf_config(_config(intermediate_size=8192, block_ffn_dim_multiplier=1.0))
    assert big.intermediate_size == 5632
    assert ModelSpec.from_hf_config(_config(block_auto_adjust_ff_dim=False)).intermediate_size == 96


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["conv", "mamba", "full_attention", "conv"]}, "layer_types .* must name each of the 4 layers"),
    ({"layer_types": ["conv"] * 3}, "layer_types .* must name each of the 4 layers"),
    ({"conv_L_cache": 0}, "conv_L_cache 0 must be a positive integer"),
])
def test_what_lfm2_configs_are_refused_for(changes, message):
    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(_config(**changes))


@pytest.mark.parametrize("fmt,kv", [("int8", "auto"), ("int4", "auto"), ("int4", "bfloat16"), ("int8", "float16")])
def test_c_steps_match_the_packed_torch_path(lfm2, fmt, kv):
    """The one C call per step computes LFM2's short convolutions too (their inputs written to and
    read from the cache in its element type, a prompt chunk's rows reading the rows before
    them): the packed torch path's tokens, and its logprobs within 0.02."""
    assert_c_steps_match_the_torch_path(lfm2, weight_format=fmt, kv_cache_dtype=kv)


def test_c_steps_with_conv_biases_match_the_packed_torch_path(tmp_path):
    """The same with biases on the conv layers' projections and filters (conv_bias), which the
    releases leave off."""
    assert_c_steps_match_the_torch_path(tiny_checkpoint(tmp_path / "lfm2-bias", "lfm2-bias"), weight_format="int8")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_formats_stay_near_the_float_engine(lfm2, fmt, monkeypatch):
    """Under int8 and int4 the packed projections (as torch operations) stay near the float
    engine (measured 0.002 int8, 0.02 int4)."""
    monkeypatch.setattr("backends.torch.cpu_decode.c_step_refusal", lambda spec: "nothing (the test's torch path)")
    assert packed_torch_path_distance(lfm2, fmt) < (0.05 if fmt == "int8" else 0.3)


def test_adapters_and_draft_models_with_convolutions_are_refused(lfm2, tmp_path):
    from transformers import AutoConfig

    from backends.peft import AdapterError
    from backends.torch import SpeculativeConfig
    from backends.torch.lora import load_adapter

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(lfm2), local_files_only=True))
    folder = write_lora(tmp_path / "a", lfm2, targets=("q_proj",))
    with pytest.raises(AdapterError, match="adapters of a model with short convolutions .LFM2. are not supported"):
        load_adapter("a", folder, spec, torch.float32, torch.device("cpu"))
    target = tiny_checkpoint(tmp_path / "llama", "llama-plain")
    with pytest.raises(ValueError, match="a draft model with short convolutions .LFM2. is not supported"):
        engine_for(target, speculative_config=SpeculativeConfig(method="draft_model", model=str(lfm2),
                                                                num_speculative_tokens=2))


def test_a_filter_of_another_shape_is_refused(lfm2, tmp_path):
    assert_built_with_config_refused(lfm2, tmp_path / "bad", {"conv_L_cache": 4},
                                     r"conv.conv.weight` has shape \(64, 1, 3\), expected \(64, 1, 4\)")
