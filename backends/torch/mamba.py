"""Mamba2 layers (Granite 4's hybrid models, Bamba, Nemotron-H, Falcon-H1), over per-sequence state.

A Mamba2 mixer projects each token to a gate ``z``, the convolution's input (``x`` of
``heads x head_dim``, and ``B``, ``C`` of ``groups x state_size``, each group serving
``heads / groups`` heads) and a time step per head. After the short causal convolution (then
SiLU), each head's state ``h [state_size, head_dim]`` follows the selective state space model::

    dt = softplus(dt + dt_bias);  h = exp(dt A) h + B (dt x)^T;  y = h^T C + D x

with ``A = -exp(A_log)`` (and ``dt`` within ``time_step_limit`` in a prompt's tokens, not in
a decoded one's, as the reference implementations do). That is the delta rule of :mod:`.delta` without its correction:
decayed linear attention with ``C`` for queries, ``B`` for keys and ``dt x`` for values, which
is how it runs here (:func:`.delta.rule_over_step` with no ``beta``; transformers' chunked scan
is the same sums). The output is gated by ``silu(z)``,
normalised over each group of ``head_dim * heads / groups`` channels and projected back
(Falcon-H1: normalised before the gate, or not at all, as its config says).

The states live in :class:`.state.RecurrentState` as linear attention's do, with everything
that follows from that (the prefix cache keeping states at block boundaries, no drafts or
CUDA graphs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .delta import positive_ints, rule_over_step
from .state import causal_conv


@dataclass(frozen=True)
class MambaShape:
    """The sizes of a Mamba2 mixer, and its time steps' bounds."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    kernel: int
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    # Where the output's norm comes: "after_gate" (norm(y * silu(z)), Granite's), "before_gate"
    # (norm(y) * silu(z)) or None (y * silu(z), no norm): Falcon-H1's mamba_rms_norm and
    # mamba_norm_before_gate.
    gate_norm: str | None = "after_gate"
    out_bias: bool | None = None  # out_proj's bias; None: as in_proj's (Falcon-H1: projectors_bias)

    @property
    def inner(self) -> int:
        """The width of ``x`` (and of ``z``, and of the output before its projection)."""
        return self.heads * self.head_dim

    @property
    def has_out_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

    @property
    def conv_size(self) -> int:
        """Channels of the convolution: ``x``, ``B`` and ``C``."""
        return self.inner + 2 * self.groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A sequence's state in one layer: a ``state_size x head_dim`` matrix a head."""
        return (self.heads, self.state_size, self.head_dim)

    @classmethod
    def of(cls, cfg: Any, error: Callable[[str], Exception]) -> "MambaShape":
        """From a Granite 4 config's ``mamba_*`` keys (``mamba_d_head`` "auto": the inner width,
        ``mamba_expand * hidden_size``, over the heads)."""
        heads, groups, state, kernel, expand = positive_ints(cfg, error, "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
                                                         "mamba_d_conv", "mamba_expand")
        head_dim = getattr(cfg, "mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = expand * cfg.hidden_size // heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim * heads != expand * cfg.hidden_size:
            raise error(f"mamba_d_head {head_dim!r} times mamba_n_heads {heads} must be mamba_expand * hidden_size, "
                        f"{expand * cfg.hidden_size}")
        return cls._grouped(error, "mamba_n_heads", "mamba_n_groups", heads, head_dim, groups, state, kernel,
                            bool(getattr(cfg, "mamba_conv_bias", True)), bool(getattr(cfg, "mamba_proj_bias", False)),
                            _time_step_limit(cfg, error))

    @classmethod
    def of_nemotron(cls, cfg: Any, error: Callable[[str], Exception]) -> "MambaShape":
        """From a Nemotron-H config: ``mamba_num_heads`` of ``mamba_head_dim``, ``n_groups``,
        ``ssm_state_size``, ``conv_kernel``; biases by ``use_conv_bias`` and ``use_bias``; time
        steps within ``time_step_limit``, as NVIDIA's own Nemotron-H code holds them (its
        releases: none). transformers 5's port floors them at ``time_step_min`` instead (0.001
        in the releases; it differs where a prompt's time step is below that)."""
        heads, head_dim, groups, state, kernel = positive_ints(cfg, error, "mamba_num_heads", "mamba_head_dim", "n_groups",
                                                           "ssm_state_size", "conv_kernel")
        return cls._grouped(error, "mamba_num_heads", "n_groups", heads, head_dim, groups, state, kernel,
                            bool(getattr(cfg, "use_conv_bias", True)), bool(getattr(cfg, "use_bias", False)),
                            _time_step_limit(cfg, error))

    @classmethod
    def of_falcon_h1(cls, cfg: Any, error: Callable[[str], Exception]) -> "MambaShape":
        """From a Falcon-H1 config: Granite 4's ``mamba_*`` keys, the inner width
        ``mamba_d_ssm`` where given (else ``mamba_expand * hidden_size``), the output's norm by
        ``mamba_rms_norm`` and ``mamba_norm_before_gate``, out_proj's bias by ``projectors_bias``."""
        heads, groups, state, kernel = positive_ints(cfg, error, "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
                                                     "mamba_d_conv")
        if getattr(cfg, "mamba_d_ssm", None) is not None:
            inner = positive_ints(cfg, error, "mamba_d_ssm")[0]
        else:
            inner = positive_ints(cfg, error, "mamba_expand")[0] * cfg.hidden_size
        head_dim = getattr(cfg, "mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = inner // heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim * heads != inner:
            raise error(f"mamba_d_head {head_dim!r} times mamba_n_heads {heads} must be the Mamba layers' width, {inner} "
                        "(mamba_d_ssm, else mamba_expand * hidden_size)")
        norm = ("before_gate" if getattr(cfg, "mamba_norm_before_gate", True) else "after_gate") \
            if getattr(cfg, "mamba_rms_norm", False) else None
        shape = cls._grouped(error, "mamba_n_heads", "mamba_n_groups", heads, head_dim, groups, state, kernel,
                             bool(getattr(cfg, "mamba_conv_bias", True)), bool(getattr(cfg, "mamba_proj_bias", False)),
                             _time_step_limit(cfg, error))
        return dataclasses.replace(shape, gate_norm=norm, out_bias=bool(getattr(cfg, "projectors_bias", False)))

    @classmethod
    def _grouped(cls, error: Callable[[str], Exception], heads_key: str, groups_key: str, heads: int,
                 *rest: Any) -> "MambaShape":
        """The shape, refused where the groups of B and C do not split the heads evenly."""
        groups = rest[1]
        if heads % groups:
            raise error(f"{heads_key} {heads} must be a multiple of {groups_key} {groups}")
        return cls(heads, *rest)


def _time_step_limit(cfg: Any, error: Callable[[str], Exception]) -> tuple[float, float]:
    """``time_step_limit``, checked; none (0 to infinity) where the config has none."""
    limit = getattr(cfg, "time_step_limit", None)
    limit = (0.0, float("inf")) if limit is None else tuple(float(x) for x in limit)
    if len(limit) != 2 or not 0 <= limit[0] <= limit[1]:
        raise error(f"time_step_limit {limit!r} must be two numbers, 0 <= low <= high")
    return limit


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer (``layer``: its index, which state tensors are its own)."""

    sliding = False  # what the decoder asks of a layer's mixer: no window, no rotary
    rotates = False

    def __init__(self, hidden_size: int, shape: MambaShape, eps: float, layer: int) -> None:
        super().__init__()
        self.layer, self.shape, self.eps = layer, shape, eps
        self.splits = [shape.inner, shape.conv_size, shape.heads]  # z, then x B C, then the time steps
        self.in_proj = nn.Linear(hidden_size, sum(self.splits), bias=shape.proj_bias)
        self.taps = nn.Parameter(torch.empty(shape.conv_size, shape.kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.empty(shape.conv_size), requires_grad=False) if shape.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(shape.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(shape.heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(shape.heads), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(shape.inner), requires_grad=False) if shape.gate_norm else None
        self.out_proj = nn.Linear(shape.inner, hidden_size, bias=shape.has_out_bias)

    def forward(self, x: torch.Tensor, rope: object, meta: AttentionMetadata, q_scale: object = None) -> torch.Tensor:
        n, s = x.shape[0], self.shape
        z, xbc, dt = self.in_proj(x).split(self.splits, dim=-1)
        xbc = causal_conv(xbc, self.taps, self.conv_bias, meta.states.conv[self.layer], meta)
        u, b, c = xbc.float().split([s.inner, s.groups * s.state_size, s.groups * s.state_size], dim=-1)
        u = u.view(n, s.heads, s.head_dim)
        group = s.heads // s.groups
        b, c = (t.view(n, s.groups, s.state_size).repeat_interleave(group, dim=1) for t in (b, c))
        # The time steps in the model's dtype, as transformers takes them, then float32; held
        # within dt_limit in a prompt's tokens only, as Mamba2's chunked scan does (mamba_ssm's
        # and transformers'), its one-token update not: by the row's token, not by how the step
        # runs it (a prompt's last token may run as a decode row; a preempted sequence's decoded
        # tokens recomputed as a prompt stay unheld, as they were computed).
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        if s.dt_limit != (0.0, float("inf")):
            dt = torch.where(meta.prompt_rows[:, None], dt.clamp(*s.dt_limit), dt)
        dt = dt.float()
        g = dt * -self.A_log.float().exp()
        out = rule_over_step(c, b, u * dt[..., None], g, None, meta.states.ssm[self.layer], meta)
        y = (out + u * self.D.float()[:, None]).view(n, s.inner)
        if s.gate_norm != "before_gate":
            y = y * F.silu(z.float())
        if s.gate_norm is not None:
            # Normalised over each group's channels in float32, scaled, as transformers' gated norm.
            grouped = y.view(n, s.groups, -1)
            y = self.norm_weight * (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).view(n, s.inner)
        if s.gate_norm == "before_gate":
            y = y * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))

    def load(self, prefix: str, weights) -> None:
        """The layer's weights (``prefix``: ``layers.N.mamba.``)."""
        s = self.shape
        weights.copy(self.in_proj.weight, prefix + "in_proj.weight")
        name = prefix + "conv1d.weight"
        weights.copy(self.taps, name, weights.filters(name, s.conv_size, s.kernel))
        if s.conv_bias:
            weights.copy(self.conv_bias, prefix + "conv1d.bias")
        if s.proj_bias:
            weights.copy(self.in_proj.bias, prefix + "in_proj.bias")
        if s.has_out_bias:
            weights.copy(self.out_proj.bias, prefix + "out_proj.bias")
        for name in ("dt_bias", "A_log", "D"):
            weights.copy(getattr(self, name), prefix + name)
        if self.norm_weight is not None:
            weights.copy(self.norm_weight, prefix + "norm.weight")
        weights.copy(self.out_proj.weight, prefix + "out_proj.weight")
