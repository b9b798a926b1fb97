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
that the block pool never hands out; each attends to one key only, so no row is fully masked
(which would give NaN). Table entries past a row's length (the scratch block, or a block id left
from an earlier step) are hidden by the mask. Padding rows' logits are discarded.

All graphs are captured when the engine starts (:meth:`DecodeGraphs.capture_all`: one per batch
bucket and block bucket within the gather budget), into one shared memory pool, and each writes
its logits into one shared output buffer. Capturing at start-up keeps its costs (a warm-up run
and a capture per shape) out of serving and shows a lack of memory at load time. A shape whose
capture fails runs eagerly from then on, as do steps that prefill, exceed the largest bucket or
would gather more than :data:`GATHER_BYTES` of keys and values per layer.

Captures are serialized process-wide and use ``thread_local`` error mode on the engine's own
stream and device, so another engine loading weights on another thread does not break them.

With ``capture=False`` the same static path runs eagerly every step: how the padding, masks and
scratch writes are tested on a machine without a GPU (a captured graph replays exactly the
kernels this path launches).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .attention import GATHER_BYTES, AttentionMetadata, in_window, position_bytes
from .kv_cache import KVCache
from .model import CausalLM
from .scheduler import Step, StepRows


log = logging.getLogger("router.torch")
_capturing = threading.Lock()  # one CUDA graph capture at a time in the process


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
        max_gather: int | None = None,
    ) -> None:
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is outside the KV cache ({kv.num_blocks} blocks)")
        device = kv.k[0].device
        if model.spec.recurrent:  # per-sequence states (state.py): no static buffers for them
            raise ValueError("decode graphs do not run models with linear-attention layers")
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv = kv
        self.device = device
        self.capture = capture
        # Key positions one graph may gather per layer (batch x context).
        self.max_gather = max_gather if max_gather is not None else GATHER_BYTES // position_bytes(kv.k, kv.v)
        self.batches = batch_buckets(max_batch)
        self.blocks = block_buckets(max_blocks)
        self.window, self.chunked = model.spec.sliding_window, model.spec.chunked_windows
        self.full_layers, self.window_layers = model.spec.mask_kinds
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
        # The logits in the model's dtype, as the eager path returns them (not the cache's, which
        # kv_cache_dtype may narrow)
        dtype = model.embed_tokens.weight.dtype
        self.logits_out = torch.empty(max_batch, model.spec.vocab_size, dtype=dtype, device=device) if capture else None
        self.graphs: dict[tuple[int, int], Any] = {}
        self.failed: set[tuple[int, int]] = set()  # shapes whose capture failed: eager
        self._pool: Any = None
        self._stream = torch.cuda.Stream(device) if capture else None

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, blocks) bucket within the gather budget."""
        return [(b, k) for b in self.batches for k in self.blocks if self._within_budget(b, k)]

    def _within_budget(self, batch: int, blocks: int) -> bool:
        return batch * blocks * self.kv.block_size <= self.max_gather

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture a graph for every shape (the static buffers hold padding: each capture's
        warm-up run writes only the scratch block)."""
        torch.cuda.synchronize(self.device)
        # Largest first: the smaller graphs then find the pool's memory already there.
        for shape in sorted(self.shapes(), key=lambda bk: bk[0] * bk[1], reverse=True):
            self._captured(shape)
        log.info("captured %d decode graphs (%d failed)", len(self.graphs), len(self.failed))

    def shape(self, step: Step) -> tuple[int, int] | None:
        """The (batch, blocks) bucket ``step`` runs in, or None when it must run eagerly."""
        work = step.work
        if not work or not all(w.is_decode for w in work):
            return None
        batch = _bucket(self.batches, len(work))
        blocks = _bucket(self.blocks, max(len(w.seq.block_table) for w in work))
        if batch is None or blocks is None or not self._within_budget(batch, blocks):
            return None
        if (batch, blocks) in self.failed:
            return None
        return batch, blocks

    @torch.inference_mode()
    def logits(self, step: Step, shape: tuple[int, int]) -> torch.Tensor | None:
        """``[len(step.work), vocab]`` logits of a decode-only step in bucket ``shape``; None
        when that shape's graph cannot be captured (the step then runs eagerly)."""
        batch, blocks = shape
        n = len(step.work)
        if not self.capture:
            self._fill(step, batch)
            return self._forward(batch, blocks)[:n]
        graph = self._captured(shape)
        if graph is None:
            return None
        self._fill(step, batch)
        graph.replay()
        return self.logits_out[:n]  # type: ignore[index]

    def _captured(self, shape: tuple[int, int]) -> Any:
        graph = self.graphs.get(shape)
        if graph is None and shape not in self.failed:
            try:
                graph = self.graphs[shape] = self._capture(*shape)
            except Exception as exc:  # noqa: BLE001 - out of memory, a kernel that will not capture
                self.failed.add(shape)
                log.warning("decode graph %s not captured, runs eagerly: %s: %s", shape, type(exc).__name__, exc)
        return graph

    def _fill(self, step: Step, batch: int) -> None:
        """Copy a step's inputs into the static buffers. Only the real rows' tables, as wide as
        the widest: table entries past a row's length, and padding rows' tables, may hold any
        block id (initially the scratch block), because the mask hides them."""
        n = len(step.work)
        rows = StepRows.of(step.work, self.kv.block_size, self.scratch_block)
        pad = batch - n
        host = torch.tensor(
            [rows.ids + [0] * pad, rows.positions + [0] * pad, rows.slots + [self.scratch_slot] * pad,
             rows.lengths + [1] * pad],
            dtype=torch.long,
        )
        host_tables = torch.tensor(rows.tables, dtype=torch.long)
        if self.capture:
            # Staged in pinned memory the copies do not wait for the kernels already queued.
            host, host_tables = host.pin_memory(), host_tables.pin_memory()
        # The graph reads its inputs where they are: copy into the static buffers.
        self.input_ids[:batch].copy_(host[0], non_blocking=True)
        self.positions[:batch].copy_(host[1], non_blocking=True)
        self.slots[:batch].copy_(host[2], non_blocking=True)
        self.lengths[:batch].copy_(host[3], non_blocking=True)
        self.tables[:n, : rows.width].copy_(host_tables, non_blocking=True)

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The step on the static buffers: what a graph records."""
        bs = self.kv.block_size
        context = blocks * bs
        tables = self.tables[:batch, :blocks]
        decode_slots = (tables[:, :, None] * bs + self.offsets).view(batch, context)
        lengths = self.lengths[:batch, None]
        k_pos = self.key_positions[None, :context]
        mask = k_pos < lengths
        meta = AttentionMetadata(self.kv.k, self.kv.v, self.slots[:batch], num_decode=batch, decode_slots=decode_slots)
        if self.full_layers:
            meta.decode_mask = mask[:, None, None, :]
        if self.window_layers:
            meta.decode_window_mask = (mask & in_window(lengths - 1, k_pos, self.window, self.chunked))[:, None, None, :]
        return self.model(self.input_ids[:batch], self.positions[:batch], meta, self.rows[:batch])

    def _capture(self, batch: int, blocks: int) -> Any:
        def step() -> None:
            # Every graph's logits land in one buffer: steps never overlap, and each step's
            # logits are sampled before the next replay.
            self.logits_out[:batch].copy_(self._forward(batch, blocks))  # type: ignore[index]

        with _capturing, torch.cuda.device(self.device):
            # A first run off the capture warms up whatever allocates or picks kernels lazily
            # (cuBLAS workspaces, SDPA's backend).
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # capture_begin/end rather than ``torch.cuda.graph``, which also collects garbage and
            # empties the allocator's cache before every capture: costly, times a hundred shapes.
            # One memory pool for every graph: they never run at the same time.
            stream.synchronize()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    step()
                finally:
                    graph.capture_end()
            self._pool = graph.pool()
        return graph
