"""ModelSpec from Hugging Face configs: which layers slide, which rope scalings load, and rope
tables with the same bits as transformers' own."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backends.torch.model import ModelError, ModelSpec, Rotary, apply_rotary, rope_inv_freq

SIZES = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, rms_norm_eps=1e-6)


def spec(cls, **kw):
    return ModelSpec.from_hf_config(cls(**{**SIZES, "num_hidden_layers": 4, **kw}))


def windows(s: ModelSpec) -> list[int | None]:
    return [s.window_of(i) for i in range(s.num_layers)]


@pytest.mark.parametrize(
    "cls,kw,want,kinds",
    [
        (MistralConfig, {"sliding_window": 8}, [8, 8, 8, 8], (False, True)),
        (MistralConfig, {"sliding_window": None}, [None] * 4, (True, False)),
        (Qwen2Config, {"sliding_window": 8}, [None] * 4, (True, False)),  # use_sliding_window is off
        (Qwen2Config, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [None, 8, 8, 8],
         (True, True)),
        (Qwen2Config, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}, [None] * 4,
         (True, False)),
        (Qwen2Config, {"use_sliding_window": True, "sliding_window": 8, "layer_types": [
            "sliding_attention", "full_attention", "sliding_attention", "full_attention"]}, [8, None, 8, None],
         (True, True)),
        (LlamaConfig, {}, [None] * 4, (True, False)),
        (Phi3Config, {"sliding_window": 2047, "pad_token_id": 0}, [2047] * 4, (False, True)),
    ],
)
def test_which_layers_slide(cls, kw, want, kinds):
    s = spec(cls, **kw)
    assert windows(s) == want
    assert s.mask_kinds == kinds


def test_a_config_without_layer_types_slides_from_max_window_layers():
    # transformers before 4.53 had no layer_types; its Qwen2 attention slid from max_window_layers on.
    cfg = SimpleNamespace(model_type="qwen2", **SIZES, num_hidden_layers=3, use_sliding_window=True,
                          sliding_window=16, max_window_layers=2, rope_theta=10000.0, tie_word_embeddings=True)
    assert windows(ModelSpec.from_hf_config(cfg)) == [None, None, 16]


def test_qwen3_has_head_norms_and_its_own_head_dim():
    from transformers import Qwen3Config

    s = spec(Qwen3Config, head_dim=24)
    assert s.qk_norm and s.head_dim == 24 and not s.qkv_bias and not s.o_bias
    assert not spec(Qwen2Config).qk_norm


@pytest.mark.parametrize("model_type", ["zamba2", "rwkv", None])
def test_other_model_types_are_refused_with_the_supported_list(model_type):
    cfg = SimpleNamespace(model_type=model_type, **SIZES, num_hidden_layers=2)
    with pytest.raises(ModelError, match="supported: llama, qwen2, qwen3, mistral, phi3"):
        ModelSpec.from_hf_config(cfg)


def longrope(pairs, old_ctx=1024):
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
            "long_factor": [1.5 + 2.0 * i for i in range(pairs)], "original_max_position_embeddings": old_ctx}


def test_partial_rotary_and_longrope_load():
    # Phi-4-mini: a quarter of each head unrotated, LongRoPE; Phi-3.5-mini: LongRoPE on all of it.
    s = spec(Phi3Config, partial_rotary_factor=0.75, pad_token_id=0, rope_scaling=longrope(6))
    assert (s.rotary_dim, s.rotated, s.rope_scaling["rope_type"]) == (12, 12, "longrope")
    s = spec(Phi3Config, pad_token_id=0, original_max_position_embeddings=1024, rope_scaling=longrope(8))
    assert (s.rotary_dim, s.rotated, s.context_length) == (None, 16, 4096)
    assert s.qk_layout() is None and s.qkv_row_order() is None


@pytest.mark.parametrize("partial,why", [
    (0.5625, "partial_rotary_factor 0.5625 rotates 9 of the 16 dimensions of a head; it must rotate an even number"),
    (0.1, "partial_rotary_factor 0.1 rotates 1 of the 16"),
])
def test_a_partial_rotary_that_cannot_pair_is_refused(partial, why):
    legacy = SimpleNamespace(model_type="phi3", **SIZES, num_hidden_layers=2, partial_rotary_factor=partial)
    with pytest.raises(ModelError, match=why):
        ModelSpec.from_hf_config(legacy)


@pytest.mark.parametrize("scaling,why", [
    ({**longrope(8), "long_factor": [1.0] * 7}, "rope scaling `longrope` needs `long_factor`: a list of 8 numbers"),
    ({k: v for k, v in longrope(8).items() if k != "short_factor"}, "needs `short_factor`: a list of 8 numbers"),
    ({"rope_type": "dynamic"}, "rope scaling `dynamic` needs a `factor`"),
    ({"type": "linear", "factor": 0}, "rope scaling `linear` needs a `factor`"),
    ({"rope_type": "su", "factor": 2.0},
     "rope scaling `su` is not supported; supported: default, linear, dynamic, llama3, yarn, longrope, proportional"),
])
def test_rope_scalings_that_cannot_load_are_refused_by_name(scaling, why):
    cfg = SimpleNamespace(model_type="llama", **SIZES, num_hidden_layers=2, rope_theta=10000.0, rope_scaling=scaling)
    with pytest.raises(ModelError, match=why):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("scaling,want", [
    (None, 4096),
    ({"rope_type": "linear", "factor": 4.0}, 16384),
    ({"rope_type": "dynamic", "factor": 2.0}, 8192),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # Qwen2.5's recipe
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}, 4096),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 1024}, 4096),
    (longrope(8), 4096),
])
def test_the_context_a_rope_scaling_serves(scaling, want):
    # What vLLM derives: max_position_embeddings is the original length for linear and dynamic
    # scaling; YaRN's is its original_max_position_embeddings; Llama 3 and LongRoPE configs
    # already give the stretched one.
    cfg = SimpleNamespace(model_type="llama", **SIZES, num_hidden_layers=2, rope_theta=10000.0, rope_scaling=scaling)
    assert ModelSpec.from_hf_config(cfg).context_length == want


def rotated_part(s, table):
    """The rotated dimensions of our table rows, in transformers' order (cat(first, second))."""
    half, pairs = s.head_dim // 2, s.rotated // 2
    return torch.cat((table[:, :pairs], table[:, half : half + pairs]), dim=-1)


@pytest.mark.parametrize("arch", ["phi3-partial-longrope", "phi3-longrope", "llama-dynamic"])
def test_length_dependent_rope_tables_are_transformers_one_position_at_a_time(arch):
    # transformers recomputes LongRoPE and dynamic NTK per forward pass from the longest position
    # in it; fed one position at a time (as generation feeds them), position p gets what a
    # sequence of p + 1 tokens gets. Our tables hold exactly that, row by row, past the original
    # context (64 positions; dynamic: max_position_embeddings 64, factor 3).
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    if arch == "llama-dynamic":
        cfg = LlamaConfig(**{**SIZES, "max_position_embeddings": 64}, num_hidden_layers=2,
                          rope_scaling={"rope_type": "dynamic", "factor": 3.0})
        theirs = LlamaRotaryEmbedding(cfg)
    else:
        partial = 0.75 if arch == "phi3-partial-longrope" else 1.0
        cfg = Phi3Config(**SIZES, num_hidden_layers=2, pad_token_id=0, partial_rotary_factor=partial,
                         original_max_position_embeddings=64, rope_scaling=longrope(int(8 * partial), 64))
        theirs = Phi3RotaryEmbedding(cfg)
    s = ModelSpec.from_hf_config(cfg)
    ours = Rotary(s, 200)
    x = torch.zeros(1, 1, s.head_dim)
    for p in range(200):
        cos, sin = theirs(x, torch.tensor([[p]]))
        assert torch.equal(rotated_part(s, ours.cos[p : p + 1]), cos[0]), p
        got_sin = rotated_part(s, ours.sin[p : p + 1])
        pairs = s.rotated // 2
        assert torch.equal(torch.cat((-got_sin[:, :pairs], got_sin[:, pairs:]), -1), sin[0]), p
    # The passed dimensions: cos 1, sin 0 (a rotation by nothing).
    passed = torch.ones(s.head_dim, dtype=torch.bool)
    passed[: s.rotated // 2] = passed[s.head_dim // 2 : s.head_dim // 2 + s.rotated // 2] = False
    assert torch.equal(ours.cos[:, passed], torch.ones(200, int(passed.sum())))
    assert torch.equal(ours.sin[:, passed], torch.zeros(200, int(passed.sum())))
    # Within the original context the original frequencies; past it, others.
    inv, factor = rope_inv_freq(s)
    for p, same in ((50, True), (150, False)):
        plain = torch.cat((p * inv, p * inv)).cos() * factor
        assert torch.allclose(rotated_part(s, ours.cos[p : p + 1])[0], plain) == same
    if arch != "llama-dynamic":
        assert factor == pytest.approx(math.sqrt(1 + math.log(4096 / 64) / math.log(64)))


def test_a_partial_rotary_in_our_layout_is_transformers_rotation():
    # Phi-4-mini's heads: the first 12 of 16 dimensions rotate in pairs 6 apart, the last 4
    # pass. Here pairs sit head_dim / 2 apart (apply_rotary, the C kernels): the loader moves
    # the dimensions of q and k (qk_layout), and the rotation of a moved vector is the moved
    # rotation of it.
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    cfg = Phi3Config(**SIZES, num_hidden_layers=2, pad_token_id=0, partial_rotary_factor=0.75,
                     original_max_position_embeddings=64, rope_scaling=longrope(6, 64))
    s = ModelSpec.from_hf_config(cfg)
    layout = s.qk_layout()
    assert layout.tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    positions = torch.tensor([64, 70, 99, 150, 199])  # all past 64: long factors, in one forward as row by row
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    cos, sin = Phi3RotaryEmbedding(cfg)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = Rotary(s, 200).tables(positions, torch.float32)
    for x, want in ((q, want_q), (k, want_k)):
        got = apply_rotary(x[..., layout][0].transpose(0, 1), *ours, 8)
        assert torch.equal(got, want[..., layout][0].transpose(0, 1))
    order = s.qkv_row_order()
    assert order.shape == (16 * (4 + 2 + 2),) and sorted(order.tolist()) == list(range(128))
    assert order[16:32].tolist() == (16 + layout).tolist() and order[96:].tolist() == list(range(96, 128))


ROPES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.5},  # DeepSeek's form
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "truncate": False},
    {"rope_type": "proportional", "partial_rotary_factor": 0.5},  # LFM3's full layers: half the pairs turn
    {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items() if k != "rope_type"))
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
def test_rope_frequencies_and_factor_are_transformers_bits(rope, theta):
    cfg = Qwen2Config(**SIZES, num_hidden_layers=2, rope_scaling=dict(rope), rope_theta=theta)
    s = ModelSpec.from_hf_config(cfg)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, torch.device("cpu"))
    inv, factor = rope_inv_freq(s)
    assert torch.equal(inv, want_inv.float())
    assert factor == pytest.approx(want_factor, rel=1e-12)
    if rope["rope_type"] == "yarn":
        assert factor != 1.0  # the tables below must carry it
    rot = Rotary(s, 64)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), want_inv.float())
    assert torch.equal(rot.cos, torch.cat((freqs, freqs), -1).cos() * want_factor)
    assert torch.equal(rot.sin[:, s.head_dim // 2 :], freqs.sin() * want_factor)
    assert torch.equal(rot.sin[:, : s.head_dim // 2], -(freqs.sin() * want_factor))


def test_yarn_without_original_length_in_its_parameters_takes_the_configs():
    cfg = SimpleNamespace(model_type="qwen2", **{**SIZES, "max_position_embeddings": 8192}, num_hidden_layers=2,
                          rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 2.0},
                          original_max_position_embeddings=2048)
    s = ModelSpec.from_hf_config(cfg)
    assert s.rope_scaling == {"type": "yarn", "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}
