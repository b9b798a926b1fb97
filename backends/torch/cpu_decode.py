"""Decode steps of an int8 model on the CPU, one C kernel per operation.

At batch 1 the int8 projections read the whole model in about 9 ms on 2 cores; the same step run
as torch operations spends as long again dispatching some 3,000 small ones (norms, rotary, the
cache gather, attention, residual adds). For a step that only decodes, and at most
:data:`~.quantize.SMALL_BATCH` sequences, a layer here is nine kernel calls:

    RMSNorm + quantize -> qkv -> rotary + cache write + attention -> quantize -> o_proj (added to
    the residual) -> RMSNorm + quantize -> gate_up -> SiLU * up + quantize -> down_proj (added)

Every other step (prefill chunks, large batches, other weight formats) runs :class:`.model.CausalLM`
as written. The numbers are those of the int8 format's own general path up to float rounding.
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .model import CausalLM
from .quantize import SMALL_BATCH, Int8WeightLinear
from .scheduler import Step

MAX_HEAD_DIM = 1024  # the attention kernel's rotary scratch


class CpuDecoder:
    """Runs pure-decode steps of ``model`` (all its linears :class:`Int8WeightLinear`)."""

    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        from .native import kernels

        spec = model.spec
        if spec.head_dim > MAX_HEAD_DIM or spec.head_dim % 2:
            raise ValueError(f"head_dim {spec.head_dim} is not supported by the CPU decode kernels")
        self._k = kernels()
        self.model = model
        self.kv = kv
        self.spec = spec
        self.max_rows = SMALL_BATCH
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        if linears:
            raise ValueError("CpuDecoder needs every projection packed as int8")
        self._layers = [
            (
                layer.input_layernorm.weight.detach().contiguous(),
                layer.input_layernorm.eps,
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.post_attention_layernorm.weight.detach().contiguous(),
                layer.post_attention_layernorm.eps,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            for layer in model.layers
        ]
        self._caches = [(kc.data_ptr(), vc.data_ptr()) for kc, vc in zip(kv.k, kv.v)]
        self._final_norm = model.norm.weight.detach().contiguous()
        self._cos = model.rotary.cos.contiguous()
        self._sin = model.rotary.sin.contiguous()
        self._scale = spec.head_dim**-0.5
        self._window = spec.sliding_window or 0
        self._padded = {lin.padded_in_features for lin in model.modules() if isinstance(lin, Int8WeightLinear)}
        self._kp = max(self._padded)

    def accepts(self, step: Step) -> bool:
        """Whether this step is decode-only and small enough for the kernels."""
        work = step.work
        return 0 < len(work) <= self.max_rows and all(w.is_decode for w in work)

    def logits(self, step: Step) -> torch.Tensor:
        """Logits ``[len(step.work), vocab]`` for a step :meth:`accepts` (every row samples)."""
        k, spec = self._k, self.spec
        bs = self.kv.block_size
        work = step.work
        m = len(work)
        ids, positions, slots, lengths, tables = [], [], [], [], []
        width = max(len(w.seq.block_table) for w in work)
        for w in work:
            seq = w.seq
            p = seq.num_computed
            table = seq.block_table
            ids.append(seq.tokens[p])
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lengths.append(p + 1)
            tables.extend(table)
            tables.extend([0] * (width - len(table)))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        pos_t, slot_t, len_t, table_t = as_long(positions), as_long(slots), as_long(lengths), as_long(tables)
        max_len = max(lengths)

        hidden = spec.hidden_size
        x = self.model.embed_tokens.weight.index_select(0, as_long(ids))  # [m, hidden], the residual
        qbuf = torch.empty(m * self._kp, dtype=torch.int16)
        rows = {kp: qbuf[: m * kp].view(m, kp) for kp in self._padded}  # int16 rows, as each linear reads them
        dq = torch.empty(m, dtype=torch.float32)
        tmp = torch.empty(max(hidden, spec.intermediate_size), dtype=torch.float32)
        qkv_size = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        qkv = torch.empty(m, qkv_size, dtype=torch.float32)
        attn = torch.empty(m, spec.num_heads * spec.head_dim, dtype=torch.float32)
        gate_up = torch.empty(m, 2 * spec.intermediate_size, dtype=torch.float32)
        scratch = torch.empty(m * spec.num_heads * max_len, dtype=torch.float32)
        xp, qp, dqp, tp = x.data_ptr(), qbuf.data_ptr(), dq.data_ptr(), tmp.data_ptr()
        # decode_attention's arguments around the layer's two cache pointers.
        where = (qkv.data_ptr(), m, qkv_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                 pos_t.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr())
        over = (slot_t.data_ptr(), table_t.data_ptr(), width, len_t.data_ptr(), bs, self._window, self._scale,
                max_len, scratch.data_ptr(), attn.data_ptr())
        for (ln1, eps1, qkv_proj, o_proj, ln2, eps2, gate_up_proj, down_proj), (kc, vc) in zip(self._layers, self._caches):
            k.rmsnorm_quantize(xp, m, hidden, hidden, ln1.data_ptr(), eps1, tp, qkv_proj.padded_in_features, qp, dqp)
            qkv_proj.matmul(rows[qkv_proj.padded_in_features], dq, qkv)
            k.decode_attention(*where, kc, vc, *over)
            k.quantize_rows(attn.data_ptr(), m, attn.shape[1], attn.shape[1], o_proj.padded_in_features, qp, dqp)
            o_proj.matmul(rows[o_proj.padded_in_features], dq, x, accumulate=True)
            k.rmsnorm_quantize(xp, m, hidden, hidden, ln2.data_ptr(), eps2, tp, gate_up_proj.padded_in_features, qp, dqp)
            gate_up_proj.matmul(rows[gate_up_proj.padded_in_features], dq, gate_up)
            k.silu_mul_quantize(
                gate_up.data_ptr(), m, spec.intermediate_size, gate_up.shape[1], tp, down_proj.padded_in_features, qp, dqp
            )
            down_proj.matmul(rows[down_proj.padded_in_features], dq, x, accumulate=True)
        head = self.model.lm_head
        k.rmsnorm_quantize(xp, m, hidden, hidden, self._final_norm.data_ptr(), self.model.norm.eps, tp, head.padded_in_features, qp, dqp)
        logits = torch.empty(m, head.out_features, dtype=torch.float32)
        head.matmul(rows[head.padded_in_features], dq, logits)
        return logits
