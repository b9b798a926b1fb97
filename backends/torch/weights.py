"""Reading a Hugging Face checkpoint's tensors into the engine's modules."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class WeightReader:
    """A checkpoint's tensors by Hugging Face name (with or without the ``model.`` prefix),
    each taken once, copied into parameters with their shapes checked."""

    def __init__(self, state: dict[str, torch.Tensor], error: Callable[[str], Exception]) -> None:
        self.state = state
        self.error = error

    def keys(self) -> list[str]:
        return list(self.state)

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
