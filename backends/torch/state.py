"""Per-sequence state for layers that keep one instead of keys and values per token.

A Gated DeltaNet layer (:mod:`.delta`) or a Mamba2 layer (:mod:`.mamba`) carries each
sequence's past as a fixed-size state: its convolution's last inputs and a matrix per head.
Every running sequence holds one of the first ``max_num_seqs`` slots of :class:`RecurrentState`
(taken at admission, given back when it finishes, is cancelled or is preempted: a preempted
sequence recomputes its state from its tokens, as its keys and values). The memory is set aside
before the KV blocks are counted.

A block's tokens say nothing about the state before them, so the prefix cache needs the states
themselves: :class:`StateCache` keeps copies of states at block boundaries that sequences'
steps pass (in the slots after the running ones), by the chain hash of the block ending there.
A later sequence with the same prefix starts from the copy at the deepest such boundary whose
blocks are still cached. Which boundaries: the last one each prompt chunk passes, the latest one
a generating sequence reached, and where blocks an earlier prompt shares end (the second prompt
with a system prompt keeps the state at its end, and those after it start there).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

STATE_MODELS = "Qwen3-Next, Qwen3.5, OLMo Hybrid, Granite 4's hybrids, Bamba, Nemotron-H, Falcon-H1"
"""The models with per-sequence states, as the refusals of what they run without name them."""

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

    def copy(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy the states of slots ``sources`` into slots ``targets`` (no slot in both)."""
        for tensor in (*self.conv, *self.ssm):
            if tensor is not None:
                tensor.index_copy_(0, targets, tensor.index_select(0, sources))

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the states of ``slots`` (sequences about to compute their first token)."""
        for tensor in (*self.conv, *self.ssm):
            if tensor is not None:
                tensor.index_fill_(0, slots, 0)


class StateCache:
    """Copies of sequences' states at block boundaries, by the chain hash of the block that ends
    there (:func:`.kv_cache.chain_hash`): the prefix cache of a model with per-sequence states.

    It owns ``count`` slots of :class:`RecurrentState` from ``first`` on (after the running
    sequences' slots); the least recently used copy gives way to a new one. The scheduler looks
    copies up as it admits a sequence (:meth:`lookup`); the runner copies the one found into the
    sequence's slot before the step computes it (:meth:`restore`). A prompt chunk keeps the
    state at the last block boundary inside it (:func:`kept_boundary`), and at the end of the
    cached blocks it shares with an earlier prompt (:attr:`.sequence.Sequence.shared_boundary`:
    where a shared system prompt's blocks end, seen the second time): the runner places them
    before the step (:meth:`place`) and the layers copy them there as they pass them
    (:attr:`.attention.PrefillSpan.keeps`); after a step the runner saves the states of decoding
    sequences whose computed tokens end a block (:meth:`save`)."""

    def __init__(self, states: RecurrentState, first: int, count: int, device: torch.device) -> None:
        if count < 1 or first + count > states.slots:
            raise ValueError(f"no room for {count} cached states from slot {first} among {states.slots}")
        self.states = states
        self.count = count
        self.device = device
        self._free = list(range(first + count - 1, first - 1, -1))
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self.restored = 0  # sequences that started from a kept state

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: int) -> int | None:
        """The slot of the state after the block of ``block_hash`` (and all before it), if kept."""
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (cached slot, sequence slot) pair's state into the sequence's slot."""
        if pairs:
            self.restored += len(pairs)
            sources, targets = zip(*pairs)
            self.states.copy(self._index(sources), self._index(targets))

    def place(self, saves: list[tuple[int, int | None]]) -> list[int | None]:
        """Slots for the states after the blocks of these (block hash, replaced hash) pairs, to be
        copied there in the same step: the slot of each, None for a state kept already (it is
        only marked used). The copy of the replaced hash goes (the sequence's previous copy
        while it generates: only its latest is worth keeping), and its slot takes the new one
        first, then a free slot, then the least recently used copy's."""
        targets: list[int | None] = []
        for block_hash, replaced in saves:
            # The replaced copy goes, unless it is this one or a copy this very call placed
            # (its slot is written this step: no two copies may land in one slot).
            if replaced == block_hash or self._by_hash.get(replaced) in targets:
                replaced = None
            if block_hash in self._by_hash:  # the same tokens' state, kept by another sequence
                self._by_hash.move_to_end(block_hash)
                if replaced is not None and replaced in self._by_hash:
                    self._free.append(self._by_hash.pop(replaced))
                targets.append(None)
                continue
            if replaced is not None and replaced in self._by_hash:
                target = self._by_hash.pop(replaced)
            elif self._free:
                target = self._free.pop()
            else:
                _, target = self._by_hash.popitem(last=False)
                if target in targets:  # placed by this very call: more saves than slots
                    targets[targets.index(target)] = None
            self._by_hash[block_hash] = target
            targets.append(target)
        return targets

    def save(self, saves: list[tuple[int, int, int | None]]) -> list[int | None]:
        """Keep the state of each (sequence slot, block hash, replaced hash) as the state after
        that block (:meth:`place`), copied now; the slots, as :meth:`place` gives them."""
        targets = self.place([(block_hash, replaced) for _, block_hash, replaced in saves])
        pairs = [(slot, target) for (slot, _, _), target in zip(saves, targets) if target is not None]
        if pairs:
            sources, kept = zip(*pairs)
            self.states.copy(self._index(sources), self._index(kept))
        return targets

    def forget(self, block_hashes: list[int]) -> None:
        """Drop the copies of these hashes (placed for a step that then failed: never written)."""
        for block_hash in block_hashes:
            slot = self._by_hash.pop(block_hash, None)
            if slot is not None:
                self._free.append(slot)

    def _index(self, slots) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)


def kept_boundary(start: int, end: int, total: int, block_size: int) -> int | None:
    """Where a prompt chunk computing positions [start, end) of a sequence of ``total`` known
    tokens keeps its state: the last block boundary inside it, though in the prompt's last chunk
    none past the boundary before its last token (the deepest a later identical prompt can
    start from: one token is always computed). None: no boundary after ``start``."""
    boundary = ((total - 1) if end == total else end) // block_size * block_size
    return boundary if boundary > start else None


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
        for tokens, target in span.keeps:  # the inputs before each kept state's position (the prefix cache's)
            conv_state[target] = inputs[:, tokens : tokens + kernel - 1]
        conv = F.conv1d(inputs.float()[None], taps[:, None, :], bias, groups=taps.shape[0])[0]
        out[span.start : span.end] = F.silu(conv.to(x.dtype)).T
    return out
