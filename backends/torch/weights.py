"""Reading a Hugging Face checkpoint's tensors into the engine's modules."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn


class WeightReader:
    """A checkpoint's tensors by Hugging Face name (with or without the ``model.`` prefix),
    each taken once (dropped from ``state``), put into ``model``'s parameters with their shapes
    checked.

    A parameter on the meta device (a model built without memory of its own) becomes the tensor
    in the parameter's dtype (a copy of one read from the file); any other is copied into. A
    meta-built model skips the allocation and random initialisation of weights about to be
    overwritten."""

    def __init__(self, state: dict[str, torch.Tensor], error: Callable[[str], Exception], model: nn.Module) -> None:
        self.state = state
        self.error = error
        # Weak: a layer packed as soon as it is loaded drops its float modules (CausalLM.from_state_dict).
        self._owners = {
            id(p): (weakref.ref(m), name) for m in model.modules() for name, p in m.named_parameters(recurse=False)
        }
        self._read = {t.untyped_storage().data_ptr() for t in state.values()}  # the file's own tensors

    def has(self, name: str) -> bool:
        return name in self.state or f"model.{name}" in self.state

    def take(self, name: str) -> torch.Tensor:
        for key in (name, f"model.{name}"):
            if key in self.state:
                return self.state.pop(key)
        raise self.error(f"checkpoint has no weight `{name}`")

    def copy(self, param: torch.Tensor, name: str, value: torch.Tensor | None = None) -> None:
        """``param`` from ``value``, or else from the checkpoint's ``name``."""
        value = self.take(name) if value is None else value
        if param.shape != value.shape:
            raise self.error(f"weight `{name}` has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        if param.is_meta:
            owner, attr = self._owners[id(param)]
            module = owner()
            # A tensor read from a safetensors file (or a view of one) is copied: it views the
            # file's mapping, which would stay mapped (and break if the file were rewritten) while
            # a parameter held it. Tensors made while loading (fused q/k/v, gate/up) are kept.
            read = value.untyped_storage().data_ptr() in self._read
            value = value.to(param.dtype, memory_format=torch.contiguous_format, copy=read)
            setattr(module, attr, nn.Parameter(value, requires_grad=False))
            return
        with torch.no_grad():
            param.copy_(value)


def load_mlp(mlp: nn.Module, prefix: str, state: WeightReader, names: tuple[str, str, str] | None = None) -> None:
    """A SwiGLU MLP's weights: gate and up fused into ``gate_up_proj`` (Phi-3 stores them so),
    then ``down_proj``. ``names``: the checkpoint's gate, up and down matrices."""
    gate, up, down = names or ("gate_proj", "up_proj", "down_proj")
    fused = prefix + "gate_up_proj.weight"
    if state.has(fused):
        state.copy(mlp.gate_up_proj.weight, fused)
    else:
        value = torch.cat([state.take(f"{prefix}{gate}.weight"), state.take(f"{prefix}{up}.weight")])
        state.copy(mlp.gate_up_proj.weight, fused, value)
    state.copy(mlp.down_proj.weight, f"{prefix}{down}.weight")
    if mlp.down_proj.bias is not None:
        bias = torch.cat([state.take(f"{prefix}{gate}.bias"), state.take(f"{prefix}{up}.bias")])
        state.copy(mlp.gate_up_proj.bias, prefix + "gate_up_proj.bias", bias)
        state.copy(mlp.down_proj.bias, f"{prefix}{down}.bias")


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an MXFP4 element (e2m1), by its 4 bits."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (OCP microscaling, what gpt-oss's checkpoints hold its experts in) to ``dtype``:
    ``blocks [..., G, 16]`` bytes, two e2m1 elements each (the low nibble first), and ``scales
    [..., G]`` bytes, a power of two per block of 32 (``2 ** (scale - 127)``); ``[..., G * 32]``
    out. Every value is exact in bfloat16 and float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)
