"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is hundreds of tiny kernels; launching them one by one
from Python costs more than running them. A CUDA graph records the launches of one step once and
replays them with one call. A graph fixes every shape and every address, so a decode-only step
is run on static buffers, padded up to a captured shape:

- the batch to the next *batch bucket* (1, 2, 4, 8, then multiples of 16 up to ``max_batch``);
- the context to the next *block bucket* (a power of two of KV blocks, up to ``max_blocks``):
  attention gathers each sequence's keys over ``blocks x block_size`` positions and masks the
  ones past its length.

Padding rows decode token 0 at position 0 and write their key and value into a *scratch block*
that the block pool never hands out; each attends to that one slot, so no row is fully masked
(which would give NaN). Real rows' block tables are padded with the scratch block too, masked
out by their lengths. Their logits are discarded.

Graphs are captured lazily, the first time a shape is needed, into one shared memory pool, and
kept (at most ``len(batch buckets) x len(block buckets)`` of them). Steps that prefill, exceed
the largest bucket or would gather more than ``max_gather`` key positions run eagerly.

With ``capture=False`` the same static path runs eagerly every step: how the padding, masks and
scratch writes are tested on a machine without a GPU (a captured graph replays exactly the
kernels this path launches).
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import AttentionMetadata
from .kv_cache import KVCache
from .model import CausalLM
from .scheduler import Step

MAX_GATHER = 1 << 20  # key positions gathered per layer in one graph (batch x context)


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16, ending at ``max_batch``."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return sorted(sizes)


def block_buckets(max_blocks: int) -> list[int]:
    """Captured context widths in blocks: powers of two, ending at ``max_blocks``."""
    out, b = [], 1
    while b < max_blocks:
        out.append(b)
        b *= 2
    return [*out, max_blocks]


def _bucket(buckets: list[int], n: int) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class DecodeGraphs:
    """Runs decode-only steps of ``model`` on static, padded buffers; on CUDA from captured graphs.

    ``scratch_block``: a KV block outside the block pool, written only by padding rows.
    """

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        *,
        max_batch: int,
        max_blocks: int,
        scratch_block: int,
        capture: bool,
        max_gather: int = MAX_GATHER,
    ) -> None:
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is outside the KV cache ({kv.num_blocks} blocks)")
        device = kv.k[0].device
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv = kv
        self.capture = capture
        self.max_gather = max_gather
        self.batches = batch_buckets(max_batch)
        self.blocks = block_buckets(max_blocks)
        self.window = model.spec.sliding_window
        bs = kv.block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * bs
        long = dict(dtype=torch.long, device=device)
        # The static inputs, sized for the largest bucket; a step fills their first rows.
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slots = torch.full((max_batch,), self.scratch_slot, **long)
        self.tables = torch.full((max_batch, max_blocks), scratch_block, **long)
        self.lengths = torch.ones(max_batch, **long)
        self.rows = torch.arange(max_batch, **long)
        self.offsets = torch.arange(bs, **long)
        self.key_positions = torch.arange(max_blocks * bs, **long)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None

    def shape(self, step: Step) -> tuple[int, int] | None:
        """The (batch, blocks) bucket ``step`` runs in, or None when it must run eagerly."""
        work = step.work
        if not work or not all(w.is_decode for w in work):
            return None
        batch = _bucket(self.batches, len(work))
        blocks = _bucket(self.blocks, max(len(w.seq.block_table) for w in work))
        if batch is None or blocks is None or batch * blocks * self.kv.block_size > self.max_gather:
            return None
        return batch, blocks

    @torch.inference_mode()
    def logits(self, step: Step, shape: tuple[int, int]) -> torch.Tensor:
        """``[len(step.work), vocab]`` logits of a decode-only step in bucket ``shape``."""
        batch, blocks = shape
        n = len(step.work)
        self._fill(step, batch, blocks)
        if not self.capture:
            return self._forward(batch, blocks)[:n]
        entry = self.graphs.get(shape)
        if entry is None:
            entry = self.graphs[shape] = self._capture(batch, blocks)
        graph, out = entry
        graph.replay()
        return out[:n]

    def _fill(self, step: Step, batch: int, blocks: int) -> None:
        bs = self.kv.block_size
        n = len(step.work)
        scratch = self.scratch_block
        ids, positions, slots, lengths, tables = [], [], [], [], []
        for w in step.work:
            seq = w.seq
            p = seq.num_computed
            table = seq.block_table
            ids.append(seq.tokens[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lengths.append(p + 1)
            tables.append(table + [scratch] * (blocks - len(table)))
        pad = batch - n
        tables += [[scratch] * blocks] * pad
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad, lengths + [1] * pad],
            dtype=torch.long,
        )
        host_tables = torch.tensor(tables, dtype=torch.long)
        if self.capture:
            # Staged in pinned memory the copies do not wait for the kernels already queued.
            host, host_tables = host.pin_memory(), host_tables.pin_memory()
        # The graph reads its inputs where they are: copy into the static buffers.
        self.input_ids[:batch].copy_(host[0], non_blocking=True)
        self.positions[:batch].copy_(host[1], non_blocking=True)
        self.slots[:batch].copy_(host[2], non_blocking=True)
        self.lengths[:batch].copy_(host[3], non_blocking=True)
        self.tables[:batch, :blocks].copy_(host_tables, non_blocking=True)

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The step on the static buffers: what a graph records."""
        bs = self.kv.block_size
        context = blocks * bs
        tables = self.tables[:batch, :blocks]
        decode_slots = (tables[:, :, None] * bs + self.offsets).view(batch, context)
        lengths = self.lengths[:batch, None]
        k_pos = self.key_positions[None, :context]
        mask = k_pos < lengths
        if self.window is not None:
            mask &= (lengths - 1) - k_pos < self.window
        meta = AttentionMetadata(
            self.kv.k,
            self.kv.v,
            self.slots[:batch],
            num_decode=batch,
            decode_slots=decode_slots,
            decode_mask=mask[:, None, None, :],
        )
        return self.model(self.input_ids[:batch], self.positions[:batch], meta, self.rows[:batch])

    def _capture(self, batch: int, blocks: int) -> tuple[Any, torch.Tensor]:
        # A first run off the capture warms up whatever allocates or picks kernels lazily
        # (cuBLAS workspaces, SDPA's backend); its cache writes are the step's own.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(batch, blocks)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for every graph: steps never overlap, and each step's logits are
        # sampled before the next replay overwrites them.
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(batch, blocks)
        self._pool = graph.pool()
        return graph, out
