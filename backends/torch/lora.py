"""LoRA adapters: many fine-tunes of one base model, served from one copy of its weights.

An adapter (a PEFT ``adapter_config.json`` + ``adapter_model.safetensors`` folder) adds a
low-rank product to some projections: ``W x`` becomes ``W x + s B (A x)`` with ``A`` of shape
``[r, in]``, ``B`` of ``[out, r]`` and ``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). Each
adapter is served as a model of its own name; a step may mix rows of the base model and of several
adapters, so the base projection runs once over every row and each adapter's product is added to
its own rows only (what vLLM's punica kernels do, grouped per adapter instead of per row).

The model's q, k and v (and gate and up) are one fused matrix here: an adapter of ``q_proj``
writes into the query columns of ``qkv_proj``. Adapters of the embeddings, the LM head or with
extra trained modules (``modules_to_save``), DoRA, or per-module rank/alpha patterns are refused
by name when the model loads.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from backends.peft import AdapterError, read_peft_folder

from .state import STATE_MODELS

if TYPE_CHECKING:
    from .model import CausalLM, ModelSpec
    from .scheduler import Scheduled

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The (fused) projections of a layer an adapter can reach, attention's first; in this order
they are rk_decode_step's ``which`` 0..3."""


# A mixture of experts' own modules: experts, shared expert(s), router (Qwen's mlp.gate, Mixtral's
# block_sparse_moe.gate).
_MOE_KEY = re.compile(r"\.(?:experts|shared_experts?|shared_expert_gate|shared_mlp|block_sparse_moe)\.|\.mlp\.gate\.lora_")


def _targets(spec: ModelSpec) -> dict[str, tuple[str, int, int, int]]:
    """PEFT's module names -> (our module, first output column, end column, input size); under
    latent attention (whose projections are other ones) the MLP's alone."""
    q, kv, h, i = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, spec.intermediate_size
    mlp = {
        "gate_proj": ("gate_up_proj", 0, i, h),
        "up_proj": ("gate_up_proj", i, 2 * i, h),
        "gate_up_proj": ("gate_up_proj", 0, 2 * i, h),
        "down_proj": ("down_proj", 0, h, i),
    }
    if spec.latent is not None:
        return mlp
    return {
        "q_proj": ("qkv_proj", 0, q, h),
        "k_proj": ("qkv_proj", q, q + kv, h),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv, h),
        "qkv_proj": ("qkv_proj", 0, q + 2 * kv, h),  # Phi-3 adapters: the fused matrix, as ours
        "o_proj": ("o_proj", 0, h, q),
        **mlp,
    }


@dataclass
class LoraAdapter:
    """One loaded adapter: per (layer, our module), the low-rank pairs that add to its output
    columns, ``B`` already multiplied by the scale."""

    name: str
    path: Path
    rank: int
    scale: float
    # (layer, module) -> [(first column, end column, A [r, in], s * B [out, r])]
    parts: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def load_adapter(name: str, folder: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> LoraAdapter:
    """Read a PEFT LoRA folder and check it against the base model's shapes."""
    from safetensors.torch import load_file

    peft = read_peft_folder(name, folder)
    fail, scale, weights_file = peft.error, peft.scale, peft.weights_file
    if spec.conv_layers:  # its projections are named and shaped otherwise, layer by layer
        raise fail("adapters of a model with short convolutions (LFM2) are not supported")
    if spec.recurrent or spec.block_kinds:  # the same, and its attention's q_proj holds gates too
        raise fail(f"adapters of a model with linear-attention or Mamba layers ({STATE_MODELS}) are not supported")
    if spec.ungated_mlp:  # no gate_up_proj to add to
        raise fail("adapters of a model with ungated MLPs (Apertus, Arcee, Jais 2, Nemotron, StarCoder2, Phi, GPT-NeoX, "
                   "GPT-J, Falcon, GPT-2, GPTBigCode, OPT, BLOOM, MPT) are not supported")
    if spec.value_norms or spec.kv_sources:  # q, k and v sized layer by layer, some layers without k and v (their
        # own or at all); the shared layers compute fewer rows than a step's adapters select (CausalLM.wanted_rows_from)
        raise fail("adapters of Gemma 4 are not supported")
    targets, rows = _targets(spec), spec.qkv_row_order()
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        weights = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type, OSError: the file is unreadable
        raise fail(f"adapter_model.safetensors cannot be read: {exc}") from None
    for key, tensor in weights.items():
        if spec.is_moe and _MOE_KEY.search(key):
            raise fail(f"weight `{key}`: the experts, shared expert and router of a mixture of experts cannot be "
                       + ("adapted (attention's projections can)" if spec.latent is None else "adapted"))
        layer, module, side = peft.locate(key, targets, spec.num_layers)
        if spec.is_sparse(layer) and targets[module][0] in PROJECTIONS[2:]:
            raise fail(f"weight `{key}`: layer {layer}'s feed-forward block is a mixture of experts, which has no `{module}`")
        pairs.setdefault((layer, module), {})[side] = tensor
    def shape(module: str) -> tuple[int, int]:  # (out, in) of the columns the module adapts
        _, start, end, in_features = targets[module]
        return end - start, in_features

    adapter = LoraAdapter(name, folder, peft.rank, scale)
    for layer, module, a, b in peft.paired(pairs, shape):
        ours, start, end, _ = targets[module]
        if rows is not None and ours == "qkv_proj":  # the base model's q and k rows are reordered (ModelSpec.qk_layout)
            b = b[rows[start:end] - start]
        a = a.to(device=device, dtype=dtype)
        b = (b.float() * scale).to(device=device, dtype=dtype)
        adapter.parts.setdefault((layer, ours), []).append((start, end, a, b))
    return adapter


class LoraBatch:
    """Which rows of the running step belong to which adapter: ``(adapter index, rows)`` per
    adapter present, the rows a slice where they are consecutive, else an index tensor; set by
    :meth:`Adapters.select` before every forward pass."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []


class LoraLinear(nn.Module):
    """A projection (float, fp16-packed or int8/int4-packed) plus the low-rank products of the
    adapters that adapt it, each added to its own rows of the step."""

    def __init__(self, base: nn.Module, batch: LoraBatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, slice]] = {}  # index -> (A, s * B, columns)

    def add(self, index: int, parts: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> None:
        """Two matmuls per adapter whatever it adapts of a fused matrix: the A's stacked
        ``[sum r, in]``, the B's block-diagonal over the columns they span (zero where the
        adapter leaves a part alone, e.g. k between q and v)."""
        a = torch.cat([a for _, _, a, _ in parts])
        first, end = min(p[0] for p in parts), max(p[1] for p in parts)
        b = a.new_zeros(end - first, a.shape[0])
        r0 = 0
        for start, stop, part_a, part_b in parts:
            b[start - first : stop - first, r0 : r0 + part_a.shape[0]] = part_b
            r0 += part_a.shape[0]
        self.adapters[index] = (a, b, slice(first, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for index, rows in self.batch.groups:
            entry = self.adapters.get(index)
            if entry is None:
                continue
            a, b, columns = entry
            if isinstance(rows, slice):  # the usual case: a sequence's rows, or a run of them
                y[rows, columns] += (x[rows] @ a.T) @ b.T
            else:
                y[:, columns].index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y


class Adapters:
    """The adapters one engine serves, by name and index (0 is the base model); wraps the
    projections they adapt. Adapters come and go between steps (on the engine thread): a freed
    index is reused, and each load gets its own prefix-cache root, so blocks computed under an
    adapter are never found by a later one loaded under the same name."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.batch = LoraBatch()
        self.index: dict[str, int] = {}
        self.loaded: dict[int, LoraAdapter] = {}
        self.roots: dict[int, int] = {}  # index -> the hash its sequences' block chains start from
        self._wrapped: dict[tuple[int, str], LoraLinear] = {}
        self._loads = itertools.count()

    def add(self, adapter: LoraAdapter) -> int:
        """Serve ``adapter`` from the next step on; its index."""
        if adapter.name in self.index:
            raise AdapterError(f"LoRA adapter `{adapter.name}` is already loaded")
        index = next(i for i in itertools.count(1) if i not in self.loaded)
        for (layer, module), parts in adapter.parts.items():
            lin = self._wrapped.get((layer, module))
            if lin is None:
                owner = _owner(self.model.layers[layer], module)
                lin = self._wrapped[(layer, module)] = LoraLinear(getattr(owner, module), self.batch)
                setattr(owner, module, lin)
            lin.add(index, parts)
        self.index[adapter.name] = index
        self.loaded[index] = adapter
        self.roots[index] = hash(("lora", adapter.name, next(self._loads)))
        return index

    def remove(self, name: str) -> None:
        """Stop serving ``name`` (no sequence may be using it); its weights are dropped."""
        index = self.index.pop(name)
        del self.loaded[index], self.roots[index]
        for lin in self._wrapped.values():
            lin.adapters.pop(index, None)

    def by_index(self) -> list[LoraAdapter | None]:
        """Adapter ``i + 1`` at ``i`` (None where an index is free): the C decoder's table order."""
        return [self.loaded.get(i) for i in range(1, max(self.loaded, default=0) + 1)]

    def select(self, work: list[Scheduled]) -> bool:
        """Point the wrapped projections at this step's rows (in the order of ``work``, each
        sequence's ``num_new`` rows together); whether any row uses an adapter."""
        groups: dict[int, list[int]] = {}
        row = 0
        for w in work:
            if w.seq.adapter:
                groups.setdefault(w.seq.adapter, []).extend(range(row, row + w.num_new))
            row += w.num_new
        self.batch.groups = [(index, self._rows(rows)) for index, rows in groups.items()]
        return bool(groups)

    @staticmethod
    def row_adapters(work: list[Scheduled]) -> list[int]:
        """Each row's adapter index (0: the base model), rows in the order of ``work``: what the
        C decoder reads (:meth:`.cpu_decode.CpuDecoder.attach_adapters`)."""
        return [w.seq.adapter for w in work for _ in range(w.num_new)]

    def _rows(self, rows: list[int]) -> slice | torch.Tensor:
        if rows[-1] - rows[0] == len(rows) - 1:
            return slice(rows[0], rows[-1] + 1)
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)


def _owner(layer: nn.Module, module: str) -> nn.Module:
    return layer.self_attn if module in PROJECTIONS[:2] else layer.mlp
