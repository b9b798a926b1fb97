"""Engine steps of an int8 or int4 model on the CPU, in one C call.

At batch 1 the int8 projections read the whole model in about 9 ms on 2 cores; the same step run
as torch operations spends as long again dispatching some 3,000 small ones (norms, rotary, the
cache gather, attention, residual adds), and even one Python call per kernel (270 a step) cost
3 ms. ``rk_decode_step`` runs the whole model over a step's rows, one per new token; per layer:

    RMSNorm (none for OLMo 2; the LayerNorm families' and Cohere's LayerNorms) + quantize -> qkv
    (OLMo 1's clamped) -> (Qwen3's and Gemma 3's head norms; OLMo's over
    whole projections; Hunyuan's after the rotary) -> rotary (none on SmolLM3's NoPE layers; Ministral 3's query scale) +
    cache write + attention (within the layer's window, if any; Gemma 2's capped scores) ->
    quantize -> o_proj (added to the residual; Gemma 2/3, GLM-4, OLMo: normalised first;
    Granite: scaled) -> RMSNorm + quantize -> gate_up -> SiLU (GELU for Gemma) * up + quantize
    (ungated MLPs: up -> GELU, ReLU or squared ReLU + quantize) -> down_proj (added, the same
    way; parallel blocks: the MLP's input normed and quantized before the attention adds)

(a mixture of experts' layer: ``moe_block`` in the MLP's place; gpt-oss's sinks in the attention;
LFM3's gates, one a head, on the attention's output;
LFM2's short convolution, ``short_conv`` between its in_proj and out_proj, in the attention's place)

and the final norm and LM head (its bias: Phi's, GPT-J's) for the rows that sample; ALiBi's biases
(BLOOM's, MPT's, Falcon-RW's) join the attention's scores. GPT-2's and
OPT's learned positions are added to the embeddings before the call, BLOOM's embedding norm taken there; Gemma's and Granite's embedding factors,
Gemma 2's logit cap and Granite's logit divisor are applied here, around the call; Gemma's
``1 + weight`` norms reach C as their float32 factors.
The model's weights are described to C once (:class:`RkModel`); a step passes only its tokens'
places. The numbers are those of the packed format's C-kernel path up to float rounding (tested
token for token), and a row's are the same whatever else the step holds.

Which steps: every step that decodes, whatever its size, and the steps where prompt chunks join
them, unless those chunks are long (:data:`PROMPT_POSITIONS`, :data:`VNNI_PROMPT_POSITIONS`);
those, and other weight formats, run :class:`.model.CausalLM` as written. Matrix by matrix,
fbgemm's fp16 GEMM (what the torch path uses above :data:`~.quantize.SMALL_BATCH` rows where it
keeps a copy) keeps pace with the C kernel, but the torch
operations around the projections cost more: a 32-sequence decode step took 184 ms as torch
operations and 134 ms here (bench/decode_step.py --rows 32 --torch-ops); with arrivals staggered
over 32 streams, a step that decodes about 30 sequences and computes a short prompt took about
250 ms as torch operations and 150 ms here (bench/staggered.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .conv import ShortConv
from .kv_cache import KVCache
from .lora import PROJECTIONS
from .model import CausalLM
from .quantize import PackedLinear
from .scheduler import Scheduled, Step, StepRows
from .state import STATE_MODELS

if TYPE_CHECKING:
    from .lora import LoraAdapter
    from .model import ModelSpec
    from .moe import SparseMoE

PROMPT_POSITIONS = 65_536
"""Above this many (prompt token, attended position) pairs in a step, the step runs as torch
operations: the one C call falls behind them on long prompts (its int16 matmuls were about half
of a 512-token step in a perf profile, its attention a tenth, growing with the pairs counted
here; fbgemm's fp16 GEMM and SDPA keep up better). ``bench/prompt_step.py``, 1-token
generations, C against torch operations, in ms: a 256-token prompt (32,896 pairs) 509 against
552, a 512-token one (131,328) 1,022 against 1,081, a 1,024-token one (two steps, the second
393,472 pairs) 2,582 against 2,231; on a faster host later, 390 / 411, 822 / 879 and 1,915 /
1,945. (Before the attention's dot products ran eight keys at a time the crossing was below
32,896.) That is with AVX2 alone; with AVX-512 VNNI see :data:`VNNI_PROMPT_POSITIONS`."""

VNNI_PROMPT_POSITIONS = 524_288
""":data:`PROMPT_POSITIONS` where the C kernels have their AVX-512 VNNI loop. The torch
operations' projections then run the same C kernel (no fbgemm copy, :func:`.quantize.large_batch_copy`),
and the one call stays ahead longer: 692 against 754 ms for a 512-token prompt, 1,735 against
1,774 for 1,024 (its second step 393,472 pairs), 2,824 against 2,962 for 1,536 (655,360 in the
last step), 4,463 against 4,231 for 2,000 (820,968)."""


def prompt_positions(work: list[Scheduled]) -> int:
    """Attention pairs of the prompt chunks in ``work`` (not drafts): a chunk of n tokens from
    position s attends to s + 1, ..., s + n positions."""
    total = 0
    for w in work:
        if not w.is_decode and not w.draft:  # a draft's few rows cost what decode rows do
            s, n = w.seq.num_computed, w.num_new
            total += n * s + n * (n + 1) // 2
    return total


def _float_pointer(t: torch.Tensor, keep: list[torch.Tensor]) -> int:
    """The address of ``t`` as contiguous float32 (a copy where it is not), kept alive in ``keep``."""
    t = t.detach().float().contiguous()
    keep.append(t)
    return t.data_ptr()


def _eps(norm: torch.nn.Module | None) -> float:
    """A norm's epsilon; 0 for a norm the model does not have (C reads none then)."""
    return norm.eps if norm is not None else 0.0


GATED_ACTS = {"silu": 0, "gelu_tanh": 1}
UNGATED_ACTS = {"gelu_tanh": 2, "gelu_new": 2, "bloom_gelu": 2, "gelu": 3, "relu": 4, "relu2": 5}
"""``rk_model.act`` for each activation, of a gated and of an ungated MLP (``gelu_new`` and BLOOM's
are the tanh form, in float32 the same)."""


def c_step_refusal(spec: "ModelSpec") -> str | None:
    """Why the C step cannot run ``spec``'s model (the engine then runs the packed projections
    as torch operations); None where it can."""
    if spec.latent is not None or spec.groups_by_best:
        return "latent attention (DeepSeek-V2/V3, GLM-4.7-Flash, Mistral 4, Youtu-LLM)"
    if spec.qk_norm_per_head:
        return "query and key norms with a weight a head (Command R+'s, StableLM 2 12B's)"
    if spec.recurrent or spec.gated_attention or spec.block_kinds:
        return f"linear attention or Mamba layers ({STATE_MODELS})"
    if spec.activation == "xielu":
        return "Apertus's xIELU"
    if spec.value_norms or spec.full_head_dim is not None or spec.layer_scalars:
        return "Gemma 4's value norms, layer scalars, heads of two sizes, per-layer embeddings and shared caches"
    if spec.chunked_windows or spec.weightless_qk_norm or spec.nope_temperature or spec.weights_on_input:
        return "Llama 4's chunked attention, weightless query and key norms, NoPE temperature and experts weighted on their input"
    # No model has these together; the C step's experts, query and key norms and output norms are
    # RMSNorms, and its parallel blocks neither normalise nor scale their outputs.
    if (spec.centered_norms and (spec.is_moe or spec.qk_norm or spec.sandwich_norms)) or (
            spec.parallel_blocks and (spec.is_moe or spec.sandwich_norms or spec.residual_scale is not None)):
        return ("LayerNorms with experts, query and key norms or output norms, and parallel blocks with experts, "
                "output norms or scaled outputs")
    return None


class CpuDecoder:
    """Runs the steps :meth:`accepts` of ``model`` (all its linears :class:`~.quantize.PackedLinear`)
    in one C call each."""

    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        from .moe import ROUTERS, SparseMoE
        from .native import KV_KINDS, RkLayer, RkModel, kernels

        spec = model.spec
        refusal = c_step_refusal(spec)
        if refusal is not None:
            raise ValueError(f"CpuDecoder has no {refusal}")
        if spec.head_dim % 2:
            raise ValueError(f"head_dim {spec.head_dim} is not supported by the CPU decode kernels")
        if spec.is_moe and spec.sandwich_norms:  # no such model; moe_block has no output norms
            raise ValueError("CpuDecoder has no output norms around a mixture of experts")
        # The routers stay float32 linears (moe.ROUTERS); C reads their weights as floats.
        routers = {id(getattr(m, r)) for m in model.modules() if isinstance(m, SparseMoE) for r in ROUTERS}
        if any(isinstance(m, torch.nn.Linear) and id(m) not in routers for m in model.modules()):
            raise ValueError("CpuDecoder needs every projection packed (int8 or int4)")
        # C writes keys and values straight into these tensors, and reads the embeddings as floats.
        for t in (*kv.k, *kv.v, model.embed_tokens.weight):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("CpuDecoder needs contiguous CPU tensors (KV cache and embeddings)")
        if model.embed_tokens.weight.dtype != torch.float32:
            raise ValueError("CpuDecoder needs float32 embeddings")
        if kv.k[0].dtype not in KV_KINDS or any(t.dtype != kv.k[0].dtype for t in (*kv.k, *kv.v)):
            raise ValueError(f"CpuDecoder needs a KV cache of one of {[str(d) for d in KV_KINDS]}")
        self._k = kernels()
        self.prompt_positions = VNNI_PROMPT_POSITIONS if self._k.simd == 2 else PROMPT_POSITIONS
        self.model = model
        self.kv = kv
        self.spec = spec
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        self._kp = max(lin.padded_in_features for lin in linears)
        # Everything C reads stays referenced here (the model holds the packed weights).
        self._keep: list[torch.Tensor] = []
        self._keep_arrays: list[object] = []  # the experts' pointer arrays (ctypes)
        f32 = lambda t: _float_pointer(t, self._keep)  # noqa: E731

        # OLMo 1's norms (of the hidden size) have no weight: ones
        norm = lambda n: (f32(n.scale() if n.weight is not None else torch.ones(spec.hidden_size))  # noqa: E731
                          if n is not None else None)
        bias = lambda n: f32(n.bias) if n is not None and n.bias is not None else None  # noqa: E731
        rope = f32(model.rotary.cos), f32(model.rotary.sin)
        local = (f32(model.local_rotary.cos), f32(model.local_rotary.sin)) if model.local_rotary is not None else rope
        layers = (RkLayer * spec.num_layers)()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            conv = isinstance(attn, ShortConv)  # LFM2: its in_proj and out_proj where q/k/v and o are
            qkv_proj, o_proj = (attn.in_proj, attn.out_proj) if conv else (attn.qkv_proj, attn.o_proj)
            (qkv, qkv_b), (o, o_b) = qkv_proj.pointers, o_proj.pointers
            if isinstance(mlp, SparseMoE):
                (gu, gu_b), (down, down_b), gu_kp, down_kp = (0, None), (0, None), 0, 0
                moe = self._experts(mlp)
            else:  # an ungated MLP's up_proj where a gated one's gate_up_proj is
                up = mlp.gate_up_proj if hasattr(mlp, "gate_up_proj") else mlp.up_proj
                (gu, gu_b), (down, down_b) = up.pointers, mlp.down_proj.pointers
                gu_kp, down_kp, moe = up.padded_in_features, mlp.down_proj.padded_in_features, {}
            cos, sin = (local if attn.sliding else rope) if attn.rotates else (None, None)
            layers[i] = RkLayer(
                ln1=norm(layer.input_layernorm), ln2=norm(layer.post_attention_layernorm),
                eps1=_eps(layer.input_layernorm), eps2=_eps(layer.post_attention_layernorm),
                ln1_bias=bias(layer.input_layernorm), ln2_bias=bias(layer.post_attention_layernorm),
                qkv=qkv, o=o, gate_up=gu, down=down,
                qkv_bias=qkv_b, o_bias=o_b, gate_up_bias=gu_b, down_bias=down_b,
                qkv_kp=qkv_proj.padded_in_features, o_kp=o_proj.padded_in_features,
                gate_up_kp=gu_kp, down_kp=down_kp, **moe,
                k_cache=kv.k[i].data_ptr(), v_cache=kv.v[i].data_ptr(), window=spec.window_of(i) or 0,
                cos=cos, sin=sin, attn_out_norm=norm(layer.attn_out_norm), mlp_out_norm=norm(layer.mlp_out_norm),
                out_eps=_eps(layer.attn_out_norm),
                **(self._conv(attn) if conv else dict(
                    q_norm=norm(attn.q_norm), k_norm=norm(attn.k_norm), qk_eps=_eps(attn.q_norm),
                    qk_norm_whole=int(attn.whole_qk_norm), sinks=f32(attn.sinks) if attn.sinks is not None else None,
                    qk_norm_after_rotary=int(attn.norm_after_rotary))),
            )
        self._layers = layers
        head = model.lm_head
        self._plan = RkModel(
            num_layers=spec.num_layers, hidden=spec.hidden_size, inter=spec.intermediate_size,
            heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            group=linears[0].group, vocab=head.out_features, block_size=kv.block_size,
            scale=spec.attention_scale, final_eps=model.norm.eps, softcap=spec.attn_softcap or 0.0,
            residual_scale=spec.residual_scale or 1.0,
            q_scales=f32(model.query_scales) if model.query_scales is not None else None,
            act=(UNGATED_ACTS if spec.ungated_mlp else GATED_ACTS)[spec.activation], layers=layers,
            final_norm=norm(model.norm), final_norm_bias=bias(model.norm), centered=int(spec.centered_norms),
            lm_head=head.pointers[0], lm_head_bias=head.pointers[1], lm_head_kp=head.padded_in_features,
            parallel=0 if not spec.parallel_blocks else 2 if spec.parallel_mlp_norm else 1, clip_qkv=spec.clip_qkv or 0.0,
            bits=linears[0].bits, lm_head_bits=head.bits, kv_kind=KV_KINDS[kv.k[0].dtype],
            head_gates=int(spec.head_gates),
            alibi=f32(torch.tensor(spec.alibi, dtype=torch.float32)) if spec.alibi else None,
        )
        if spec.parallel_blocks and len({layer.gate_up_kp for layer in layers}) != 1:  # C's scratch of one width
            raise ValueError("CpuDecoder needs every parallel block's MLP input of one width")
        if any(lin.group != self._plan.group for lin in linears):
            raise ValueError("CpuDecoder needs one group size for every projection")
        if any(lin.bits != self._plan.bits for lin in linears if lin is not head):
            raise ValueError("CpuDecoder needs one width (8 or 4 bits) for every projection of the layers")
        self.serves_adapters = False

    def _conv(self, conv: ShortConv) -> dict:
        """``rk_layer``'s fields for LFM2's short convolution: its float32 taps ``[kernel, hidden]``
        and bias."""
        bias = conv.conv_bias
        return dict(conv_taps=_float_pointer(conv.taps, self._keep), conv_kernel=conv.kernel,
                    conv_bias=_float_pointer(bias, self._keep) if bias is not None else None)

    def _experts(self, moe: "SparseMoE") -> dict:
        """``rk_layer``'s fields for a mixture of experts: the float32 router (its bias, the shared
        expert's gate, the choice bias), each expert's packed gate_up and down with their biases,
        in arrays kept here; how the weights come (``routing``, sigmoid scores, groups, the
        scaling factor) and gpt-oss's clamp."""
        from .native import RkExpert

        def expert(mlp) -> RkExpert:
            (gu, gu_b), (down, down_b) = mlp.gate_up_proj.pointers, mlp.down_proj.pointers
            return RkExpert(gu, down, gu_b, down_b)

        first = moe.experts[0]
        experts = (RkExpert * moe.num_experts)(*(expert(e) for e in moe.experts))
        self._keep_arrays.append(experts)
        alpha, limit = first.clamp if first.clamp is not None else (0.0, 0.0)
        fields = dict(
            router=_float_pointer(moe.gate.weight, self._keep),
            router_bias=_float_pointer(moe.gate.bias, self._keep) if moe.gate.bias is not None else None,
            experts=experts, num_experts=moe.num_experts, top_k=moe.top_k, expert_inter=first.down_proj.in_features,
            expert_gate_up_kp=first.gate_up_proj.padded_in_features, expert_down_kp=first.down_proj.padded_in_features,
            routing=2 if moe.softmax_top_k else int(moe.normalize), clamp_alpha=alpha, clamp_limit=limit,
            sigmoid=int(moe.sigmoid), routed_scale=moe.routed_scale or 1.0,
            choice_bias=_float_pointer(moe.choice_bias, self._keep) if moe.choice_bias is not None else None,
            n_group=moe.groups[0] if moe.groups else 1, topk_group=moe.groups[1] if moe.groups else 1,
        )
        shared = moe.shared_expert
        if shared is not None:
            one = (RkExpert * 1)(expert(shared))
            self._keep_arrays.append(one)
            fields.update(
                shared=one, shared_gate=_float_pointer(moe.shared_expert_gate.weight, self._keep)
                if moe.shared_expert_gate is not None else None,
                shared_inter=shared.down_proj.in_features, shared_gate_up_kp=shared.gate_up_proj.padded_in_features,
                shared_down_kp=shared.down_proj.padded_in_features,
            )
        return fields

    def attach_adapters(self, adapters: list[LoraAdapter | None]) -> bool:
        """Describe LoRA adapters to C (``adapters[i]`` is index i + 1; None: a free index), so
        that steps with adapter rows run here too; False (and no steps with adapter rows here)
        where one does not fit C's limits (more parts to one projection than ``RK_LORA_PARTS``,
        a rank above ``RK_LORA_RANK``): those steps then run the torch path."""
        import ctypes

        from .native import RkLora

        self.serves_adapters = False
        parts_per, max_rank = self._k.lora_parts, self._k.lora_rank
        projections = len(PROJECTIONS)  # rk_decode_step's `which`: their order
        layers = self.spec.num_layers
        present = [(i, a) for i, a in enumerate(adapters) if a is not None]
        entries = [
            (((i * layers + layer) * projections + PROJECTIONS.index(module)) * parts_per + p, part)
            for i, adapter in present
            for (layer, module), parts in adapter.parts.items()
            for p, part in enumerate(parts)
        ]
        if any(len(parts) > parts_per for _, a in present for parts in a.parts.values()) or any(
            a.shape[0] > max_rank for _, (_, _, a, _) in entries
        ):
            self._lora, self._plan.lora, self._plan.num_adapters = None, None, 0  # drop the old table's copies
            return False
        table = (RkLora * max(1, len(adapters) * layers * projections * parts_per))()
        keep: list[torch.Tensor] = []  # what C reads, referenced as long as this table is the plan's
        for at, (start, end, a, b) in entries:
            table[at] = RkLora(_float_pointer(a, keep), _float_pointer(b.T, keep), a.shape[0], start, end - start)
        self._lora = (table, keep)
        self._plan.lora = ctypes.cast(table, ctypes.POINTER(RkLora))
        self._plan.num_adapters = len(adapters)
        self.serves_adapters = True
        return True

    def accepts(self, step: Step) -> bool:
        """Whether this step runs here: any number of decoding sequences, and prompt chunks whose
        tokens attend to at most ``prompt_positions`` positions in all (:data:`PROMPT_POSITIONS`;
        0 keeps every prompt chunk on the torch path)."""
        work = step.work
        return len(work) > 0 and prompt_positions(work) <= self.prompt_positions

    def logits(self, step: Step, rows: StepRows | None = None, row_adapters: list[int] | None = None) -> torch.Tensor:
        """Logits ``[len(rows.out_rows), vocab]`` for a step (``rows``: its :class:`StepRows`, built
        here when not given): the sampling rows in the order of ``step.work``, with any rows that
        score prompts among them. ``row_adapters``: each row's LoRA adapter (0: none; see
        :meth:`attach_adapters`), or None when no row has one."""
        spec = self.spec
        rows = rows if rows is not None else StepRows.of(step.work, self.kv.block_size)
        m, s = len(rows.ids), len(rows.out_rows)
        pos_t, slot_t, len_t, tab_of_t, table_t, out_t = (
            torch.tensor(xs, dtype=torch.long)
            for xs in (rows.positions, rows.slots, rows.lengths, rows.table_of, rows.tables, rows.out_rows)
        )
        x = self.model.embed_tokens.weight.index_select(0, torch.tensor(rows.ids, dtype=torch.long))  # the residual
        if (scale := self.model.embed_scale(x.dtype)) is not None:
            x.mul_(scale)
        if self.model.embed_positions is not None:  # GPT-2's, OPT's learned positions
            x += self.model.embed_positions.weight.index_select(0, pos_t)
        if self.model.embed_norm is not None:  # BLOOM's
            x = self.model.embed_norm(x)
        f32 = lambda *shape: torch.empty(*shape, dtype=torch.float32)  # noqa: E731
        q = torch.empty(m, self._kp, dtype=torch.int16)
        dq, tmp = f32(m), f32(max(spec.hidden_size, spec.intermediate_size))
        conv = 3 * spec.hidden_size if spec.conv_layers else 0  # LFM2's in_proj: B, C, x
        gates = spec.num_heads if spec.head_gates else 0  # LFM3's, after q, k and v
        qkv = f32(m, max((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + gates, conv))
        attn = f32(m, max(spec.num_heads * spec.head_dim, conv // 3))
        gate_up = f32(m, 2 * spec.intermediate_size)
        xsum = f32(m * self._kp // self._plan.group)
        logits = f32(s, self._plan.vocab)
        adapter_t = torch.tensor(row_adapters, dtype=torch.long) if row_adapters is not None else None
        if adapter_t is not None and not self.serves_adapters:
            raise ValueError("a step with adapter rows, and no adapters attached to the C decoder")
        ok = self._k.decode_step(
            self._plan, m, x.data_ptr(), pos_t.data_ptr(), slot_t.data_ptr(), table_t.data_ptr(), rows.width,
            tab_of_t.data_ptr(), len_t.data_ptr(), max(rows.lengths), out_t.data_ptr(), s, q.data_ptr(),
            dq.data_ptr(), tmp.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), xsum.data_ptr(),
            logits.data_ptr(), adapter_t.data_ptr() if adapter_t is not None else None,
        )
        if not ok:
            raise MemoryError(
                "no memory for the scratch of this step (attention scores, adapter rows, output norms, experts)"
            )
        return self.model.final_logits(logits)

