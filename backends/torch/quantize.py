"""fp16 weights for CPU serving: projections through fbgemm's fp16-weight matmul.

On a CPU the decoder is limited by reading its weights (small batches) and by float32 matmul
throughput (large ones). Stored in float16 and multiplied by fbgemm's FP16 kernels (weights
widened in registers, float32 accumulation), the projections read half the bytes and run 2-3x
faster on AVX2 than MKL's float32 path, for about 2e-4 relative error. Output is then close to,
not bit-identical with, float32, so this is the ``weight_format = "fp16"`` option.

(Per-tensor int8 activations, the other CPU fast path, lost too much quality on SmolLM2.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .moe import ROUTERS, SparseMoE


class FP16WeightLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is packed as float16 for fbgemm."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)


def replace_linears(model: nn.Module, pack: Callable[[nn.Linear, str, bool], nn.Module]) -> None:
    """Replace every ``nn.Linear`` of the model (projections, experts and LM head) in place by
    ``pack(it, its attribute name, whether it belongs to a routed expert)``; a mixture of experts'
    routers stay as they are (:data:`.moe.ROUTERS`)."""
    routed = {id(m) for block in model.modules() if isinstance(block, SparseMoE) for m in block.experts.modules()}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and not (isinstance(module, SparseMoE) and name in ROUTERS):
                setattr(module, name, pack(child, name, id(module) in routed))


def pack_fp16_weights(model: nn.Module) -> None:
    replace_linears(model, lambda linear, name, expert: FP16WeightLinear(linear))


GROUP = 32
"""Inputs sharing one scale and minimum in the packed formats (a multiple of 16). 32 is the block of
GGUF's 4- and 8-bit formats, so their blocks can be reproduced exactly (see :func:`pack_weight`)."""

SMALL_BATCH = 8
"""Up to this many rows a step runs the C kernel; above it fbgemm's fp16 GEMM where a packed
projection keeps an fp16 copy (:func:`large_batch_copy`)."""


def large_batch_copy() -> bool:
    """Whether dense packed projections keep an fbgemm fp16 copy for batches above
    :data:`SMALL_BATCH` rows: only where the C kernels have no AVX-512 VNNI loop.

    With VNNI (``vpdpwssd``) the C kernel is as fast as fbgemm's fp16 GEMM from 12 rows and faster
    from 32 (0.8x its time at 512 rows, bench/decode_kernels.py), so the copy, 4x the int4 bytes,
    would cost memory for nothing. With AVX2 alone the C kernel's wide loop took 1.1-1.6x fbgemm's
    time from 16 rows, and the copy stays.
    """
    from .native import kernels

    return kernels().simd < 2


TILE = 8  # output channels packed together (the kernel's TILE)
_EXACT = 1e-3  # how far from a level (in levels) a weight may sit and still count as on the grid


def _fits(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Whether every weight of a group (``t``: its place in the group's range, 0..1) lies on a
    grid of ``r`` steps over that range. [groups, 1] bool."""
    x = t * r
    return (x - x.round()).abs().amax(-1, keepdim=True) <= _EXACT


def _grid_tries(t: torch.Tensor, span: torch.Tensor, absmax: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """Step counts to try, per group, after the full ``2**bits - 1``: what the GGUF quantizers'
    own scales imply (Q4_0: largest magnitude over 8 steps; Q8_0: over 127), what the smallest gap
    between two weights implies (usually one step, else two or three), and at 4 bits every count."""
    full = 2**bits - 1
    gaps = t.sort(-1).values.diff(dim=-1)
    smallest = gaps.masked_fill(gaps <= _EXACT / full, 2.0).amin(-1, keepdim=True)
    tries = [((8 if bits == 4 else 127) * span / absmax).round()] + [(j / smallest).round() for j in (1, 2, 3)]
    if bits == 4:
        tries += [torch.full_like(span, r) for r in range(full - 1, 0, -1)]
    return [r.clamp(1, full) for r in tries]


def _grid_levels(groups: torch.Tensor, bits: int) -> torch.Tensor:
    """Per group (last dimension), the number of steps between its smallest and largest weight on
    the grid its weights lie on (so that they are reproduced exactly), else the format's full
    ``2**bits - 1``. Returns ``groups``' shape with a last dimension of 1.

    A GGUF block is ``d * q + m`` (or ``d * q``) with integer ``q``; its weights then sit on a grid
    of ``r = q_max - q_min`` steps over their range. Q4_1 uses all 16 levels (``r = 15``, the first
    try); Q4_0 blocks may use fewer, Q8_0 blocks some 200 of 255 (:func:`_grid_tries`). Float
    weights fit none and get the full range (a rounding of at most half a step). Only groups that
    miss the full grid are searched, and a tensor where an even sample of 256 of them fits no grid
    is taken for float weights without searching the rest: its load then costs one pass.
    """
    full = 2**bits - 1
    flat = groups.reshape(-1, groups.shape[-1])
    low, high = flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True)
    tiny = torch.finfo(torch.float32).tiny
    span = (high - low).clamp_min(tiny)
    absmax = torch.maximum(low.abs(), high.abs()).clamp_min(tiny)
    t = (flat - low) / span  # 0..1
    levels = torch.full_like(low, full)
    todo = (~_fits(t, levels)).squeeze(-1).nonzero().squeeze(-1)

    def search(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sub = t[rows]
        found, left = levels[rows], torch.ones_like(levels[rows], dtype=torch.bool)
        for r in _grid_tries(sub, span[rows], absmax[rows], bits):
            ok = left & _fits(sub, r)
            found, left = torch.where(ok, r, found), left & ~ok
            if not left.any():
                break
        return found, left

    if len(todo):
        sample = todo[:: max(1, len(todo) // 256)]
        if not search(sample)[1].all():
            levels[todo] = search(todo)[0]
    return levels.view(*groups.shape[:-1], 1)


def pack_weight(weight: torch.Tensor, bits: int = 8, group: int | None = None) -> torch.Tensor:
    """``bits`` (8 or 4) per weight, a float scale and minimum per ``group`` inputs, packed for
    ``rk_linear``.

    A weight is ``scale * u + minimum`` with ``u`` an integer from 0 to ``2**bits - 1``, over its
    group's range; a group whose weights lie on a coarser grid (a GGUF Q4_0, Q4_1 or Q8_0 block)
    keeps that grid and is reproduced exactly (:func:`_grid_levels`). Returns uint8
    ``[N' / 8, K' / group, 64 + bits * group]`` (N' and K' the output and input sizes rounded up to
    8 and to ``group``, padded with zeros): per tile of 8 channels and group, the 8 scales and 8
    minimums as float32, then the weights as the kernel reads them (see ``cpu_kernels.c``).
    """
    group = group or GROUP
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, not {bits}")
    if group % 16 or not 16 <= group <= 256:
        raise ValueError(f"group must be a multiple of 16 from 16 to 256 (the kernel's int32 sums), not {group}")
    n, k = weight.shape
    n8, kp = -(-n // TILE) * TILE, -(-k // group) * group
    w = torch.zeros(n8, kp, dtype=torch.float32)
    w[:n, :k] = weight.detach().float()
    tiles, ng = n8 // TILE, kp // group
    groups = w.view(n8, ng, group)
    scale = torch.empty(n8, ng)
    low = groups.amin(-1)
    u = torch.empty(n8, ng, group, dtype=torch.uint8)
    for rows in range(0, n8, 4096):  # bounded temporaries for large matrices (the LM head)
        part = groups[rows : rows + 4096]
        levels = _grid_levels(part, bits)
        span = part.amax(-1, keepdim=True) - low[rows : rows + 4096, :, None]
        step = torch.where(span > 0, span / levels, torch.ones_like(span))
        scale[rows : rows + 4096] = step.squeeze(-1)
        q = ((part - low[rows : rows + 4096, :, None]) / step).round().clamp(0, 2**bits - 1)
        u[rows : rows + 4096] = q.to(torch.uint8)
    header = torch.cat([scale.view(tiles, TILE, ng), low.view(tiles, TILE, ng)], dim=1).transpose(1, 2).contiguous()
    if bits == 8:  # [input pair][channel][2]
        body = u.view(tiles, TILE, ng, group // 2, 2).permute(0, 2, 3, 1, 4).reshape(tiles, ng, TILE * group)
    else:  # [input quad][channel][2], inputs 4p + j in the low nibble, 4p + 2 + j in the high
        quads = u.view(tiles, TILE, ng, group // 4, 2, 2).permute(0, 2, 3, 1, 5, 4)  # [.., quad, channel, j, half]
        body = (quads[..., 0] | (quads[..., 1] << 4)).reshape(tiles, ng, TILE * group // 2)
    return torch.cat([header.view(torch.uint8).view(tiles, ng, 8 * TILE), body], dim=-1).contiguous()


def unpack_weight(packed: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """The float weight ``[n, k]`` a pack stands for (tests, and the fp16 copy for large batches)."""
    tiles, ng, size = packed.shape
    group = (size - 8 * TILE) * 8 // (TILE * bits)
    header = packed[..., : 8 * TILE].contiguous().view(torch.float32).view(tiles, ng, 2, TILE)
    body = packed[..., 8 * TILE :]
    if bits == 8:
        u = body.reshape(tiles, ng, group // 2, TILE, 2).permute(0, 3, 1, 2, 4)
    else:
        b = body.reshape(tiles, ng, group // 4, TILE, 2)
        u = torch.stack([b & 0x0F, b >> 4], dim=-2).permute(0, 3, 1, 2, 4, 5)  # [.., channel, ng, quad, half, j]
    u = u.float().reshape(tiles, TILE, ng, group)
    scale = header[:, :, 0].transpose(1, 2)[..., None]  # [tiles, TILE, ng, 1]
    low = header[:, :, 1].transpose(1, 2)[..., None]
    return (u * scale + low).reshape(tiles * TILE, ng * group)[:n, :k]


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` with 8- or 4-bit weights (``weight_format = "int8"`` / ``"int4"``,
    CPU, float32).

    Batches go through the C kernel: the activations are quantized per row to int16 and
    multiplied on integer units. With ``fp16_copy`` batches above :data:`SMALL_BATCH` rows (prefill
    chunks, many sequences) use an fbgemm fp16 copy of the same packed values instead (rounded to
    float16, about 5e-4 relative), so both paths compute with one set of weights; it costs 4x the
    int4 bytes and is kept only where it is faster (:func:`large_batch_copy`, the default). A
    mixture of experts' routed experts never keep one: they hold most of the model's weights, a
    decode step reads only the few it routes to, and a prompt's rows spread over them.
    """

    def __init__(self, linear: nn.Linear, bits: int = 8, group: int | None = None, fp16_copy: bool | None = None) -> None:
        super().__init__()
        from .native import kernels

        self._k = kernels()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        group = group or GROUP
        self.bits = bits
        self._packed = pack_weight(linear.weight, bits, group)
        self._group = group
        self._kp = self._packed.shape[1] * group
        self._bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
        self._bias_ptr = self._bias.data_ptr() if self._bias is not None else None
        self._w_ptr = self._packed.data_ptr()
        if fp16_copy is None:
            fp16_copy = large_batch_copy()
        self._fp16 = torch.ops.quantized.linear_prepack_fp16(self.weight().contiguous(), self._bias) if fp16_copy else None

    def weight(self) -> torch.Tensor:
        """The float weight the packed values stand for."""
        return unpack_weight(self._packed, self.bits, self.out_features, self.in_features)

    @property
    def group(self) -> int:
        return self._group

    @property
    def pointers(self) -> tuple[int, int | None]:
        """Addresses of the packed weight and of the bias (None: no bias), for the C kernels."""
        return self._w_ptr, self._bias_ptr

    @property
    def padded_in_features(self) -> int:
        """Row length of the int16 activations :meth:`matmul` takes (inputs rounded up to the group)."""
        return self._kp

    def matmul(self, q: torch.Tensor, dq: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """``out[:m] (+)= dequant(q) @ W.T + bias`` for int16 rows ``q [m, padded_in_features]``
        with scales ``dq [m]`` (made by the kernels' quantize functions)."""
        xsum = torch.empty(q.shape[0] * (self._kp // self._group), dtype=torch.float32)
        self._k.linear(
            q.data_ptr(), dq.data_ptr(), q.shape[0], self._kp, self._w_ptr, self._group, self.bits,
            self._bias_ptr, self.out_features, out.data_ptr(), out.stride(0), int(accumulate), xsum.data_ptr(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SMALL_BATCH and self._fp16 is not None:
            return torch.ops.quantized.linear_dynamic_fp16(x, self._fp16)
        return self.kernel_forward(x)

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [m, in_features]`` through the C kernel, whatever ``m``."""
        m = x.shape[0]
        if x.stride(-1) != 1:
            x = x.contiguous()
        q = torch.empty(m, self._kp, dtype=torch.int16)
        dq = torch.empty(m, dtype=torch.float32)
        self._k.quantize_rows(x.data_ptr(), m, self.in_features, x.stride(0), self._kp, q.data_ptr(), dq.data_ptr())
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        self.matmul(q, dq, out)
        return out


def pack_int8_weights(model: nn.Module) -> None:
    """``weight_format = "int8"``: every projection and the LM head at 8 bits."""
    replace_linears(model, lambda linear, name, expert: PackedLinear(linear, 8, fp16_copy=False if expert else None))


def pack_int4_weights(model: nn.Module) -> None:
    """``weight_format = "int4"``: the decoder's projections at 4 bits, the LM head at 8 (as GGUF
    files keep their output and embedding tensors at higher precision)."""
    replace_linears(
        model, lambda linear, name, expert: PackedLinear(linear, 8 if name == "lm_head" else 4, fp16_copy=False if expert else None)
    )


PACKINGS: dict[str, Callable[[nn.Module], None]] = {
    "fp16": pack_fp16_weights, "int8": pack_int8_weights, "int4": pack_int4_weights,
}
"""Each packed ``weight_format``'s packing of a module's linear layers (any part of a model: the
loader packs a layer at a time)."""
