"""Reading a Hugging Face checkpoint's tensors into the engine's modules."""

from __future__ import annotations

import re
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

    def __init__(self, state: dict[str, torch.Tensor], error: Callable[[str], Exception], model: nn.Module,
                 fp8: tuple[int, int] | None | bool = False, scales: dict[str, RowScales] | None = None) -> None:
        self.state = state
        self.error = error
        # Factors folded into weights as they are taken, by name within a layer (scaled_rows).
        self.scales = scales or {}
        # FP8 weights: decoded with their scales' block (None: one scale a tensor); False: none expected.
        self.fp8 = fp8
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
                value = self.state.pop(key)
                value = self._fp8_decoded(key, value) if value.dtype in FP8_DTYPES else value
                found = re.search(r"(?:^|\.)layers\.\d+\.(.+)$", key) if self.scales else None
                scales = self.scales.get(found.group(1)) if found else None
                return value if scales is None else scaled_rows(value, scales)
        raise self.error(f"checkpoint has no weight `{name}`")

    def filters(self, name: str, channels: int, kernel: int) -> torch.Tensor:
        """A depthwise convolution's filters ``name`` (a checkpoint's Conv1d weight, ``[channels, 1,
        kernel]``) as ``[channels, kernel]``, refused in any other shape."""
        value = self.take(name)
        if value.shape != (channels, 1, kernel):
            raise self.error(f"weight `{name}` has shape {tuple(value.shape)}, expected {(channels, 1, kernel)}")
        return value[:, 0]

    def _fp8_decoded(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """An FP8 weight times its ``weight_scale_inv``, as float32."""
        if self.fp8 is False:
            raise self.error(f"weight `{key}` is FP8 ({value.dtype}), but the config has no FP8 quantization_config")
        scale = self.state.pop(key + "_scale_inv", None)
        if scale is None:
            raise self.error(f"FP8 weight `{key}` has no `{key}_scale_inv` beside it")
        self.state.pop(key.removesuffix("weight") + "activation_scale", None)  # static activation scales: unused
        try:
            return dequantize_fp8(value, scale, self.fp8)
        except ValueError as exc:
            raise self.error(f"FP8 weight `{key}`: {exc}") from None

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


RowScales = tuple[tuple[int, float], ...]
"""Factors for a weight's rows: (rows, factor) sections in turn, the last one's rows -1 (all left)."""


def scaled_rows(value: torch.Tensor, scales: RowScales) -> torch.Tensor:
    """``value``'s rows times their sections' factors, in float32 (the parameter's dtype is
    rounded to once, as it is copied)."""
    value = value.float()
    factors, at = torch.ones(value.shape[0]), 0
    for rows, factor in scales:
        end = value.shape[0] if rows == -1 else at + rows
        factors[at:end] = factor
        at = end
    return value * factors.view(-1, *(1,) * (value.dim() - 1))


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


def load_fused_mlp(mlp: nn.Module, prefix: str, state: WeightReader) -> None:
    """A gated MLP stored as Granite's: ``input_linear`` (gate rows, then up rows) and
    ``output_linear``."""
    state.copy(mlp.gate_up_proj.weight, prefix + "input_linear.weight")
    state.copy(mlp.down_proj.weight, prefix + "output_linear.weight")


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """FP8 weights ``[..., rows, cols]`` times their scales, as float32: one scale for the tensor
    (``block`` None, or a single scale), or one per block of ``block`` rows and columns
    (``[..., ceil(rows / block rows), ceil(cols / block cols)]``; the last blocks may be partial).
    Stacked experts ``[E, rows, cols]`` without a block size may have a scale per expert (``[E]``,
    ``[E, 1, 1]``) or per even tile of one (``[E, 2, 1]``: its gate and up halves apart), as
    Mistral 4's FP8 release has. float32 products of an e4m3 value and a float32 scale, rounded once."""
    values = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if scale.numel() == 1:
        return values * scale.reshape(())
    rows, cols = values.shape[-2:]
    stacked = values.dim() > 2 and scale.shape[: values.dim() - 2] == values.shape[:-2]
    if block is None and stacked and scale.dim() == values.dim() - 2:  # one scale an expert
        scale = scale.reshape(*scale.shape, 1, 1)
    if block is None and stacked and scale.dim() == values.dim() and not (rows % scale.shape[-2] or cols % scale.shape[-1]):
        block = (rows // scale.shape[-2], cols // scale.shape[-1])  # an expert's even tiles
    if block is None:
        raise ValueError(f"{scale.numel()} scales for a tensor, and no weight_block_size in the config")
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != values.shape[:-2]:
        raise ValueError(f"scales of shape {tuple(scale.shape)} for blocks of {list(block)} of a {tuple(values.shape)} tensor")
    full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return values * full


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
