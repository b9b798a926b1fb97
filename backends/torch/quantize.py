"""fp16 weights for CPU serving: projections through fbgemm's fp16-weight matmul.

On a CPU the decoder is limited by reading its weights (small batches) and by float32 matmul
throughput (large ones). Stored in float16 and multiplied by fbgemm's FP16 kernels (weights
widened in registers, float32 accumulation), the projections read half the bytes and run 2-3x
faster on AVX2 than MKL's float32 path, for about 2e-4 relative error. Output is then close to,
not bit-identical with, float32, so this is the ``weight_format = "fp16"`` option.

(Per-tensor int8 activations, the other CPU fast path, lost too much quality on SmolLM2.)
"""

from __future__ import annotations

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


def pack_fp16_weights(model: nn.Module) -> None:
    """Replace every ``nn.Linear`` of the model (projections and LM head) in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, FP16WeightLinear(child))
