"""ModelSpec from Hugging Face configs: which layers slide, which rope scalings load, and rope
tables with the same bits as transformers' own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backends.torch.model import ModelError, ModelSpec, Rotary, rope_inv_freq

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


@pytest.mark.parametrize("model_type", ["gemma", "phi", None])
def test_other_model_types_are_refused_with_the_supported_list(model_type):
    cfg = SimpleNamespace(model_type=model_type, **SIZES, num_hidden_layers=2)
    with pytest.raises(ModelError, match="supported: llama, qwen2, qwen3, mistral, phi3"):
        ModelSpec.from_hf_config(cfg)


def test_partial_rotary_and_longrope_are_refused():
    # Phi-4-mini: a quarter of each head unrotated; Phi-3.5: longrope. Both would load and run
    # wrong without these checks.
    with pytest.raises(ModelError, match="partial_rotary_factor 0.75 is not supported"):
        spec(Phi3Config, partial_rotary_factor=0.75, pad_token_id=0)
    legacy = SimpleNamespace(model_type="phi3", **SIZES, num_hidden_layers=2, partial_rotary_factor=0.5)
    with pytest.raises(ModelError, match="partial_rotary_factor 0.5"):
        ModelSpec.from_hf_config(legacy)
    with pytest.raises(ModelError, match="rope scaling `longrope` is not supported"):
        spec(Phi3Config, pad_token_id=0, original_max_position_embeddings=1024, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 1024})


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_unsupported_rope_scalings_are_refused_by_name(kind):
    with pytest.raises(ModelError, match=f"rope scaling `{kind}` is not supported; supported: default, linear, llama3, yarn"):
        spec(LlamaConfig, rope_scaling={"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 1024,
                                        "short_factor": [1.0] * 8, "long_factor": [1.0] * 8})


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
