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


class FP16WeightLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is packed as float16 for fbgemm."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)


def replace_linears(model: nn.Module, pack: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace every ``nn.Linear`` of the model (projections and LM head) in place by ``pack(it)``."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, pack(child))


def pack_fp16_weights(model: nn.Module) -> None:
    replace_linears(model, FP16WeightLinear)


GROUP = 32
"""Inputs sharing one scale and minimum in the int8 format (a multiple of 16). 32 is the block of
GGUF's 4- and 8-bit formats, so a Q4_1 block is reproduced exactly (bench/int8_quality.py)."""

SMALL_BATCH = 8
"""Up to this many rows a step runs the int8 kernel; above it fbgemm's fp16 GEMM, which wins once
the weights are reused across many rows: the two take the same time at 8 rows, int8 is 1.6x
faster at 1 and fp16 1.7x at 32 (bench/decode_kernels.py)."""


TILE = 8  # output channels packed together (the kernel's TILE)


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """8 bits per weight, a float scale and minimum per ``group`` inputs, packed for ``rk_int8_linear``.

    A weight is ``scale * u + minimum`` with ``u`` in 0..255 over its group's range; a GGUF Q4_1
    block (``d * q + m``) whose 16 levels span its range is exact. Returns uint8
    ``[N' / 8, K' / group, 64 + 8 * group]`` (N' and K' the output and input sizes rounded up to 8
    and to ``group``, padded with zeros): per tile of 8 channels and group, the 8 scales and 8
    minimums as float32, then the weights two inputs at a time, [input pair][channel][2].
    """
    group = group or GROUP
    if group % 16 or not 16 <= group <= 256:
        raise ValueError(f"group must be a multiple of 16 from 16 to 256 (the kernel's int32 sums), not {group}")
    n, k = weight.shape
    n8, kp = -(-n // TILE) * TILE, -(-k // group) * group
    w = torch.zeros(n8, kp, dtype=torch.float32)
    w[:n, :k] = weight.detach().float()
    groups = w.view(n8, kp // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 255.0
    scale[scale == 0] = 1.0
    u = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 255).to(torch.uint8)
    tiles, ng = n8 // TILE, kp // group
    header = torch.cat([scale.view(tiles, TILE, ng), low.view(tiles, TILE, ng)], dim=1).transpose(1, 2).contiguous()
    body = u.view(tiles, TILE, ng, group // 2, 2).permute(0, 2, 3, 1, 4).reshape(tiles, ng, TILE * group)
    return torch.cat([header.view(torch.uint8).view(tiles, ng, 8 * TILE), body], dim=-1).contiguous()


def dequantize_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float weight ``[n, k]`` a pack stands for (tests, and the fp16 copy for large batches)."""
    tiles, ng, size = packed.shape
    group = (size - 8 * TILE) // TILE
    header = packed[..., : 8 * TILE].contiguous().view(torch.float32).view(tiles, ng, 2, TILE)
    u = packed[..., 8 * TILE :].reshape(tiles, ng, group // 2, TILE, 2).permute(0, 3, 1, 2, 4).float()
    u = u.reshape(tiles, TILE, ng, group)
    scale = header[:, :, 0].transpose(1, 2)[..., None]  # [tiles, TILE, ng, 1]
    low = header[:, :, 1].transpose(1, 2)[..., None]
    return (u * scale + low).reshape(tiles * TILE, ng * group)[:n, :k]


class Int8WeightLinear(nn.Module):
    """A frozen ``nn.Linear`` with 8-bit weights (``weight_format = "int8"``, CPU, float32).

    Small batches (decode steps) go through the C kernel: the activations are quantized per row to
    int16 and multiplied on integer units. Larger batches (prefill chunks, many sequences) use an
    fbgemm fp16 copy of the same int8 values (rounded to float16, about 5e-4 relative), so both
    paths compute with one set of weights.
    """

    def __init__(self, linear: nn.Linear, group: int | None = None) -> None:
        super().__init__()
        from .native import kernels

        self._k = kernels()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        group = group or GROUP
        self._packed = quantize_int8(linear.weight, group)
        self._group = group
        self._kp = self._packed.shape[1] * group
        self._bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
        self._bias_ptr = self._bias.data_ptr() if self._bias is not None else None
        self._w_ptr = self._packed.data_ptr()
        exact = dequantize_int8(self._packed, self.out_features, self.in_features)
        self._fp16 = torch.ops.quantized.linear_prepack_fp16(exact.contiguous(), self._bias)

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
        self._k.int8_linear(
            q.data_ptr(), dq.data_ptr(), q.shape[0], self._kp, self._w_ptr, self._group,
            self._bias_ptr, self.out_features, out.data_ptr(), out.stride(0), int(accumulate), xsum.data_ptr(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SMALL_BATCH:
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
    replace_linears(model, Int8WeightLinear)
