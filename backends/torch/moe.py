"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, Granite-MoE) as
plain torch modules.

A router (``gate``) scores every expert for every token; each token runs through its
``experts_per_token`` best experts, whose outputs are summed with the router's softmax weights
(renormalised over the chosen ones where the config says so: Mixtral always, Qwen with
``norm_topk_prob``). Qwen2-MoE adds a shared expert that every token runs through, scaled by a
sigmoid gate. gpt-oss's router has a bias and softmaxes only the top-k logits it picks; its
experts have biases and a clamped SwiGLU (:class:`.model.MLP`). Granite-MoE's router softmaxes
its top-k logits too, with no bias. GLM-4.5, dots.llm1 and MiniMax-M2 route as DeepSeek-V3 does:
sigmoid scores, plus a learned bias to choose the experts (not to weight them), among the best
groups of experts where the config has groups, the weights times ``routed_scaling_factor``;
ERNIE 4.5 the same from softmax scores. DeepSeek-V2 chooses by softmax scores alone, in groups
scored by their best expert. Mistral 4 chooses as DeepSeek-V3 from softmax scores without a bias,
in the router's dtype. Their shared experts are added ungated. Llama 4 chooses by its logits
and weights each chosen expert's input, not its output, by the logit's sigmoid; a shared expert
is added ungated. Gemma 4's experts run beside
each layer's MLP: softmax scores of its scaled router, renormalised over the chosen ones, each
times its expert's learned scale. Numerics follow Hugging Face's
implementation (transformers 5's grouped experts, what ``from_pretrained`` runs): the softmax in
float32 (gpt-oss's in the logits' dtype), the same top-k, each (token, slot) pair's weighted
output kept apart and the slots summed once per token, Mixtral's weights in float32 and the
others' in the model's dtype, so greedy outputs match it token for token.

The tokens of a step are grouped by expert once (one sort, one count read back to the host), so
an expert's matmul runs over exactly the rows routed to it, however the batch mixes sequences.
That read-back is why decode steps of MoE models are not captured into CUDA graphs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .weights import WeightReader, dequantize_mxfp4, load_fused_mlp, load_mlp

if TYPE_CHECKING:
    from .model import ModelSpec

ROUTERS = ("gate", "shared_expert_gate")
"""Attribute names of the routing projections. They stay in float32 under every weight format
(a rounding there changes which experts a token reaches), as llama.cpp keeps a GGUF file's
``ffn_gate_inp`` unquantized; they are a few thousand weights per layer."""


def _out_in(stacked: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """Stacked experts' matrices as ``[E, out, in]``: transposed where they are ``[E, in, out]``
    and not (square) both, as transformers tells them apart."""
    out_in = (linear.out_features, linear.in_features)
    if tuple(stacked.shape[1:]) != out_in and tuple(stacked.shape[1:]) == out_in[::-1]:
        return stacked.transpose(1, 2)
    return stacked


class SparseMoE(nn.Module):
    """One layer's experts and their router; ``expert(size)`` builds one expert's MLP, ``shared(size)``
    the shared expert's where it differs (Nemotron-H's has ``mlp_bias``, its routed ones never)."""

    def __init__(self, spec: ModelSpec, expert: Callable[[int], nn.Module],
                 shared: Callable[[int], nn.Module] | None = None, router_norm: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_experts, spec.experts_per_token
        self.normalize = spec.normalize_routing
        self.float_weights = spec.float_routing_weights
        self.softmax_top_k = spec.softmax_top_k
        self.sigmoid, self.groups, self.routed_scale = spec.sigmoid_routing, spec.expert_groups, spec.routed_scale
        self.groups_by_best = spec.groups_by_best
        self.stacked_in_out = spec.stacked_in_out
        self.float_router = spec.float_router
        self.scores_in_model_dtype = spec.scores_in_model_dtype  # LFM2-MoE's, Mistral 4's
        self.renorm_eps = spec.renorm_eps
        self.weights_on_input = spec.weights_on_input  # Llama 4's
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=spec.router_bias)
        # Gemma 4's router: its input through router_norm (an RMSNorm without weight) times input_scale
        # and hidden_size ** -0.5; the chosen experts' weights times their expert_scale.
        scaled = spec.scaled_router
        if scaled and router_norm is None:
            raise ValueError("a scaled router needs its router_norm")
        self.router_norm = router_norm
        self.input_scale = nn.Parameter(torch.ones(spec.hidden_size), requires_grad=False) if scaled else None
        self.expert_scale = nn.Parameter(torch.ones(spec.num_experts), requires_grad=False) if scaled else None
        self.root = spec.hidden_size**-0.5
        # DeepSeek-V3's e_score_correction_bias: added to the scores to choose experts only.
        self.choice_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False) if spec.routing_bias else None
        self.experts = nn.ModuleList(expert(spec.expert_size) for _ in range(spec.num_experts))
        self.shared_expert = (shared or expert)(spec.shared_expert_size) if spec.shared_expert_size else None
        gated = spec.shared_expert_size and spec.shared_expert_gated
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False) if gated else None

    def keep_float_router(self) -> None:
        """The router's weights and its choice bias back to float32 after the model was cast to
        its dtype, for a model whose router works in float32 (``float_router``), as
        transformers keeps them (MiniMax-M2's are in the model's dtype); LFM2-MoE's choice bias
        alone."""
        if self.float_router:
            self.gate.float()
        if (self.float_router or self.scores_in_model_dtype) and self.choice_bias is not None:
            self.choice_bias.data = self.choice_bias.data.float()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts ``[n, top_k]`` (best first) and their weights: float32
        (Mixtral) or ``x``'s dtype (the Qwens, gpt-oss), as transformers keeps them."""
        if self.softmax_top_k:  # gpt-oss, Granite-MoE: the best logits, softmaxed among themselves
            logits, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)
            # In the logits' dtype: torch computes it in float32 and rounds once, as Granite-MoE's
            # float32 softmax then cast (the same bits, tested).
            return F.softmax(logits, dim=-1, dtype=logits.dtype).to(x.dtype), chosen
        if self.weights_on_input:  # Llama 4: the best logits (not their sigmoids, which tie at 1 past about 17),
            logits, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)  # each weighted by its sigmoid
            return torch.sigmoid(logits.float()).to(x.dtype), chosen
        if self.input_scale is not None:  # Gemma 4: normalised, rounded, then scaled in x's dtype
            x = self.router_norm(x) * self.input_scale * self.root
        logits = self.gate(x.float()) if self.float_router else self.gate(x)
        if self.sigmoid:
            scores = torch.sigmoid(logits if self.scores_in_model_dtype else logits.float())
        else:
            scores = F.softmax(logits, dim=-1, dtype=logits.dtype if self.scores_in_model_dtype else torch.float32)
        if self.choice_bias is None and self.groups is None:
            weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        else:
            biased = scores if self.choice_bias is None else scores + self.choice_bias
            chosen = torch.topk(self._choice(biased), self.top_k, dim=-1).indices
            weights = scores.gather(1, chosen)
        if self.normalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + self.renorm_eps if self.renorm_eps else total)
        if self.routed_scale is not None:
            weights = weights * self.routed_scale
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[chosen]
        return (weights if self.float_weights else weights.to(x.dtype)), chosen

    def _choice(self, biased: torch.Tensor) -> torch.Tensor:
        """The (biased) scores ``[n, E]`` an expert is chosen by: with groups, those outside the
        ``topk_group`` groups whose two best scores sum highest (DeepSeek-V2: whose best score
        is highest) set to -inf."""
        if self.groups is None:
            return biased
        count, kept = self.groups
        grouped = biased.view(-1, count, self.num_experts // count)
        best = grouped.amax(dim=-1) if self.groups_by_best else grouped.topk(2, dim=-1).values.sum(dim=-1)
        dropped = torch.ones_like(best, dtype=torch.bool).scatter_(1, best.topk(kept, dim=-1).indices, False)
        return grouped.masked_fill(dropped[..., None], float("-inf")).view(-1, self.num_experts)

    def forward(self, x: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' output for ``x``, routed by ``routed`` where given (Gemma 4: the residual,
        its experts reading a normed copy), else by ``x``."""
        weights, chosen = self.route(x if routed is None else routed)
        flat = chosen.flatten()
        # (token, slot) pairs grouped by expert: each expert's rows in one matmul.
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.flatten()
        # Every pair's output in its own row (each pair has one expert, so each row is written),
        # then summed over a token's slots at once and rounded once, as transformers does.
        slots = x.new_empty(flat.numel(), x.shape[-1], dtype=torch.promote_types(x.dtype, weights.dtype))
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            if self.weights_on_input:  # Llama 4: the expert reads the weighted token, its output summed as it is
                slots[pairs] = self.experts[e](x[pairs // self.top_k] * pair_weights[pairs, None])
            else:
                slots[pairs] = self.experts[e](x[pairs // self.top_k]) * pair_weights[pairs, None]
        out = slots.view(-1, self.top_k, x.shape[-1]).sum(dim=1).to(x.dtype)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def load(self, prefix: str, state: WeightReader) -> None:
        """Copy the block's weights from a Hugging Face checkpoint: the router, then the experts
        one matrix each (``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's
        ``block_sparse_moe.experts.E.w1`` / ``w3`` / ``w2``) or as transformers 5 holds them in
        memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; Granite-MoE's
        ``block_sparse_moe.input_linear`` and ``output_linear`` alike, its router
        ``router.layer``), or gpt-oss's (:meth:`_load_gpt_oss`), then the shared expert and its
        gate."""
        sparse = prefix + "block_sparse_moe."
        granite = state.has(sparse + "router.layer.weight")  # as Granite-MoE's checkpoints name it
        routers = ("gate.weight", "router.weight", "router.layer.weight")
        moe = sparse if any(state.has(sparse + r) for r in routers) else prefix + "mlp."
        router = moe + ("router.layer." if granite else "router." if state.has(moe + "router.weight") else "gate.")
        if self.input_scale is not None:  # Gemma 4's: under the layer, beside its mlp
            moe, router = prefix, prefix + "router.proj."
            state.copy(self.input_scale, prefix + "router.scale")
            state.copy(self.expert_scale, prefix + "router.per_expert_scale")
        state.copy(self.gate.weight, router + "weight")
        if self.gate.bias is not None:
            state.copy(self.gate.bias, router + "bias")
        if self.choice_bias is not None:
            self._load_choice_bias(moe, state)
        if not hasattr(self.experts[0], "gate_up_proj"):  # Nemotron-H's ungated experts and shared expert
            self._load_ungated(moe, state)
            return
        stacked = None
        if granite:
            stacked = ("input_linear.weight", "output_linear.weight")
        elif state.has(moe + "experts.gate_up_proj"):
            stacked = ("experts.gate_up_proj", "experts.down_proj")
        if self.experts[0].gate_up_proj.bias is not None:  # only gpt-oss's experts have biases
            self._load_gpt_oss(moe, state)
        elif stacked is not None:
            gate_up, down = state.take(moe + stacked[0]), state.take(moe + stacked[1])
            if self.weights_on_input:  # Llama 4's: [E, H, 2I] and [E, I, H] always, as its module declares them
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            elif self.stacked_in_out:  # Qwen3-VL's releases: [E, H, 2I] and [E, I, H]; as saved, [E, 2I, H]
                gate_up, down = _out_in(gate_up, self.experts[0].gate_up_proj), _out_in(down, self.experts[0].down_proj)
            for name, matrices in zip(stacked, (gate_up, down)):
                if matrices.shape[0] != self.num_experts:
                    raise state.error(f"`{moe}{name}` holds {matrices.shape[0]} experts, the config {self.num_experts}")
            for e, expert in enumerate(self.experts):
                state.copy(expert.gate_up_proj.weight, f"{moe}{stacked[0]}[{e}]", gate_up[e])
                state.copy(expert.down_proj.weight, f"{moe}{stacked[1]}[{e}]", down[e])
        else:
            mixtral = state.has(f"{moe}experts.0.w1.weight")
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            for e, expert in enumerate(self.experts):
                load_mlp(expert, f"{moe}experts.{e}.", state, names)
        if self.shared_expert is not None and state.has(prefix + "shared_mlp.input_linear.weight"):
            load_fused_mlp(self.shared_expert, prefix + "shared_mlp.", state)  # Granite's, beside the block
        elif self.shared_expert is not None:
            plural = any(state.has(f"{moe}shared_experts.{n}.weight") for n in ("gate_proj", "gate_up_proj"))
            load_mlp(self.shared_expert, moe + ("shared_experts." if plural else "shared_expert."), state)
        if self.shared_expert_gate is not None:
            state.copy(self.shared_expert_gate.weight, moe + "shared_expert_gate.weight")

    def _load_ungated(self, moe: str, state: WeightReader) -> None:
        """Ungated experts (Nemotron-H's: ``up_proj`` and ``down_proj``), one matrix each
        (``experts.E.up_proj.weight``) or stacked as transformers 5 holds them (``experts.up_proj
        [E, I, H]``, ``experts.down_proj [E, H, I]``), and the shared expert (``shared_experts.``)."""
        if state.has(moe + "experts.up_proj"):
            for name in ("up_proj", "down_proj"):
                matrices = state.take(f"{moe}experts.{name}")
                if matrices.shape[0] != self.num_experts:
                    raise state.error(f"`{moe}experts.{name}` holds {matrices.shape[0]} experts, the config {self.num_experts}")
                for e, expert in enumerate(self.experts):
                    state.copy(getattr(expert, name).weight, f"{moe}experts.{name}[{e}]", matrices[e])
        else:
            for e, expert in enumerate(self.experts):
                expert.load(f"{moe}experts.{e}.", state)
        if self.shared_expert is not None:
            self.shared_expert.load(moe + "shared_experts.", state)

    CHOICE_BIAS_NAMES = ("gate.e_score_correction_bias", "e_score_correction_bias", "moe_statics.e_score_correction_bias",
                         "gate.moe_statics.e_score_correction_bias")
    """Where checkpoints keep the choice bias, under the block's prefix: DeepSeek-V3's, GLM-4.5's and
    dots.llm1's router; MiniMax-M2's block; ERNIE 4.5's ``moe_statics`` (``[1, E]``), as released
    and as transformers 5 holds it."""

    def _load_choice_bias(self, moe: str, state: WeightReader) -> None:
        name = next((moe + n for n in self.CHOICE_BIAS_NAMES if state.has(moe + n)), moe + self.CHOICE_BIAS_NAMES[0])
        value = state.take(name)
        state.copy(self.choice_bias, name, value.reshape(-1) if value.dim() == 2 and value.shape[0] == 1 else value)

    def _load_gpt_oss(self, moe: str, state: WeightReader) -> None:
        """gpt-oss's experts, stacked with biases: as its released checkpoints hold them, in MXFP4
        (``experts.gate_up_proj_blocks`` and ``_scales``, ``[E, out, in]`` once decoded), or as
        transformers holds them (``experts.gate_up_proj [E, in, out]``). Their gate and up
        outputs alternate (gate, up, gate, ...): they become our gate rows, then up rows. One
        expert is decoded at a time."""
        mxfp4 = state.has(moe + "experts.gate_up_proj_blocks")
        stacked = {}
        for name in ("gate_up_proj", "down_proj"):
            key = f"{moe}experts.{name}"
            stacked[name] = (state.take(key + "_blocks"), state.take(key + "_scales")) if mxfp4 else state.take(key)
            count = stacked[name][0].shape[0] if mxfp4 else stacked[name].shape[0]
            if count != self.num_experts:
                raise state.error(f"`{moe}experts` holds {count} experts, the config {self.num_experts}")
        gate_up_bias, down_bias = state.take(moe + "experts.gate_up_proj_bias"), state.take(moe + "experts.down_proj_bias")

        def matrix(name: str, e: int) -> torch.Tensor:  # expert e's [out, in]
            if mxfp4:
                blocks, scales = stacked[name]
                return dequantize_mxfp4(blocks[e], scales[e], self.gate.weight.dtype)
            return stacked[name][e].T

        def ungate(t: torch.Tensor) -> torch.Tensor:  # alternating gate / up rows: gate rows, then up rows
            return torch.cat((t[0::2], t[1::2]))

        for e, expert in enumerate(self.experts):
            state.copy(expert.gate_up_proj.weight, f"{moe}experts.gate_up_proj[{e}]", ungate(matrix("gate_up_proj", e)))
            state.copy(expert.gate_up_proj.bias, f"{moe}experts.gate_up_proj_bias[{e}]", ungate(gate_up_bias[e]))
            state.copy(expert.down_proj.weight, f"{moe}experts.down_proj[{e}]", matrix("down_proj", e))
            state.copy(expert.down_proj.bias, f"{moe}experts.down_proj_bias[{e}]", down_bias[e])
