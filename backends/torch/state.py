"""Per-sequence state for layers that keep one instead of keys and values per token.

A Gated DeltaNet layer (:mod:`.delta`) carries each sequence's past as a fixed-size state: its
convolution's last inputs and a matrix per value head. Every running sequence holds one slot of
:class:`RecurrentState` (``max_num_seqs`` slots, taken at admission, given back when it finishes,
is cancelled or is preempted: a preempted sequence recomputes its state from its tokens, as its
keys and values). The memory is set aside before the KV blocks are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
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
    """Each linear-attention layer's states by slot (None for the other layers): ``conv[layer]``
    ``[slots, channels, kernel - 1]`` in the model's dtype, ``ssm[layer]`` ``[slots, value_heads,
    key_dim, value_dim]`` in float32 (the rule accumulates into it token after token, as
    transformers keeps it)."""

    conv: list[torch.Tensor | None]
    ssm: list[torch.Tensor | None]
    slots: int

    @classmethod
    def for_model(cls, spec: "ModelSpec", slots: int, dtype: torch.dtype, device: torch.device) -> "RecurrentState":
        conv: list[torch.Tensor | None] = [None] * spec.num_layers
        ssm: list[torch.Tensor | None] = [None] * spec.num_layers
        s = spec.delta
        for layer in spec.linear_layers:
            conv[layer] = torch.zeros((slots, s.conv_size, s.kernel - 1), dtype=dtype, device=device)
            ssm[layer] = torch.zeros((slots, s.value_heads, s.key_dim, s.value_dim), dtype=torch.float32, device=device)
        return cls(conv, ssm, slots)

    @staticmethod
    def bytes_for(spec: "ModelSpec", slots: int, dtype: torch.dtype) -> int:
        """What :meth:`for_model` allocates."""
        s = spec.delta
        if s is None:
            return 0
        size = torch.empty((), dtype=dtype).element_size()
        per_layer = s.conv_size * (s.kernel - 1) * size + s.value_heads * s.key_dim * s.value_dim * 4
        return slots * len(spec.linear_layers) * per_layer

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the states of ``slots`` (sequences about to compute their first token)."""
        for tensor in (*self.conv, *self.ssm):
            if tensor is not None:
                tensor.index_fill_(0, slots, 0)
