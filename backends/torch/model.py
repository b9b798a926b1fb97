"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Mistral) as plain torch modules.

RMSNorm, rotary embeddings with the config's scaling, grouped-query attention over the paged KV
cache, SwiGLU, tied or untied embeddings. Every forward pass works on a flat batch of tokens from
many sequences at once (continuous batching); :mod:`.attention` knows which tokens belong to whom.
Numerics follow Hugging Face's implementation so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention


class ModelError(ValueError):
    """The checkpoint is not a decoder this engine can run."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a checkpoint, from its Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    o_bias: bool = False  # Llama/Mistral's attention_bias also puts a bias on o_proj (Qwen2's does not)

    SUPPORTED = ("llama", "qwen2", "mistral")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelSpec":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in cls.SUPPORTED:
            raise ModelError(f"model_type `{model_type}` is not supported; supported: {', '.join(cls.SUPPORTED)}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ModelError(f"hidden_act `{cfg.hidden_act}` is not supported (SwiGLU needs silu)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta/rope_scaling.
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = getattr(cfg, "rope_scaling", None) or rope
        scaling = dict(scaling) if scaling else None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ModelError(f"rope scaling `{kind}` is not supported; supported: default, linear, llama3")
            scaling["rope_type"] = kind
        window = getattr(cfg, "sliding_window", None) if model_type != "llama" else None
        if model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            window = None
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "attention_bias", False)) or model_type == "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            sliding_window=window,
            o_bias=bool(getattr(cfg, "attention_bias", False)) and model_type != "qwen2",
        )


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies per rotary pair, with linear or Llama-3 scaling applied."""
    dim = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length, computed once."""

    def __init__(self, spec: ModelSpec, max_len: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(spec))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        # HF's rotate_half(x) * sin is cat(-x2, x1) * sin; with the first half of sin negated it
        # is roll(x) * sin': the same products, one op instead of four.
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)
        self.half = spec.head_dim // 2

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and (signed) sin rows for a step's positions, shaped to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, half: int) -> torch.Tensor:
    return x * cos + x.roll(half, dims=-1) * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.scale = spec.head_dim**-0.5
        self.half = spec.head_dim // 2
        self.sliding_window = spec.sliding_window

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # Rotate q and k together: one set of ops for both.
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim), *rope, self.half)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, meta, self.layer, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The whole decoder: token ids and positions in, logits for chosen rows out."""

    def __init__(self, spec: ModelSpec, max_len: int) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = Rotary(spec, max_len)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, meta)
        # Only rows that sample need the (large) vocabulary projection.
        return self.lm_head(self.norm(x[logits_rows]))

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM."""
        spec = self.spec

        def take(name: str) -> torch.Tensor:
            for key in (name, f"model.{name}"):
                if key in state:
                    return state.pop(key)
            raise ModelError(f"checkpoint has no weight `{name}`")

        def copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if param.shape != value.shape:
                raise ModelError(f"weight `{name}` has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(value)

        copy(self.embed_tokens.weight, take("embed_tokens.weight"), "embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            copy(attn.qkv_proj.weight, qkv, p + "self_attn.qkv_proj.weight")
            if spec.qkv_bias:
                copy(attn.qkv_proj.bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), p + "qkv bias")
            copy(attn.o_proj.weight, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if spec.o_bias:
                copy(attn.o_proj.bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            copy(mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj.weight")
            copy(mlp.down_proj.weight, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
            if spec.mlp_bias:
                copy(mlp.gate_up_proj.bias, torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]), p + "mlp bias")
                copy(mlp.down_proj.bias, take(p + "mlp.down_proj.bias"), p + "mlp.down_proj.bias")
            copy(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            copy(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")
        copy(self.norm.weight, take("norm.weight"), "norm.weight")
        if spec.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head.weight = self.embed_tokens.weight
            state.pop("lm_head.weight", None)
        else:
            copy(self.lm_head.weight, state.pop("lm_head.weight"), "lm_head.weight")
