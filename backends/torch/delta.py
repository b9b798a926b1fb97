"""Gated DeltaNet: the linear-attention layers of Qwen3-Next, Qwen3.5 and OLMo Hybrid, over per-sequence state.

Such a layer keeps no keys and values per token. Each value head holds a matrix ``S`` of
``key_dim x value_dim`` numbers that every token updates by the gated delta rule (Yang et al.,
"Gated Delta Networks", arXiv 2412.06464): the state decays by ``exp(g)``, then the value it
already predicts for the token's key is corrected towards the token's value by a step ``beta``,
and the token reads the updated state with its query::

    S = exp(g) S;  S += beta k (v - S^T k)^T;  out = S^T q

Queries and keys are L2-normalised (the query then scaled by ``key_dim ** -0.5``); ``g`` and
``beta`` come from the token (``-exp(A_log) softplus(a + dt_bias)`` and ``sigmoid(b)``).
Before all this the token's query, key and value pass a short causal convolution (``kernel``
taps per channel, then SiLU), whose last ``kernel - 1`` inputs are state too. The output is
normalised per head, gated by ``silu(z)`` and projected back.

Both states live in :class:`.state.RecurrentState`, one slot per running sequence. A decode
step updates every decoding sequence's state at once; a prompt chunk runs the chunked form of
the rule (:func:`delta_rule_chunked`), which turns each block of 64 tokens into a few matrix
products, from the state where the sequence's previous chunk left it. Because a state holds a
sequence's whole past, not one token's, the paged cache's other tricks apply differently or
not at all to these models: the prefix cache keeps states at block boundaries besides the blocks
(a block's tokens say nothing about the state before them; :class:`.state.StateCache`), no draft
tokens (a rejected one would have updated the state), no CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .state import causal_conv

CHUNK = 64
"""Tokens per block of the chunked rule (what transformers and flash-linear-attention use)."""


@dataclass(frozen=True)
class DeltaShape:
    """The sizes of a Gated DeltaNet layer: key heads (queries as many), value heads (a multiple
    of them: each key head serves ``value_heads / key_heads`` value heads in turn), their
    dimensions, and the convolution's taps."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int
    beta_scale: float = 1.0  # OLMo Hybrid's linear_allow_neg_eigval: beta in [0, 2]
    norm_eps: float | None = None  # the output norm's epsilon; None: the model's (OLMo Hybrid's: 1e-5)

    @property
    def key_size(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_size(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_size(self) -> int:
        """Channels of the convolution: queries, keys and values."""
        return 2 * self.key_size + self.value_size

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A sequence's state in one layer: a ``key_dim x value_dim`` matrix a value head."""
        return (self.value_heads, self.key_dim, self.value_dim)

    @classmethod
    def of(cls, cfg: Any, error: Callable[[str], Exception]) -> "DeltaShape":
        """From a Qwen3-Next or Qwen3.5 config's ``linear_*`` keys."""
        shape = cls(*positive_ints(cfg, error, "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                   "linear_value_head_dim", "linear_conv_kernel_dim"))
        if shape.value_heads % shape.key_heads:
            raise error(f"linear_num_value_heads {shape.value_heads} must be a multiple of linear_num_key_heads "
                        f"{shape.key_heads}")
        return shape


def positive_ints(cfg: Any, error: Callable[[str], Exception], *keys: str) -> list[int]:
    """The config's ``keys``, each refused unless a positive integer."""
    values = [getattr(cfg, key, None) for key in keys]
    for key, value in zip(keys, values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise error(f"{key} {value!r} must be a positive integer")
    return values


class GatedRMSNorm(nn.Module):
    """Each head's output normalised, scaled (in the model's dtype) and gated by ``silu(z)`` in
    float32, rounded once, as transformers' ``RMSNormGated`` does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (``layer``: its index, which state tensors are its own)."""

    sliding = False  # what the decoder asks of a layer's mixer: no window, no rotary
    rotates = False

    def __init__(self, hidden_size: int, shape: DeltaShape, eps: float, layer: int) -> None:
        super().__init__()
        self.layer, self.shape = layer, shape
        # Queries, keys and values (the convolution's input), then z, b and a: one matmul. Our
        # order whatever the checkpoint's (Qwen3-Next groups them by key head: see load).
        self.splits = [shape.conv_size, shape.value_size, shape.value_heads, shape.value_heads]
        self.in_proj = nn.Linear(hidden_size, sum(self.splits), bias=False)
        self.taps = nn.Parameter(torch.empty(shape.conv_size, shape.kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(shape.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(shape.value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(shape.value_dim, eps if shape.norm_eps is None else shape.norm_eps)
        self.out_proj = nn.Linear(shape.value_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: object, meta: AttentionMetadata, q_scale: object = None) -> torch.Tensor:
        n, s = x.shape[0], self.shape
        mixed, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        states = meta.states
        conv_state, ssm = states.conv[self.layer], states.ssm[self.layer]
        mixed = causal_conv(mixed, self.taps, None, conv_state, meta)
        q, k, v = mixed.split([s.key_size, s.key_size, s.value_size], dim=-1)
        beta = b.sigmoid() if s.beta_scale == 1.0 else b.sigmoid() * s.beta_scale
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        q, k = _normed_heads(q.view(n, s.key_heads, s.key_dim), s), _normed_heads(k.view(n, s.key_heads, s.key_dim), s)
        q = q * s.key_dim**-0.5
        v = v.reshape(n, s.value_heads, s.value_dim).float()
        out = rule_over_step(q, k, v, g, beta.float(), ssm, meta)
        out = self.norm(out.to(x.dtype), z.view(n, s.value_heads, s.value_dim))
        return self.out_proj(out.reshape(n, s.value_size))

    def load(self, prefix: str, weights) -> None:
        """The layer's weights (``prefix``: ``layers.N.linear_attn.``): Qwen3.5's projections
        (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) or Qwen3-Next's
        (``in_proj_qkvz`` and ``in_proj_ba``, their rows grouped by key head: each head's query,
        key, values and z's; its b's and a's), or OLMo Hybrid's (``q_proj`` ... ``a_proj``, z's
        ``g_proj``, the norm ``o_norm``, ``o_proj``, the filters as released ``q_conv1d`` ...), the
        filters, ``dt_bias``, ``A_log``, the norm."""
        s = self.shape
        norm, out = "norm.weight", "out_proj.weight"
        if weights.has(prefix + "q_proj.weight"):  # OLMo Hybrid's: each projection apart, z's named g_proj
            parts = [weights.take(prefix + f"{name}_proj.weight") for name in ("q", "k", "v", "g", "b", "a")]
            norm, out = "o_norm.weight", "o_proj.weight"
        elif weights.has(prefix + "in_proj_qkvz.weight"):
            group, hidden = s.value_heads // s.key_heads, self.in_proj.in_features
            qkvz, ba = (self._rows(weights, prefix + name, rows) for name, rows in (
                ("in_proj_qkvz.weight", 2 * s.key_size + 2 * s.value_size), ("in_proj_ba.weight", 2 * s.value_heads)))
            q, k, v, z = qkvz.view(s.key_heads, -1, hidden).split(
                [s.key_dim, s.key_dim, group * s.value_dim, group * s.value_dim], dim=1)
            b, a = ba.view(s.key_heads, 2 * group, hidden).split([group, group], dim=1)
            parts = [p.reshape(-1, hidden) for p in (q, k, v, z, b, a)]
        else:
            parts = [weights.take(prefix + f"in_proj_{name}.weight") for name in ("qkv", "z", "b", "a")]
        weights.copy(self.in_proj.weight, prefix + "in_proj.weight", torch.cat(parts))
        name = prefix + "conv1d.weight"
        if weights.has(prefix + "q_conv1d.weight"):  # OLMo Hybrid's as released: the queries', keys' and values' apart
            filters = torch.cat([weights.take(prefix + f"{part}_conv1d.weight") for part in "qkv"])
            weights.state[name] = filters
        weights.copy(self.taps, name, weights.filters(name, s.conv_size, s.kernel))
        weights.copy(self.dt_bias, prefix + "dt_bias")
        weights.copy(self.A_log, prefix + "A_log")
        weights.copy(self.norm.weight, prefix + norm)
        weights.copy(self.out_proj.weight, prefix + out)

    @staticmethod
    def _rows(weights, name: str, rows: int) -> torch.Tensor:
        """Weight ``name``, refused unless it has ``rows`` rows (the config's sizes)."""
        value = weights.take(name)
        if value.shape[0] != rows:
            raise weights.error(f"weight `{name}` has {value.shape[0]} rows; the config's linear_* sizes make {rows}")
        return value


def _normed_heads(x: torch.Tensor, shape: DeltaShape) -> torch.Tensor:
    """Query or key heads L2-normalised in float32 (epsilon 1e-6 under the root, as
    flash-linear-attention's kernels), each repeated for the value heads it serves."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    group = shape.value_heads // shape.key_heads
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def rule_over_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                   ssm: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The rule over a step's rows (``q``, ``k [rows, heads, key_dim]``, ``v [rows, heads,
    value_dim]``, ``g``, ``beta [rows, heads]``, float32; ``beta`` None: no correction), each
    sequence from its state in ``ssm`` (by the step's slots), which moves on: every decoding
    sequence's one token at once (:func:`delta_rule_step`), each prompt chunk in blocks
    (:func:`delta_rule_chunked`). Returns the outputs ``[rows, heads, value_dim]``."""
    out = torch.empty_like(v)
    d, slots = meta.num_decode, meta.state_slots
    if d:
        out[:d], state = delta_rule_step(q[:d], k[:d], v[:d], g[:d], beta[:d] if beta is not None else None,
                                         ssm.index_select(0, slots[:d]))
        ssm.index_copy_(0, slots[:d], state)
    for j, span in enumerate(meta.prefills):
        slot = slots[d + j : d + j + 1]
        state = ssm.index_select(0, slot)[0]
        # States kept inside the chunk (the prefix cache's): the rule runs to each, then on.
        start = span.start
        for end in sorted({span.start + tokens for tokens, _ in span.keeps} | {span.end}):
            t = lambda x: x[start:end].transpose(0, 1) if x is not None else None  # noqa: E731 - [heads, tokens, ...]
            chunk_out, state = delta_rule_chunked(t(q), t(k), t(v), t(g), t(beta), state)
            out[start:end] = chunk_out.transpose(0, 1)
            start = end
            for tokens, target in span.keeps:
                if span.start + tokens == end:
                    ssm[target] = state
        ssm.index_copy_(0, slot, state[None])
    return out


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``n`` sequences: ``q``, ``k [n, heads, key_dim]``, ``v [n, heads,
    value_dim]``, ``g``, ``beta [n, heads]``, ``state [n, heads, key_dim, value_dim]``, all
    float32. Returns the outputs ``[n, heads, value_dim]`` and the new states. ``beta`` None:
    no correction, ``S = exp(g) S + k v^T`` (decayed linear attention: Mamba2's state space
    model, :mod:`.mamba`)."""
    state = state * g.exp()[..., None, None]
    if beta is not None:
        v = (v - (k.unsqueeze(-2) @ state).squeeze(-2)) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor | None,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over ``L`` tokens of one sequence, a block of ``chunk`` (or ``L``, if fewer)
    at a time: ``q``, ``k [heads, L, key_dim]``, ``v [heads, L, value_dim]``, ``g``, ``beta
    [heads, L]``, from ``state [heads, key_dim, value_dim]``, all float32. Returns the outputs ``[heads, L,
    value_dim]`` and the state after the last token: what :func:`delta_rule_step` gives token
    by token.

    Within a block, with ``G`` the running sum of ``g`` from its start, the state after token
    ``t`` is ``exp(G_t) S0 + sum_{j <= t} exp(G_t - G_j) k_j u_j^T``, where the corrections
    ``u`` solve a unit lower-triangular system: ``u_t + beta_t sum_{j < t} exp(G_t - G_j)
    (k_t . k_j) u_j = beta_t (v_t - exp(G_t) S0^T k_t)``. So each block takes two triangular
    solves (independent of ``S0``, for every block at once) and three matrix products with the
    state, in turn. Every exponent is at most 0. Tokens padding the last block have ``g``,
    ``beta``, ``k`` and ``q`` 0: they leave the state as it is. ``beta`` None: no correction
    (:func:`delta_rule_step`), ``u`` is ``v`` and there is nothing to solve."""
    heads, length, key_dim = k.shape
    chunk = min(chunk, length)  # a short prompt chunk: one block of its own length, no padding
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, pad))
        beta = F.pad(beta, (0, pad)) if beta is not None else None
    blocks = (length + pad) // chunk
    q, k, v = (x.reshape(heads, blocks, chunk, -1) for x in (q, k, v))
    g = g.reshape(heads, blocks, chunk)
    G = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [h, b, t, j]
    u_values, u_state = v, None
    if beta is not None:
        beta = beta.reshape(heads, blocks, chunk)
        k_beta = k * beta[..., None]
        # The system's strictly lower part (solve_triangular takes its diagonal as ones).
        system = (k_beta @ k.transpose(-1, -2)) * decay
        u_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
        u_state = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal, the token itself included
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]  # each key decayed to its block's end
    out = torch.empty_like(v)
    for i in range(blocks):
        u = u_values[:, i] - u_state[:, i] @ state if u_state is not None else u_values[:, i]
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * G[:, i, -1, None, None].exp() + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, blocks * chunk, -1)[:, :length], state
