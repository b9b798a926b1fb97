"""Per-sequence state for layers that keep one instead of keys and values per token.

A Gated DeltaNet layer (:mod:`.delta`) or a Mamba2 layer (:mod:`.mamba`) carries each
sequence's past as a fixed-size state: its convolution's last inputs and a matrix per head.
Every running sequence holds one slot of :class:`RecurrentState` (``max_num_seqs`` slots, taken
at admission, given back when it finishes, is cancelled or is preempted: a preempted sequence
recomputes its state from its tokens, as its keys and values). The memory is set aside before
the KV blocks are counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .attention import AttentionMetadata
    from .model import ModelSpec


class StateSlots:
    """Hands out the slot numbers of :class:`RecurrentState`, one per running sequence."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise MemoryError("no free state slot")
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)


@dataclass
class RecurrentState:
    """Each linear-attention (or Mamba) layer's states by slot (None for the other layers):
    ``conv[layer]`` ``[slots, channels, kernel - 1]`` in the model's dtype, ``ssm[layer]``
    ``[slots, heads, key_dim, value_dim]`` (:attr:`.model.ModelSpec.recurrence`'s
    ``state_shape``) in float32 (the rule accumulates into it token after token, as
    transformers keeps it)."""

    conv: list[torch.Tensor | None]
    ssm: list[torch.Tensor | None]
    slots: int

    @classmethod
    def for_model(cls, spec: "ModelSpec", slots: int, dtype: torch.dtype, device: torch.device) -> "RecurrentState":
        conv: list[torch.Tensor | None] = [None] * spec.num_layers
        ssm: list[torch.Tensor | None] = [None] * spec.num_layers
        s = spec.recurrence
        for layer in spec.linear_layers:
            conv[layer] = torch.zeros((slots, s.conv_size, s.kernel - 1), dtype=dtype, device=device)
            ssm[layer] = torch.zeros((slots, *s.state_shape), dtype=torch.float32, device=device)
        return cls(conv, ssm, slots)

    @staticmethod
    def bytes_for(spec: "ModelSpec", slots: int, dtype: torch.dtype) -> int:
        """What :meth:`for_model` allocates."""
        s = spec.recurrence
        if s is None:
            return 0
        size = torch.empty((), dtype=dtype).element_size()
        per_layer = s.conv_size * (s.kernel - 1) * size + math.prod(s.state_shape) * 4
        return slots * len(spec.linear_layers) * per_layer

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the states of ``slots`` (sequences about to compute their first token)."""
        for tensor in (*self.conv, *self.ssm):
            if tensor is not None:
                tensor.index_fill_(0, slots, 0)


def causal_conv(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                meta: "AttentionMetadata") -> torch.Tensor:
    """Each row of ``x [rows, channels]`` convolved causally with ``taps [channels, kernel]`` (and
    ``bias``) over its sequence's last ``kernel - 1`` inputs (``conv_state``, by the step's
    slots) and itself, then SiLU; the states moved on. Multiplied out in float32 and rounded to
    ``x``'s dtype before the SiLU, as transformers' conv1d does (a bfloat16 prompt's logprobs:
    7e-7 from transformers' so, 0.09 with the SiLU taken in float32)."""
    taps, kernel = taps.float(), taps.shape[1]
    bias = bias.float() if bias is not None else None
    out = torch.empty_like(x)
    d, slots = meta.num_decode, meta.state_slots
    if d:
        window = torch.cat((conv_state.index_select(0, slots[:d]), x[:d, :, None].to(conv_state.dtype)), dim=-1)
        conv_state.index_copy_(0, slots[:d], window[..., 1:])
        summed = (window.float() * taps).sum(-1)
        out[:d] = F.silu((summed if bias is None else summed + bias).to(x.dtype))
    for j, span in enumerate(meta.prefills):
        slot = slots[d + j : d + j + 1]
        inputs = torch.cat((conv_state.index_select(0, slot)[0], x[span.start : span.end].T.to(conv_state.dtype)),
                           dim=-1)  # [channels, kernel - 1 + tokens]
        conv_state.index_copy_(0, slot, inputs[None, :, inputs.shape[1] - (kernel - 1) :])
        conv = F.conv1d(inputs.float()[None], taps[:, None, :], bias, groups=taps.shape[0])[0]
        out[span.start : span.end] = F.silu(conv.to(x.dtype)).T
    return out
