"""Llama 4 (Scout's and Maverick's shapes, text and image-text checkpoints) on the torch engine:
greedy output and prompt logprobs against transformers (float32 and bfloat16), what the tiny
config exercises, the spec, the layers and the experts, the chunked masks, the static decode path,
adapters, drafted tokens and what is refused by name."""

from __future__ import annotations

import pytest
import torch

from backends.torch.attention import decode_mask, in_window, prefill_mask
from backends.torch.model import ModelError, ModelSpec
from test_torch_engine import (assert_greedy_matches_transformers, assert_prefix_hits_match_no_cache, engine_for,
                               generate, random_prompts, run)
from test_torch_gemma import (assert_prompt_logprobs_match_transformers, distance, hf_prompt_logprobs,
                              packed_torch_path_distance)
from torch_models import hf_greedy, tiny_checkpoint

ARCHS = ["llama4", "llama4-mm"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in (*ARCHS, "llama4-dense")}


def _spec(folder):
    from transformers import AutoConfig

    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(checkpoints, arch):
    # Layers 0 and 2 attend within chunks of 8 positions, layers 1 and 3 to everything, their
    # queries scaled by position; prompts up to 40 tokens in 16-token steps, 20 tokens each (so
    # decode steps cross chunk boundaries). llama4: experts on every layer, one a token;
    # llama4-mm: on layers 1 and 3, two a token.
    assert_greedy_matches_transformers(checkpoints[arch])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,within", [(torch.float32, 1e-4), (torch.bfloat16, 1e-3)])
def test_prompt_logprobs_match_transformers(checkpoints, arch, dtype, within):
    # Measured: 1.1e-6 to 1.2e-6 in float32, 5e-7 in bfloat16 (where transformers' own bfloat16 is
    # 0.008 to 0.010 from its float32). In bfloat16 the temperature rounded before its product, or
    # the rotary in bfloat16, would be 0.005 to 0.008 off: within 1e-3 sees them.
    assert_prompt_logprobs_match_transformers(checkpoints[arch], dtype, within)


@pytest.mark.parametrize("config", [
    {"attention_chunk_size": 16},
    {"floor_scale": 8192},
    {"use_qk_norm": False},
    {"no_rope_layers": [1, 1, 1, 1]},
    {"layer_types": ["full_attention"] * 4},
])
def test_the_tiny_config_exercises_what_it_sets(checkpoints, config):
    """Each setting the comparisons rely on changes transformers' own answer: the chunks' size,
    the NoPE layers' temperature (a floor of 8192 keeps it at 1 over these positions), the
    query and key norms, which layers rotate and which attend in chunks."""
    folder = checkpoints["llama4"]
    prompt = random_prompts(4, (40,))[0]
    assert distance(hf_prompt_logprobs(folder, prompt), hf_prompt_logprobs(folder, prompt, **config)) > 0.1


def test_the_spec_and_the_layers(checkpoints):
    from backends.torch.model import MLP
    from backends.torch.moe import SparseMoE

    spec = _spec(checkpoints["llama4"])
    assert [spec.window_of(i) for i in range(4)] == [8, None, 8, None] and spec.chunked_windows
    assert spec.nope_layers == (1, 3) and spec.nope_temperature == (2.0, 4)
    assert spec.weightless_qk_norm and not spec.qk_norm and spec.interleaved_rotary and spec.float_rotary
    assert (spec.num_experts, spec.experts_per_token, spec.expert_size, spec.intermediate_size) == (4, 1, 48, 96)
    assert spec.weights_on_input and not spec.sigmoid_routing and not spec.normalize_routing
    assert spec.shared_expert_size == 48 and not spec.shared_expert_gated and spec.dense_layers == ()
    assert spec.rope_scaling["rope_type"] == "llama3"
    maverick = _spec(checkpoints["llama4-mm"])
    assert maverick.dense_layers == (0, 2) and maverick.experts_per_token == 2 and not maverick.weightless_qk_norm
    engine = engine_for(checkpoints["llama4"])
    try:
        layers = engine.model.layers
        # norms (without weight) on the rotating layers only; the NoPE layers' queries scaled
        assert [layer.self_attn.q_norm is not None for layer in layers] == [True, False, True, False]
        assert all(layer.self_attn.q_norm is None or layer.self_attn.q_norm.weight is None for layer in layers)
        assert [layer.self_attn.scaled_queries for layer in layers] == [False, True, False, True]
        scales = engine.model.query_scales  # 1 + 2 ln(1 + floor((p + 1) / 4))
        assert scales.dtype == torch.float32 and torch.allclose(scales[:9], 1 + 2 * torch.log(
            torch.tensor([1.0, 1, 1, 2, 2, 2, 2, 3, 3])))
        for layer in layers:
            moe = layer.mlp
            assert isinstance(moe, SparseMoE) and isinstance(moe.shared_expert, MLP) and moe.shared_expert_gate is None
        x = torch.randn(64, 64)
        weights, chosen = layers[0].mlp.route(x)
        assert torch.allclose(weights[:, 0], torch.sigmoid(layers[0].mlp.gate(x).gather(1, chosen))[:, 0])
        assert len(chosen.unique()) == 4  # every expert gets some tokens
        assert engine._decoder is None
    finally:
        run(engine.stop())


def test_the_experts_are_chosen_by_their_logits():
    """Logits past about 17 all have a float32 sigmoid of 1: the choice is by the logits, as
    transformers makes it, each chosen one weighted by its sigmoid."""
    from backends.torch.model import MLP
    from backends.torch.moe import SparseMoE

    spec = ModelSpec.from_hf_config(_config(num_local_experts=4, hidden_size=4, intermediate_size=4))
    moe = SparseMoE(spec, lambda size: MLP(spec.hidden_size, size))
    with torch.no_grad():
        moe.gate.weight.copy_(torch.eye(4))
    weights, chosen = moe.route(torch.tensor([[18.0, 20.0, 1.0, -3.0], [-3.0, 1.0, 0.5, 0.0]]))
    assert chosen[:, 0].tolist() == [1, 1] and weights[:, 0].tolist() == [1.0, float(torch.sigmoid(torch.tensor(1.0)))]


def test_the_experts_weight_their_input():
    """One token, one expert, a zero shared expert: the output is the expert of the weighted
    token (SwiGLU is not linear: weighting its output instead gives another answer)."""
    from backends.torch.model import MLP
    from backends.torch.moe import SparseMoE

    spec = ModelSpec.from_hf_config(_config(num_local_experts=2, hidden_size=8, intermediate_size=4))
    torch.manual_seed(0)
    moe = SparseMoE(spec, lambda size: MLP(spec.hidden_size, size))
    with torch.no_grad():
        moe.shared_expert.down_proj.weight.zero_()
    x = torch.randn(3, 8)
    weights, chosen = moe.route(x)
    want = torch.stack([moe.experts[int(e)](row * w) for row, e, w in zip(x, chosen[:, 0], weights[:, 0])])
    assert torch.allclose(moe(x), want, atol=1e-6)
    weighted_out = torch.stack([moe.experts[int(e)](row) * w for row, e, w in zip(x, chosen[:, 0], weights[:, 0])])
    assert not torch.allclose(moe(x), weighted_out, atol=1e-3)


@pytest.mark.parametrize("window,positions,keys,want", [
    (4, [5], range(8), [False, False, False, False, True, True, False, False]),  # its chunk: 4 to 7, no later
    (4, [3], range(8), [True, True, True, True, False, False, False, False]),
    (4, [4], range(8), [False, False, False, False, True, False, False, False]),  # the first of a chunk: itself
    (3, [8], range(9), [False] * 6 + [True] * 3),
])
def test_chunked_masks(window, positions, keys, want):
    q = torch.tensor(positions)[:, None]
    k = torch.tensor(list(keys))[None, :]
    assert ((k <= q) & in_window(q, k, window, True))[0].tolist() == want
    # a sliding window of the same size sees the last `window` positions instead
    assert ((k <= q) & in_window(q, k, window, False))[0].sum() == min(window, positions[0] + 1)


def test_chunked_prefill_and_decode_masks_agree():
    """A chunk of 5 new tokens at positions 6 to 10 over chunks of 4; a decoding sequence of each
    length sees what the prefill row at its last position sees."""
    mask = prefill_mask(5, 11, 4, torch.device("cpu"), chunked=True)
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6]  # position 6: chunk 4 to 7
    assert mask[2].nonzero().flatten().tolist() == [8]  # position 8 starts a chunk
    assert mask[4].nonzero().flatten().tolist() == [8, 9, 10]
    lengths = torch.tensor([7, 9, 11])
    rows = decode_mask(lengths, 11, 4, chunked=True)[:, 0, 0]
    for row, length in zip(rows, lengths.tolist()):
        assert torch.equal(row, mask[length - 7])  # row i of the prefill: position 6 + i


def test_a_repeated_prompt_hits_the_prefix_cache(checkpoints):
    assert_prefix_hits_match_no_cache(checkpoints["llama4"])


def test_chunks_that_steps_and_blocks_do_not_divide(checkpoints, tmp_path):
    """Chunks of 12 (the checkpoint's weights): a prefix hit of 32 tokens starts inside a chunk,
    steps of 16 end inside them, and 60 decoded tokens cross five chunk boundaries; the
    tokens are transformers'."""
    import json
    import shutil

    folder = shutil.copytree(checkpoints["llama4"], tmp_path / "chunks-12")
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "attention_chunk_size": 12}))
    assert _spec(folder).sliding_window == 12
    assert_prefix_hits_match_no_cache(folder)
    engine = engine_for(folder, block_size=4, max_batched_tokens=16)
    try:
        prompt = random_prompts(8, (30,))[0]
        got, _ = run(generate(engine, prompt, 60))
    finally:
        run(engine.stop())
    assert got == hf_greedy(folder, prompt, 60)


def test_a_release_config_as_saved(checkpoints, tmp_path):
    """Scout's and Maverick's config.json say attn_temperature_tuning 4 and no_rope_layers [],
    which transformers 5's strict config refuses and fills: read as on, and the default layers."""
    import json
    import shutil

    from backends.torch.loader import load_checkpoint

    folder = shutil.copytree(checkpoints["llama4-mm"], tmp_path / "as-released")
    settings = json.loads((folder / "config.json").read_text())
    settings["text_config"].update(attn_temperature_tuning=4, no_rope_layers=[], no_rope_layer_interval=4)
    (folder / "config.json").write_text(json.dumps(settings))
    spec = load_checkpoint(folder).spec
    assert spec.nope_temperature == (2.0, 4) and spec.nope_layers == (3,)  # every fourth, as transformers fills it (the checkpoint's: every second)


def test_the_static_decode_path_matches_transformers(checkpoints):
    """Decode steps on static, padded buffers (what CUDA graphs replay, run eagerly here: the
    experts' models are never captured, so the dense one): the chunked masks there too."""
    from test_torch_graphs import counting, static_engine
    from test_torch_engine import generate_all

    folder = checkpoints["llama4-dense"]
    engine = static_engine(folder, block_size=4, max_batched_tokens=16, max_num_seqs=16)
    shapes = counting(engine)
    try:
        prompts = random_prompts(1, (5, 23, 40, 11, 17))
        for ours, p in zip(generate_all(engine, prompts, 20), prompts):
            assert ours == hf_greedy(folder, p, 20)
    finally:
        run(engine.stop())
    assert shapes  # the static path ran


def test_adapters_of_attention_and_dense_mlps(checkpoints, tmp_path):
    """An adapter of every projection (Llama 4 names its MLPs feed_forward) gives the merged
    checkpoint's tokens; the experts' model refuses its experts' projections by name."""
    from backends.peft import AdapterError
    from backends.torch.lora import load_adapter
    from test_torch_lora import engine_with
    from torch_models import merged_checkpoint, write_lora

    folder = checkpoints["llama4-dense"]
    adapter = write_lora(tmp_path / "a", folder)
    merged = merged_checkpoint(folder, adapter, tmp_path / "merged")
    prompt = random_prompts(6, (20,))[0]
    engine = engine_with(folder, {"a": adapter})
    try:
        got, _ = run(generate(engine, prompt, 10, adapter="a"))
        base, _ = run(generate(engine, prompt, 10))
    finally:
        run(engine.stop())
    assert got == hf_greedy(merged, prompt, 10) and base == hf_greedy(folder, prompt, 10) and got != base
    experts = checkpoints["llama4"]
    with pytest.raises(AdapterError, match="experts, shared expert and router of a mixture of experts cannot be"):
        load_adapter("b", write_lora(tmp_path / "b", experts), _spec(experts), torch.float32, torch.device("cpu"))


def test_drafted_tokens_keep_greedys(checkpoints):
    """A predicted output's drafts (several rows of a sequence a step, past chunk boundaries), a
    wrong one among them: greedy's tokens, in fewer steps than tokens."""
    from test_torch_speculative import assert_drafts_from_a_prediction_keep_greedys

    assert_drafts_from_a_prediction_keep_greedys(checkpoints["llama4"])


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_weights_run_as_torch_operations(checkpoints, arch):
    """The packed path (the C step refuses Llama 4: no C decoder) near the float one, which is
    pinned to transformers above: measured 0.008 and 0.010."""
    assert packed_torch_path_distance(checkpoints[arch], "int8") < 0.05


def _config(**changes):
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**{
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 16, "intermediate_size_mlp": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_local_experts": 4, **changes})


def test_the_shapes_of_a_config_as_released():
    """Scout's and Maverick's settings as their configs give them: every fourth layer NoPE and
    full, the others in chunks of 8192; experts on every layer or every second; the temperature
    on."""
    scout = ModelSpec.from_hf_config(_config(attn_temperature_tuning=True, attention_chunk_size=8192))
    assert scout.nope_layers == (3,) and [scout.window_of(i) for i in range(4)] == [8192, 8192, 8192, None]
    assert scout.nope_temperature == (0.1, 8192) and scout.dense_layers == ()
    maverick = ModelSpec.from_hf_config(_config(interleave_moe_layer_step=2, use_qk_norm=False))
    assert maverick.dense_layers == (0, 2) and not maverick.weightless_qk_norm
    assert ModelSpec.from_hf_config(_config(attn_temperature_tuning=False)).nope_temperature is None
    unchunked = ModelSpec.from_hf_config(_config(attention_chunk_size=None))
    assert all(unchunked.window_of(i) is None for i in range(4))


@pytest.mark.parametrize("changes,message", [
    ({"floor_scale": 0}, "floor_scale 0 must be a positive number"),
    ({"attn_scale": "x"}, "attn_scale 'x' must be a number"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be from 1 to the number of experts, 4"),
    ({"moe_layers": [0, 7]}, r"moe_layers \[0, 7\] must name layers from 0 to 3"),
    ({"attention_chunk_size": None}, "attention_chunk_size None: the chunked_attention layers need a positive number"),
])
def test_what_is_refused_by_name(changes, message):
    """Read off the config's keys as saved (transformers would refuse some of these types first)."""
    from types import SimpleNamespace

    with pytest.raises(ModelError, match=message):
        ModelSpec.from_hf_config(SimpleNamespace(**{**_config().to_dict(), **changes}))


def test_weight_names():
    from backends.torch.loader import _RENAMED, _language_model_weight, _renamed

    outer = _renamed(_RENAMED["llama4"], _language_model_weight)
    assert outer("language_model.model.layers.1.feed_forward.experts.gate_up_proj") == \
        "model.layers.1.mlp.experts.gate_up_proj"
    assert outer("language_model.lm_head.weight") == "lm_head.weight"
    assert outer("vision_model.model.layers.0.mlp.fc1.weight") is None
    assert outer("multi_modal_projector.linear_1.weight") is None
    text = _renamed(_RENAMED["llama4_text"])
    assert text("model.layers.0.feed_forward.shared_expert.gate_proj.weight") == \
        "model.layers.0.mlp.shared_expert.gate_proj.weight"
