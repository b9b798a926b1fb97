"""Multi-head latent attention (MLA): DeepSeek-V2's and V3's, GLM-4.7-Flash's, Mistral 4's.

Every token's keys and values come from one small latent. ``kv_a_proj_with_mqa`` projects the
hidden state to a latent of ``kv_rank`` dimensions (then normalised by ``kv_a_layernorm``) and
to one rotated key of ``rope`` dimensions that every head shares. Transformers expands the
latent into each head's key (``nope`` dimensions, then the shared rotated ones) and value
(``v`` dimensions) through ``kv_b_proj``. Queries come from ``q_proj``, or through a low-rank
bottleneck (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``): ``nope`` dimensions a head, then
``rope`` rotated ones.

The cache holds what transformers caches: per token and layer, the normalised latent and the
rotated key, ``kv_rank + rope`` numbers (576 for DeepSeek-V3, where its expanded keys and values
would take 128 heads x 192 and 128 x 128, 40,960). Attention never expands them ("weight absorption", as vLLM's
MLA backends decode): head ``h``'s key part ``W_UK[h] c`` dotted with its query ``q`` is
``(W_UK[h]^T q) . c``, so each query head is carried into the latent's space once, and the
attention is multi-query attention over one head of ``kv_rank + rope`` dimensions whose values
are the latent itself; each head's output then goes back through ``W_UV[h]``. The same products
as transformers' in another order: in float32 its logprobs within 1.3e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .attention import AttentionMetadata, apply_rotary, paged_attention


LATENT_NORM_EPS = 1e-6
"""The epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``: DeepSeek's code and transformers build
them with their norm's default whatever the config's ``rms_norm_eps`` (GLM-4.7-Flash's 1e-5)."""


@dataclass(frozen=True)
class LatentShape:
    """The sizes of a model's latent attention, from its config."""

    q_rank: int  # q_lora_rank: the queries' bottleneck; 0: one projection (q_proj)
    kv_rank: int  # kv_lora_rank: the latent's width
    nope: int  # qk_nope_head_dim: a query or key head's dimensions without rotary
    rope: int  # qk_rope_head_dim: its rotated ones (the key's shared by every head)
    v: int  # v_head_dim
    bias: bool = False  # attention_bias: q_a_proj and kv_a_proj_with_mqa have biases (o_proj: ModelSpec.o_bias)

    @property
    def cache_dim(self) -> int:
        """Numbers a token keeps in the cache, a layer: the latent, then the rotated key."""
        return self.kv_rank + self.rope

    @property
    def query_dim(self) -> int:
        """A query head's dimensions as the checkpoint gives them (and the scores' scale counts)."""
        return self.nope + self.rope

    @classmethod
    def of(cls, cfg: Any, error: Callable[[str], Exception]) -> "LatentShape":
        """The shape a DeepSeek-V2/V3 style config gives; sizes checked positive (the rotated
        part even), ``q_lora_rank`` null or 0 meaning no bottleneck."""
        sizes = {}
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(cfg, key, None)
            if key == "q_lora_rank" and value is None:
                value = 0
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "q_lora_rank" else 1):
                raise error(f"{key} {value!r} must be a positive integer" + (" or null" if key == "q_lora_rank" else ""))
            sizes[key] = value
        if sizes["qk_rope_head_dim"] % 2:
            raise error(f"qk_rope_head_dim {sizes['qk_rope_head_dim']} must be even (its dimensions rotate in pairs)")
        return cls(q_rank=sizes["q_lora_rank"], kv_rank=sizes["kv_lora_rank"], nope=sizes["qk_nope_head_dim"],
                   rope=sizes["qk_rope_head_dim"], v=sizes["v_head_dim"],
                   bias=bool(getattr(cfg, "attention_bias", False)))


def latent_scale(shape: LatentShape, scaling: dict[str, Any] | None) -> float:
    """The scores' factor as transformers computes it: ``query_dim ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim)`` squared where the rope scaling has one (DeepSeek-V3's
    ``0.1 * mscale_all_dim * ln(factor) + 1``, for factors above 1), unless it says
    ``apply_yarn_scaling: false`` (how Mistral's own format's ``apply_scale: false`` reads, which
    vLLM and SGLang honour: transformers 5.25 does not look)."""
    scale = shape.query_dim**-0.5
    scaling = scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    factor = float(scaling.get("factor") or 1.0)
    applied = scaling.get("apply_yarn_scaling", True) is not False
    if scaling.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1 and applied:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """One layer's latent attention. ``norm(size)``: one of the model's RMSNorms; ``scale``:
    the scores' factor (:func:`latent_scale`). Rotary tables are those of a ``rope``-wide head
    (the model's ``head_dim`` is ``rope`` for these models)."""

    sliding = False  # no such model has a sliding window
    rotates = True

    def __init__(self, hidden_size: int, heads: int, shape: LatentShape, o_bias: bool, layer: int, scale: float,
                 norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.layer, self.heads, self.shape, self.scale = layer, heads, shape, scale
        self.half = shape.rope // 2
        q_out = heads * shape.query_dim
        if shape.q_rank:
            self.q_a_proj = nn.Linear(hidden_size, shape.q_rank, bias=shape.bias)
            self.q_a_layernorm = norm(shape.q_rank)
            self.q_b_proj = nn.Linear(shape.q_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, shape.cache_dim, bias=shape.bias)
        self.kv_a_layernorm = norm(shape.kv_rank)
        # kv_b_proj's two halves per head, kept as matrices (not linears: no weight format packs
        # them, they multiply per head): W_UK [heads, nope, kv_rank], W_UV [heads, v, kv_rank].
        self.w_uk = nn.Parameter(torch.empty(heads, shape.nope, shape.kv_rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(heads, shape.v, shape.kv_rank), requires_grad=False)
        self.o_proj = nn.Linear(heads * shape.v, hidden_size, bias=o_bias)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n, shape = x.shape[0], self.shape
        q = self.q_proj(x) if not shape.q_rank else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.heads, shape.query_dim)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((shape.kv_rank, shape.rope), dim=-1)
        latent = self.kv_a_layernorm(latent)
        # The queries' rotated parts and the shared key together: one set of ops for both.
        rotated = apply_rotary(torch.cat((q[..., shape.nope :], k_rot.unsqueeze(1)), dim=1), *rope, self.half).to(x.dtype)
        # Each head's query into the latent's space: [heads, n, nope] @ [heads, nope, kv_rank].
        q_latent = torch.bmm(q[..., : shape.nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, rotated[:, : self.heads]), dim=-1)
        if q_scale is not None:  # Mistral 4: the whole query scaled by its position (as Ministral 3's)
            query = query * q_scale
        key = torch.cat((latent, rotated[:, self.heads]), dim=-1).unsqueeze(1)
        out = paged_attention(query, key, None, meta, self.layer, self.scale)  # [n, heads, kv_rank]
        out = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2))  # [heads, n, v]
        return self.o_proj(out.transpose(0, 1).reshape(n, self.heads * shape.v))

    def load(self, prefix: str, weights: Any, layout: torch.Tensor | None) -> None:
        """Copy the layer's attention weights (``prefix``: ``layers.N.self_attn.``) from a
        Hugging Face checkpoint. ``layout``: where each rotated dimension sits here
        (:meth:`.model.ModelSpec.qk_layout`; DeepSeek-V3's interleaved pairs), applied to the
        query heads' rotated rows and the shared key's; None: as they are."""
        shape = self.shape

        def rotated_rows(value: torch.Tensor, first: int, count: int, width: int) -> torch.Tensor:
            """``count`` blocks of ``width`` rows from row ``first`` on, each block's last
            ``rope`` rows moved by ``layout``."""
            if layout is None:
                return value
            blocks = value[first:].reshape(count, width, *value.shape[1:])
            moved = torch.cat((blocks[:, : width - shape.rope], blocks[:, width - shape.rope :][:, layout]), dim=1)
            return torch.cat((value[:first], moved.reshape(-1, *value.shape[1:])))

        query = "q_b_proj" if shape.q_rank else "q_proj"
        if shape.q_rank:
            weights.copy(self.q_a_proj.weight, prefix + "q_a_proj.weight")
            if shape.bias:
                weights.copy(self.q_a_proj.bias, prefix + "q_a_proj.bias")
            weights.copy(self.q_a_layernorm.weight, prefix + "q_a_layernorm.weight")
        name = prefix + query + ".weight"
        weights.copy(getattr(self, query).weight, name, rotated_rows(weights.take(name), 0, self.heads, shape.query_dim))
        for part in ("weight", "bias") if shape.bias else ("weight",):
            name = f"{prefix}kv_a_proj_with_mqa.{part}"
            value = weights.take(name)
            weights.copy(getattr(self.kv_a_proj_with_mqa, part), name, rotated_rows(value, shape.kv_rank, 1, shape.rope))
        weights.copy(self.kv_a_layernorm.weight, prefix + "kv_a_layernorm.weight")
        name = prefix + "kv_b_proj.weight"
        kv_b = weights.take(name)
        if kv_b.shape != (self.heads * (shape.nope + shape.v), shape.kv_rank):
            raise weights.error(f"weight `{name}` has shape {tuple(kv_b.shape)}, "
                                f"expected {(self.heads * (shape.nope + shape.v), shape.kv_rank)}")
        kv_b = kv_b.view(self.heads, shape.nope + shape.v, shape.kv_rank)
        weights.copy(self.w_uk, name + " (keys)", kv_b[:, : shape.nope])
        weights.copy(self.w_uv, name + " (values)", kv_b[:, shape.nope :])
        weights.copy(self.o_proj.weight, prefix + "o_proj.weight")
        if self.o_proj.bias is not None:
            weights.copy(self.o_proj.bias, prefix + "o_proj.bias")
