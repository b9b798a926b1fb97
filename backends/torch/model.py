"""Llama-family decoder (Llama 2/3/4, SmolLM 2/3, Granite 3, OLMo 2/3, GLM-4, Qwen2, Qwen3, Mistral,
Ministral and Ministral 3, ERNIE 4.5, EXAONE 4, Seed-OSS, Phi-3, Cohere's Command models, Hunyuan,
Apertus, Arcee, InternLM3, Helium, Gemma 1/2/3/4, VaultGemma, the LayerNorm families Jais 2, StarCoder2,
Nemotron, StableLM 2, Phi-2, GPT-NeoX, GPT-J, Falcon, GPT-2, GPTBigCode, OPT and OLMo 1, with ALiBi BLOOM, MPT and
Falcon-RW, and the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, Granite 3's, GLM-4.5, Solar Open, dots.llm1, ERNIE 4.5's and MiniMax-M2, and with multi-head latent attention
(:mod:`.latent`) DeepSeek-V2, V3, GLM-4.7-Flash, Mistral 4 and Youtu-LLM; LFM2 with short convolutions (:mod:`.conv`);
Qwen3-Next, Qwen3.5 and OLMo Hybrid with Gated DeltaNet linear attention (:mod:`.delta`); Granite 4's hybrids, Bamba and
Nemotron-H with Mamba2 layers (:mod:`.mamba`), Falcon-H1 with a Mamba2 mixer beside every attention) as plain
torch modules.

RMSNorm, rotary embeddings with the config's scaling (linear, dynamic NTK, Llama 3, YaRN,
LongRoPE) on all or the first part of each head (``partial_rotary_factor``), grouped-query
attention over the paged KV cache (sliding windows on all or some layers), Qwen3's per-head
query and key norms, SwiGLU (or a mixture of SwiGLU experts: :mod:`.moe`), tied or untied
embeddings. Gemma's differences are flags of :class:`ModelSpec`: GeGLU (tanh GELU), norms that
scale by ``1 + weight``, embeddings scaled by sqrt(hidden size), Gemma 2/3's norms around each
block's output as well as its input, a query scale of its own, tanh soft caps on attention
scores and logits (Gemma 2), and Gemma 3's second rotary base for its sliding-window layers.
gpt-oss's are too: attention sinks (a learned logit per head in every softmax), and a mixture
of experts routed by the softmax of its top-k logits, experts with biases and a clamped SwiGLU.
SmolLM3's layers without rotary (NoPE), Granite's multipliers (embeddings, attention scores,
each block's output, logits), OLMo 2/3's norms (of each block's output only, and of the
whole query and key projections), GLM's interleaved rotary pairs, Ministral 3's
position-scaled queries and Llama 4's chunked attention, weightless query and key norms and NoPE
temperature are flags too, as are the older families' LayerNorms with biases, ungated GELU or
squared-ReLU MLPs and parallel attention and MLP blocks (Cohere's, StableLM 2 12B's, Phi's, GPT-NeoX's,
Falcon's).
Every forward pass works on a flat batch of tokens from many sequences at once (continuous
batching); :mod:`.attention` knows which tokens belong to whom.
Numerics follow Hugging Face's implementation so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, apply_rotary, only_rows, paged_attention
from .conv import ShortConv
from .delta import DeltaShape, GatedDeltaNet
from .mamba import Mamba2Mixer, MambaShape
from .latent import LATENT_NORM_EPS, LatentAttention, LatentShape, latent_scale
from .moe import SparseMoE
from .weights import RowScales, WeightReader, load_fused_mlp, load_mlp


class ModelError(ValueError):
    """The checkpoint is not a decoder this engine can run."""


RELU2 = {"relu2": "relu2"}
GELUS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_new", "gelu": "gelu"}
"""Ungated MLPs' GELUs, config's name -> ours: the tanh form (StarCoder2's; Phi's ``gelu_new``, the
same formula step by step, as transformers computes it) and the exact one (GPT-NeoX's)."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a checkpoint, from its Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    o_bias: bool = False  # Llama/Mistral's attention_bias also puts a bias on o_proj (Qwen2's does not)
    # The layers that attend within sliding_window; None: all of them (Mistral). Qwen2 and Qwen3
    # slide only from max_window_layers on (their config's layer_types).
    sliding_layers: tuple[int, ...] | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before rotary
    # partial_rotary_factor (Phi-4-mini): only the first rotary_dim dimensions of each query and
    # key head rotate, the rest pass; None: all of them.
    rotary_dim: int | None = None
    # GLM: rotary pairs are adjacent dimensions (2i, 2i + 1), not i and i + rotary_dim / 2.
    interleaved_rotary: bool = False
    # Ministral 3 (llama_4_scaling_beta): rotated queries times 1 + beta ln(1 + floor(position /
    # original)), (beta, original); 1 within the original context. None: not scaled.
    query_position_scaling: tuple[float, int] | None = None
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); 0 experts: a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0  # one expert's intermediate size (Qwen: moe_intermediate_size)
    normalize_routing: bool = False  # the chosen experts' weights renormalised to sum to 1
    float_routing_weights: bool = False  # Mixtral: the weights stay float32 (the Qwens: the model's dtype)
    # Qwen2-MoE: an expert every token runs through, gated by a sigmoid; GLM-4.5's, dots.llm1's
    # and ERNIE 4.5's shared experts (one MLP of their summed size) are added ungated.
    shared_expert_size: int = 0
    shared_expert_gated: bool = True
    # Llama 4: each chosen expert reads the token times its weight (sigmoid(logit)), and the
    # experts' outputs are summed unweighted.
    weights_on_input: bool = False
    # DeepSeek-V3's routing, as GLM-4.5, dots.llm1, MiniMax-M2 and ERNIE 4.5 route: scores are the
    # router logits' sigmoids (ERNIE: their softmax); a learned bias (e_score_correction_bias) is
    # added to them to choose the experts, whose weights are the unbiased scores; with
    # (n_group, topk_group) the choice is among the topk_group groups whose two best biased
    # scores sum highest; the weights times routed_scaling_factor. The router's weights and
    # logits are float32 whatever the model's dtype (float_router), as transformers keeps them.
    sigmoid_routing: bool = False
    routing_bias: bool = False
    expert_groups: tuple[int, int] | None = None
    groups_by_best: bool = False  # DeepSeek-V2: a group scores its best expert's score, not its two best summed
    routed_scale: float | None = None
    float_router: bool = False
    # LFM2-MoE: the sigmoid scores, their renormalisation (by the sum plus renorm_eps, 1e-6) and
    # scaling in the router's dtype, the choice bias float32, as transformers computes them;
    # Mistral 4: its softmax scores so.
    scores_in_model_dtype: bool = False
    renorm_eps: float = 0.0
    # Layers of a MoE model with a plain MLP of intermediate_size instead (Qwen's mlp_only_layers
    # and decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()
    # Qwen3-VL's releases stack their experts' matrices as [E, in, out] (transformers transposes
    # them as it loads, and saves them [E, out, in]); told apart by their shapes.
    stacked_in_out: bool = False
    # Gemma. The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, GELU's tanh form).
    activation: str = "silu"
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size); Granite: embedding_multiplier)
    embed_scale_rounded: bool = False  # Gemma: the factor is rounded to the model's dtype first, as transformers does
    offset_norms: bool = False  # every RMSNorm scales by 1 + weight, in float32, rounded once after
    # Gemma 2/3, GLM-4 (and OLMo 2/3, without input norms): the attention's and the MLP's outputs
    # are normalised before the residual adds.
    sandwich_norms: bool = False
    input_norms: bool = True  # False: blocks take the residual as it is (OLMo 2/3, whose outputs are normalised)
    glm_norm_names: bool = False  # GLM-4 names its output norms post_self_attn_ / post_mlp_layernorm
    qk_norm_whole: bool = False  # OLMo 2/3, OLMoE: qk_norm spans each projection's heads together, not one head
    float_rotary: bool = False  # OLMo 1/2/3: queries and keys rotate in float32, rounded once (tables not cast)
    query_scale: float | None = None  # attention scores' scale (query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores become cap * tanh(score / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    # Gemma 3: the sliding-window layers rotate with a base (and scaling) of their own.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # max_position_embeddings already counts the rope scaling's stretch (Gemma 3, as vLLM reads it).
    scaled_max_position: bool = False
    float_norms: bool = False  # norms multiply by their weight in float32, rounded once (gpt-oss; Gemma's too)
    # gpt-oss: a learned logit per query head joins every softmax of its attention (the "sink").
    attention_sinks: bool = False
    # gpt-oss's mixture of experts: the router has a bias and softmaxes its top-k logits only
    # (Granite-MoE's too, without the bias); experts have biases and a clamped SwiGLU, (alpha, limit).
    router_bias: bool = False
    softmax_top_k: bool = False
    expert_bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None
    # SmolLM3: the layers whose queries and keys do not rotate (its no_rope_layers' zeros, "NoPE").
    nope_layers: tuple[int, ...] = ()
    # Granite: each block's output is multiplied by this before its residual add
    # (residual_multiplier), and the logits are divided by logits_scaling; None: neither.
    residual_scale: float | None = None
    logits_scaling: float | None = None
    # FP8 checkpoints (quantization_config quant_method "fp8": DeepSeek-V3's, Qwen3's and
    # Mistral's FP8 releases): float8 weights with their weight_scale_inv, decoded when loaded;
    # the scales' block (rows, columns), or None for one scale a tensor.
    fp8_weights: bool = False
    fp8_block: tuple[int, int] | None = None
    # Cohere (Command R, R7B, A): norms subtract the mean first (a LayerNorm without bias, its
    # weight applied in float32, rounded once); the attention and the MLP read the same normed
    # input and both add to the residual (parallel blocks); the logits are multiplied by
    # logit_scale; queries and keys rotate in float32 from tables rounded to the model's dtype;
    # Command R+'s query and key norms have a weight per head (qk_norm_per_head).
    centered_norms: bool = False
    norm_bias: bool = False  # the LayerNorm families (LAYER_NORMED) but OLMo 1: LayerNorms (centred) with a bias
    # OLMo 1: its norms (LayerNorms) have neither weight nor bias; its q, k and v are clamped to
    # within clip_qkv (None: not clamped).
    weightless_norms: bool = False
    clip_qkv: float | None = None
    # Nemotron (LayerNorm1P): its norms' weights are stored less one; one is added back in the
    # model's dtype as they load (transformers' weight + 1.0).
    norms_less_one: bool = False
    parallel_blocks: bool = False
    # Phi, GPT-J, GPT-NeoX, Falcon: the parallel blocks' outputs are summed first, then added to the residual
    # (Cohere's and StableLM's join it one after the other); GPT-NeoX's MLP reads a norm of its
    # own (post_attention_layernorm) of the same input.
    parallel_residual_last: bool = False
    parallel_mlp_norm: bool = False
    lm_head_bias: bool = False  # Phi, GPT-J: the LM head has a bias
    # GPT-2, GPTBigCode, OPT: a table of max_position learned position embeddings added to the tokens'
    # (every layer in nope_layers).
    learned_positions: bool = False
    position_table_offset: int = 0  # OPT: the table's first rows, which no position reads (2)
    # BLOOM, MPT, Falcon-RW: no positions in the embeddings nor a rotary (every layer in
    # nope_layers); each head's scaled scores get slope * (key position - query position) added
    # (ALiBi, arXiv 2108.12409), in float32 before the softmax: its slopes, one a query head.
    alibi: tuple[float, ...] = ()
    embedding_norm: bool = False  # BLOOM: its embeddings LayerNormed before the first layer
    # OPT: the queries times the attention scale as they leave their projection, rounded to the
    # model's dtype there, the scores then unscaled (transformers' order: head sizes whose scale
    # is no power of two, 80 and 128, round otherwise in bfloat16).
    prescaled_queries: bool = False
    # Every MLP ungated, down(act(up(x))): Nemotron-H, Arcee, Jais 2 and Nemotron (squared ReLU),
    # StarCoder2, Phi, GPT-NeoX, GPT-J, Falcon, GPT-2 and GPTBigCode (GELU), OPT (ReLU), Apertus
    # (xIELU, XieluMLP).
    ungated_mlp: bool = False
    logit_scale: float | None = None
    rounded_rotary_tables: bool = False
    qk_norm_per_head: bool = False
    # Hunyuan: the per-head query and key norms come after the rotary, not before it.
    qk_norm_after_rotary: bool = False
    # Llama 4 (use_qk_norm): its rotating layers' queries and keys, once rotated, normalised per
    # head without weight; its NoPE layers' not at all.
    weightless_qk_norm: bool = False
    # Llama 4's attn_temperature_tuning, (attn_scale, floor_scale): its NoPE layers' queries times
    # 1 + attn_scale * ln(1 + floor((position + 1) / floor_scale)), in float32.
    nope_temperature: tuple[float, int] | None = None
    # Llama 4: the sliding layers attend within fixed chunks of sliding_window positions
    # (attention_chunk_size: position p to the keys from p - p % window to p), not to the last
    # sliding_window.
    chunked_windows: bool = False
    # LFM2: the layers that are short convolutions (:mod:`.conv`) instead of attention, their
    # filters' taps (conv_L_cache) and whether they have biases (conv_bias).
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    conv_bias: bool = False
    # DeepSeek-V2/V3's and GLM-4.7-Flash's multi-head latent attention (:mod:`.latent`); its
    # head_dim is the rotated part's (the rotary tables'), its scores' scale query_scale.
    latent: LatentShape | None = None
    # Qwen3-Next and Qwen3.5: the layers that are Gated DeltaNet linear attention (:mod:`.delta`,
    # a state per sequence instead of keys and values per token) and their sizes; the other
    # layers' queries carry an output gate per head (gated_attention: out * sigmoid(gate)).
    linear_layers: tuple[int, ...] = ()
    delta: DeltaShape | None = None
    gated_attention: bool = False
    # LFM3: a sigmoid gate per query head from a projection of its own (g_proj; its releases'
    # gate_proj), each head's output times it.
    head_gates: bool = False
    # OLMo Hybrid: its linear-attention layers normalise each block's input (Llama's), its attention
    # layers each block's output (OLMo's, input_norms False and sandwich_norms).
    prenorm_linear_layers: bool = False
    # Granite 4's hybrids, Bamba, Nemotron-H and Falcon-H1: their linear_layers are Mamba2 layers
    # (:mod:`.mamba`) of this shape.
    mamba: MambaShape | None = None
    # Nemotron-H: each layer is one block of one kind, "mamba", "attention", "mlp" (ungated,
    # squared ReLU) or "moe", its input normed, its output added to the residual; empty: every
    # layer is attention (or its stand-in) then an MLP.
    block_kinds: tuple[str, ...] = ()
    # Falcon-H1: every layer runs a Mamba2 mixer (of the shape ``mamba``) beside its attention,
    # on the same normed input, the two outputs summed; its linear_layers (every layer) keep
    # keys and values too.
    parallel_mamba: bool = False
    # Factors folded into weights as they load (Falcon-H1's muP multipliers, which transformers
    # applies to activations): a weight's name within its layer -> its rows' factors
    # (weights.scaled_rows).
    weight_scales: tuple[tuple[str, RowScales], ...] = ()
    # Gemma 4: its full-attention layers' heads are of full_head_dim with full_kv_heads key and
    # value heads (global_head_dim, num_global_key_value_heads), its sliding layers' head_dim and
    # num_kv_heads; None: every layer's the same.
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    # Gemma 4: values normalised per head (an RMSNorm without weight); attention_k_eq_v: its full
    # layers' values are their keys' projection (before the key norm); each layer's output
    # times a scalar of its own (layer_scalar).
    value_norms: bool = False
    values_from_keys: bool = False
    layer_scalars: bool = False
    # Gemma 4's experts (26B-A4B) run beside each layer's MLP, with norms of their own; their router
    # reads the residual RMS-normalised (no weight) times a learned scale and hidden_size ** -0.5,
    # and the chosen weights are multiplied by each expert's learned scale (scaled_router).
    experts_beside_mlp: bool = False
    scaled_router: bool = False
    # Gemma 4 E2B and E4B: per-layer embeddings of per_layer_input_size per layer (a table of
    # per_layer_vocab tokens, plus a projection of the embeddings), each layer's gated into its
    # output; the layers kv_sources names (layer, source) read an earlier layer's keys and values
    # from its cache and keep none (num_kv_shared_layers), their MLPs twice as wide where
    # use_double_wide_mlp (wide_mlp_layers).
    per_layer_input_size: int = 0
    per_layer_vocab: int = 0
    kv_sources: tuple[tuple[int, int], ...] = ()
    wide_mlp_layers: tuple[int, ...] = ()

    SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                 "gemma", "gemma2", "gemma3_text", "gemma3", "gpt_oss", "smollm3", "granite", "granitemoe", "olmo2",
                 "olmo3", "olmoe", "glm", "glm4", "ministral", "ministral3", "mistral3", "glm4_moe", "dots1",
                 "ernie4_5", "ernie4_5_moe", "minimax_m2", "seed_oss", "exaone4", "granitemoeshared",
                 "granitemoehybrid", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "cohere", "cohere2", "lfm2", "lfm2_moe", "lfm3",
                 "granite_swa", "granitemoe_swa", "olmo_hybrid",
                 "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "hunyuan_v1_dense", "apertus",
                 "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h", "bamba",
                 "falcon_h1", "gemma4_text", "gemma4", "llama4_text", "llama4", "mistral4", "arcee", "internlm3",
                 "vaultgemma", "youtu", "solar_open", "helium", "hunyuan_v1_moe", "exaone_moe", "jais2",
                 "starcoder2", "nemotron", "stablelm", "phi", "gpt_neox", "falcon", "gptj", "gpt2", "gpt_bigcode", "olmo",
                 "opt", "bloom", "mpt")
    IMAGE_TEXT = ("gemma3", "gemma4", "llama4", "mistral3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "qwen3_5",
                  "qwen3_5_moe")
    """Image-text checkpoints whose language model (``text_config``) is served, images not taken."""
    TEXT_MODELS = {"qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe",
                   "glm4v_text": "glm4", "glm4v_moe_text": "glm4_moe"}
    """Image-text checkpoints' language models that are one of ours by another name: Qwen2.5-VL's,
    Qwen3-VL's (dense and experts) and GLM-4.1V's and 4.5V's, whose multimodal rotary
    (``mrope_section``) turns every section by the same position on text, which is the plain
    rotary. Their outer configs say whether the embeddings are tied."""
    GEMMA = ("gemma", "gemma2", "gemma3_text", "gemma4_text", "vaultgemma")
    ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    """The gated MLPs' activations: the config's name -> ours."""
    OWN_ACTIVATIONS = {"apertus": {"xielu": "xielu"}, **dict.fromkeys(("nemotron_h", "arcee", "jais2", "nemotron"), RELU2),
                       **dict.fromkeys(("starcoder2", "phi", "gpt_neox", "falcon", "gptj", "gpt2", "gpt_bigcode"), GELUS),
                       "opt": {"relu": "relu", **GELUS}, "bloom": {"bloom_gelu": "bloom_gelu"}, "mpt": {"gelu": "gelu"}}
    """The model types whose MLPs are ungated, and the activations each may have (no other)."""
    ROPE_SCALINGS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")

    LATENT = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "mistral4", "youtu")
    """Model types whose attention is multi-head latent attention."""
    GATED_DELTA = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
    """Model types with Gated DeltaNet layers beside gated attention (Qwen3-Next, Qwen3.5's
    language models); every norm scales by ``1 + weight``."""
    OUTER_TIE = (*TEXT_MODELS, "qwen3_5_text", "qwen3_5_moe_text")
    """Language models whose image-text config says whether the embeddings are tied."""

    def kv_entry(self, layer: int) -> dict[str, int | None]:
        """What one token keeps in ``layer``'s cache, as :class:`.kv_cache.KVCache` takes it:
        keys and values of ``kv_heads`` heads of ``head_dim``; under latent attention one head
        of the latent and the rotated key, the values its first ``values_in_keys`` dimensions;
        a short convolution's input, one head of ``hidden_size`` (no values); nothing for a
        linear-attention layer."""
        if layer in self.conv_layers:
            return dict(kv_heads=1, head_dim=self.hidden_size, values_in_keys=0)
        if self.kv_source(layer) != layer:  # Gemma 4's shared layers: an earlier layer's cache
            return dict(kv_heads=0, head_dim=0, values_in_keys=None)
        if (layer in self.linear_layers and not self.parallel_mamba) or (
                self.block_kinds and self.block_kinds[layer] != "attention"):
            # nothing a token: the layer's state is the sequence's (state.py), or it is an MLP block
            return dict(kv_heads=0, head_dim=0, values_in_keys=None)
        if self.latent is not None:
            return dict(kv_heads=1, head_dim=self.latent.cache_dim, values_in_keys=self.latent.kv_rank)
        return dict(kv_heads=self.kv_heads_of(layer), head_dim=self.head_dim_of(layer), values_in_keys=None)

    def kv_source(self, layer: int) -> int:
        """The layer whose cached keys and values ``layer`` attends to: itself, or for Gemma 4's
        shared layers the last earlier layer of its kind that keeps its own."""
        return dict(self.kv_sources).get(layer, layer)

    @property
    def cacheless_from(self) -> int | None:
        """The first of the last layers that keep no keys and values of their own (Gemma 4's
        shared layers): from there on only the rows whose logits are wanted matter; None where
        the last layer keeps its own."""
        shared = {layer for layer, _ in self.kv_sources}
        first = self.num_layers
        while first - 1 in shared:
            first -= 1
        return first if first < self.num_layers else None

    def intermediate_of(self, layer: int) -> int:
        """The width of ``layer``'s MLP (Gemma 4's shared layers: twice it with use_double_wide_mlp)."""
        return 2 * self.intermediate_size if layer in self.wide_mlp_layers else self.intermediate_size

    def _full_heads(self, layer: int) -> bool:
        return self.full_head_dim is not None and self.window_of(layer) is None

    def head_dim_of(self, layer: int) -> int:
        """The size of ``layer``'s attention heads (Gemma 4's full layers': ``full_head_dim``)."""
        return self.full_head_dim if self._full_heads(layer) else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """How many key and value heads ``layer``'s attention has (Gemma 4's full layers':
        ``full_kv_heads``)."""
        return self.full_kv_heads if self._full_heads(layer) else self.num_kv_heads

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a state per sequence (:mod:`.state`)."""
        return bool(self.linear_layers)

    @property
    def recurrence(self) -> DeltaShape | MambaShape | None:
        """The shape of the layers that keep a state per sequence (its ``conv_size``, ``kernel``
        and ``state_shape``); None where none does."""
        return self.delta or self.mamba if self.linear_layers else None

    @property
    def is_moe(self) -> bool:
        """Whether some layer is a mixture of experts."""
        return any(self.is_sparse(i) for i in range(self.num_layers))

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward block is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def float16_overflows(self) -> bool:
        """Gemma 2, 3 and 4: activations outgrow float16's range (vLLM refuses float16 for them too)."""
        return self.sandwich_norms and self.embed_scale_rounded

    @property
    def attention_scale(self) -> float:
        """The factor on query-key dot products."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def full_rope(self) -> "ModelSpec":
        """The spec the full-attention layers' rotary tables come from: this one, its heads
        Gemma 4's full layers' size where they differ."""
        return self if self.full_head_dim is None else replace(self, head_dim=self.full_head_dim)

    def local_rope(self) -> "ModelSpec | None":
        """The spec the sliding-window layers' rotary tables come from (Gemma 3); None where
        every layer rotates alike."""
        if self.local_rope_theta is None:
            return None
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling,
                       local_rope_theta=None, local_rope_scaling=None)

    @property
    def rotated(self) -> int:
        """How many dimensions of each query and key head rotate."""
        return self.rotary_dim or self.head_dim

    @property
    def context_length(self) -> int:
        """The longest context the rotary embedding serves, as vLLM derives it: linear and dynamic
        scaling stretch ``max_position_embeddings`` by their factor, YaRN the original length by
        its factor; Llama 3, LongRoPE and Gemma 3 configs already give the stretched length."""
        if self.scaled_max_position:
            return self.max_position
        scaling = self.rope_scaling or {}
        kind, factor = scaling.get("rope_type", "default"), scaling.get("factor")
        if kind in ("linear", "dynamic") and factor:
            return max(self.max_position, int(self.max_position * float(factor)))
        if kind == "yarn" and factor:
            return max(self.max_position, int(scaling["original_max_position_embeddings"] * float(factor)))
        return self.max_position

    def qk_layout(self) -> torch.Tensor | None:
        """Where each dimension of a query or key head sits here, as indices into Hugging Face's
        order; None where every dimension rotates in pairs half a head apart (the orders agree).

        The rotary step (here and in the C kernels) pairs dimension ``j`` with ``j + head_dim/2``.
        Hugging Face rotates the first ``rotary_dim`` with pairs ``rotary_dim/2`` apart (GLM:
        adjacent, ``2i`` and ``2i + 1``) and passes the rest, so the loader moves each pair's
        first and second dimensions to the front of each half of the head and the passed ones
        after them. Queries and keys move alike: their dot products, and so the attention, are
        what they were."""
        if self.rotary_dim is None and not self.interleaved_rotary:
            return None
        rot = self.rotated
        a, half = rot // 2, self.head_dim // 2
        rest = half - a  # passed dimensions in each half of the head
        if self.interleaved_rotary:
            first, second = torch.arange(0, rot, 2), torch.arange(1, rot, 2)
        else:
            first, second = torch.arange(a), torch.arange(a, rot)
        return torch.cat((first, rot + torch.arange(rest), second, rot + rest + torch.arange(rest)))

    def qkv_row_order(self) -> torch.Tensor | None:
        """:meth:`qk_layout` over the fused q, k, v output rows (v untouched); None: identity."""
        layout = self.qk_layout()
        if layout is None:
            return None
        heads = torch.arange(self.num_heads + self.num_kv_heads)[:, None] * self.head_dim
        qk = (heads + layout).flatten()
        return torch.cat((qk, torch.arange(qk.numel(), qk.numel() + self.num_kv_heads * self.head_dim)))

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention; None for full attention."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def mask_kinds(self) -> tuple[bool, bool]:
        """Whether some layer attends to every earlier position, and whether some attends within
        the sliding window: which masks a step needs."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return None in windows, bool(windows - {None})

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelSpec":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in cls.SUPPORTED:
            raise ModelError(f"model_type `{model_type}` is not supported; supported: {', '.join(cls.SUPPORTED)}")
        quantization = _quantization(cfg, model_type)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if model_type in cls.IMAGE_TEXT:  # Gemma 3 from 4B up, Mistral Small 3.1+, Qwen-VL: their language model
            outer, cfg = model_type, cfg.text_config
            model_type = cls.TEXT_MODELS.get(cfg.model_type, cfg.model_type)
            if model_type not in cls.SUPPORTED or model_type in cls.IMAGE_TEXT:
                raise ModelError(f"the language model of a `{outer}` checkpoint is a `{cfg.model_type}`, which is not supported")
            # Qwen-VL and GLM-4V say whether their embeddings are tied on the outer config (for
            # Qwen2.5-VL and GLM-4V transformers 5 moves an older text_config's flag there); the
            # others on their language model's.
            tied = tied if cfg.model_type in cls.OUTER_TIE else bool(getattr(cfg, "tie_word_embeddings", False))
        gemma = model_type in cls.GEMMA
        if model_type == "gemma4_text" and hasattr(cfg, "to_dict"):  # as saved: transformers refuses head_dim off a
            cfg = SimpleNamespace(**cfg.to_dict())  # config whose layers differ in it
        gemma4 = _gemma4_fields(cfg) if model_type == "gemma4_text" else {}
        if getattr(cfg, "use_bidirectional_attention", False) and not (gemma4 and cfg.use_bidirectional_attention == "vision"):
            raise ModelError("use_bidirectional_attention: an encoder (EmbeddingGemma) is not a decoder this engine runs")
        act = (getattr(cfg, "hidden_activation", None) if gemma else None) or FIXED_ACTS.get(model_type) or getattr(
            cfg, ACT_NAMES.get(model_type, "hidden_act"), "silu")
        if gemma and act == "gelu":
            act = "gelu_pytorch_tanh"  # Gemma's first releases say "gelu" and mean the tanh form, as transformers reads it
        activations = cls.OWN_ACTIVATIONS.get(model_type, cls.ACTIVATIONS)
        if act not in activations:
            ungated = f" (`{model_type}`'s MLPs are ungated)" if model_type in cls.OWN_ACTIVATIONS else ""
            raise ModelError(f"hidden_act `{act}` is not supported; supported: {', '.join(activations)}{ungated}")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or (
            getattr(cfg, "attention_head_dim", None) if model_type in HUNYUAN else None) or cfg.hidden_size // heads
        latent = LatentShape.of(cfg, ModelError) if model_type in cls.LATENT else None
        if latent is not None:  # the rotary tables' heads: the rotated part
            head_dim = latent.rope
        # transformers 5 keeps rope settings in rope_parameters (rope_scaling reads the same);
        # 4.x in rope_theta / rope_scaling. Gemma 3's are per layer type in transformers 5.
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        local = None
        if "full_attention" in rope or "sliding_attention" in rope:
            local, rope = dict(rope.get("sliding_attention") or {}), dict(rope.get("full_attention") or {})
        elif model_type == "gemma3_text":
            local = {"rope_theta": getattr(cfg, "rope_local_base_freq", 10000.0)}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if model_type in HUNYUAN and rope.get("alpha") and rope.get("rope_type", rope.get("type")) == "dynamic":
            # Hunyuan's "dynamic" with an alpha is a fixed NTK stretch of the base, as transformers
            # reads it: theta * alpha ** (d / (d - 2)), whatever the sequence's length.
            theta, rope = float(theta) * float(rope["alpha"]) ** (head_dim / (head_dim - 2)), {}
        scaling = _rope_scaling(rope, cfg)
        if local is None and model_type == "olmo3" and scaling is not None:
            # A flat rope_scaling (transformers 4's form) is the full layers' alone: OLMo 3's
            # sliding layers rotate unscaled, as transformers 5 splits such a config.
            local = {"rope_theta": theta}
        local_scaling = _rope_scaling(local, cfg) if local is not None else None
        partial = (scaling or {}).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
        if model_type == "gptj" and getattr(cfg, "rotary_dim", None):  # its rotated dimensions by number (below)
            partial = cfg.rotary_dim / head_dim
        if model_type == "mistral4" and latent is not None and partial is not None and math.isclose(
                float(partial), latent.rope / (latent.rope + latent.nope)):
            partial = None  # its rope parameters say which part of a query head rotates: the latent's rotated part
        if (scaling or {}).get("rope_type") == "proportional" or model_type in ("lfm2", "lfm2_moe", "lfm3"):
            partial = None  # proportional: its factor zeroes frequencies (rope_inv_freq); LFM's rotate whole heads
        rotary_dim = None
        if partial is not None and float(partial) != 1.0 and latent is not None:
            raise ModelError(f"partial_rotary_factor {partial}: latent attention rotates qk_rope_head_dim's dimensions")
        if partial is not None and float(partial) != 1.0:
            # as transformers rounds it; GPT-J's as its config gives it
            rotary_dim = cfg.rotary_dim if model_type == "gptj" else int(head_dim * float(partial))
            if not 2 <= rotary_dim < head_dim or rotary_dim % 2:
                raise ModelError(
                    f"partial_rotary_factor {partial} rotates {rotary_dim} of the {head_dim} dimensions of a head; "
                    "it must rotate an even number of them, at least 2"
                )
        for each in (scaling, local_scaling):
            if each and each["rope_type"] == "longrope":
                pairs = (rotary_dim or head_dim) // 2
                for key in ("short_factor", "long_factor"):
                    got = each.get(key)
                    if not isinstance(got, (list, tuple)) or len(got) != pairs:
                        raise ModelError(f"rope scaling `longrope` needs `{key}`: a list of {pairs} numbers, one per rotated pair")
        window, sliding_layers = _sliding_window(cfg, model_type)
        swa_nope: tuple[int, ...] = ()
        if model_type in GRANITE_SWA:  # its layer_rope_theta: the full and the sliding layers' bases, 0 for none
            theta, local, swa_nope = _granite_swa_thetas(cfg, sliding_layers or (), float(theta))
            local_scaling = scaling if local is not None else None
        glm = model_type in ("glm", "glm4")
        ernie = model_type in ("ernie4_5", "ernie4_5_moe")
        use_bias = ernie and bool(getattr(cfg, "use_bias", False))  # ERNIE's one switch for every projection
        # Gemma's keys, read for Gemma only (transformers ignores them elsewhere).
        softcaps = {
            key: getattr(cfg, key, None) if gemma else None for key in ("attn_logit_softcapping", "final_logit_softcapping")
        }
        for key, cap in softcaps.items():
            if cap is not None and not cap > 0:
                raise ModelError(f"{key} {cap} must be a positive number")
        granite = _granite_multipliers(cfg) if model_type in GRANITES else {}
        granite4 = model_type == "granitemoehybrid"
        if granite4 or model_type == "bamba":  # Bamba: Granite 4's hybrids' forerunner, the same Mamba2 layers
            mamba = _granite4_layers(cfg)
        elif model_type == "falcon_h1":
            mamba = _falcon_h1_fields(cfg)
        else:
            mamba = _nemotron_blocks(cfg) if model_type == "nemotron_h" else {}
        falcon = model_type == "falcon_h1"
        olmo = model_type in ("olmo2", "olmo3", "olmo_hybrid")  # OLMo Hybrid: its attention layers'
        exaone = model_type == "exaone4"  # OLMo 2's output norms (in the model's dtype), per-head q/k norms
        if getattr(cfg, "clip_qkv", None) is not None and model_type != "olmo":  # OLMoE's option, after its
            # query and key norms (its releases leave it off); OLMo 1's clamps the projections (_layer_normed_fields)
            raise ModelError(f"clip_qkv {cfg.clip_qkv}: clamping queries, keys and values is not supported "
                             f"for model_type `{model_type}` (OLMo 1's is)")
        whole_qk_norms = olmo or model_type in ("olmoe", "minimax_m2")
        if whole_qk_norms and rotary_dim is not None and model_type != "minimax_m2":
            # transformers rotates OLMo's whole heads, whatever such a key says
            raise ModelError(f"partial_rotary_factor is not supported for model_type `{model_type}`")
        cohere = model_type in ("cohere", "cohere2")
        lfm2 = _lfm2_fields(cfg) if model_type in ("lfm2", "lfm2_moe", "lfm3") else {}
        lfm3 = model_type == "lfm3"
        if lfm3 and not getattr(cfg, "use_sandwich_norm", True):  # its releases have them; the names differ without
            raise ModelError("use_sandwich_norm false: LFM3 without its output norms is not supported")
        if lfm3 and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) and not getattr(cfg, "sliding_window", None):
            # its sliding layers would attend to everything yet rotate as sliding ones: none of its releases
            raise ModelError("sliding_window null: LFM3's sliding_attention layers need a window")
        # LFM2's adjusted width; Solar Open has none (experts on every layer)
        intermediate = lfm2.pop("intermediate_size", None) or getattr(cfg, "intermediate_size", 0)
        llama4 = _llama4_fields(cfg) if model_type == "llama4_text" else {}
        if llama4:  # its dense layers' MLPs (intermediate_size: each expert's)
            intermediate = cfg.intermediate_size_mlp
        cohere_qk_norms = model_type == "cohere" and bool(getattr(cfg, "use_qk_norm", False))
        gated_delta = _gated_delta_fields(cfg) if model_type in cls.GATED_DELTA else {}
        if model_type == "olmo_hybrid":
            gated_delta = _olmo_hybrid_fields(cfg)
        qk_norms = model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text", "dots1", "exaone4", "lfm2", "lfm2_moe", "lfm3",
                                  "apertus", "exaone_moe", *HUNYUAN, *cls.GATED_DELTA) or whole_qk_norms or (
            model_type == "glm4_moe" and bool(getattr(cfg, "use_qk_norm", False))) or cohere_qk_norms
        query_scale = granite.get("attention_multiplier")
        if gemma and getattr(cfg, "query_pre_attn_scalar", None):
            query_scale = cfg.query_pre_attn_scalar**-0.5
        if gemma4:  # its query and key norms set the scores' scale: none after them
            query_scale = 1.0
        if latent is not None:
            query_scale = latent_scale(latent, scaling)
        # DeepSeek-V2 rotates adjacent pairs as complex numbers, in float32; V3 and GLM-4.7-Flash
        # adjacent pairs (rope_interleave) in the model's dtype.
        deepseek_v2 = model_type == "deepseek_v2"
        interleaved = glm or ernie or deepseek_v2 or cohere or bool(llama4) or model_type in ("helium", "gptj") or (
            latent is not None and bool(getattr(cfg, "rope_interleave", True)))
        spec = cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            # Granite 4's dense models: the shared MLP alone
            intermediate_size=cfg.shared_intermediate_size if granite4 and not cfg.num_local_experts
            else intermediate,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=eps if isinstance(eps := NORM_EPS.get(model_type, "rms_norm_eps"), float) else getattr(cfg, eps),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=_max_position(cfg, model_type),
            tie_word_embeddings=tied,
            # Qwen2 always has q, k and v biases; Qwen2-MoE unless its config says qkv_bias false.
            # GLM-4.1V's language model has them without saying so.
            qkv_bias=(bool(getattr(cfg, "attention_bias", False)) and model_type not in ("nemotron_h", *UNBIASED))
            or model_type == "qwen2"
            or use_bias
            or getattr(cfg, "model_type", None) == "glm4v_text"
            or (model_type == "qwen2_moe" and bool(getattr(cfg, "qkv_bias", True))),
            # Youtu's and EXAONE-MoE's MLPs and attention have none, whatever their configs say (transformers')
            mlp_bias=(bool(getattr(cfg, "mlp_bias", False)) and model_type not in UNBIASED) or use_bias,
            sliding_window=window,
            o_bias=_o_bias(cfg, model_type, use_bias),
            sliding_layers=sliding_layers,
            qk_norm=qk_norms,
            qk_norm_whole=whole_qk_norms,
            rotary_dim=rotary_dim,
            interleaved_rotary=interleaved,
            query_position_scaling=_query_position_scaling(scaling) if model_type in ("ministral3", "mistral4") else None,
            **_experts(cfg, model_type),
            activation=activations[act],
            ungated_mlp=model_type in cls.OWN_ACTIVATIONS,
            embed_scale=cfg.hidden_size**0.5 if gemma else granite.get("embedding_multiplier") or (
                _multiplier(cfg, "embedding_multiplier") if falcon else None),
            embed_scale_rounded=gemma,
            offset_norms=(gemma and not gemma4) or model_type in cls.GATED_DELTA,
            sandwich_norms=model_type in ("gemma2", "gemma3_text", "gemma4_text", "glm4") or olmo or exaone or (
                lfm3 and bool(getattr(cfg, "use_sandwich_norm", True))),
            head_gates=lfm3 and bool(getattr(cfg, "use_attention_gate", True)),
            glm_norm_names=model_type == "glm4",
            input_norms=not (olmo or exaone),
            float_rotary=olmo or ernie or deepseek_v2 or cohere or lfm3 or bool(llama4),
            query_scale=query_scale,
            attn_softcap=softcaps["attn_logit_softcapping"],
            final_softcap=softcaps["final_logit_softcapping"],
            local_rope_theta=float(local.get("rope_theta", 10000.0)) if local is not None else None,
            local_rope_scaling=local_scaling,
            scaled_max_position=model_type == "gemma3_text",
            float_norms=gemma or olmo or model_type in ("gpt_oss", "nemotron_h", "helium"),
            attention_sinks=model_type in ("gpt_oss", *GRANITE_SWA),
            nope_layers=_nope_layers(cfg) if model_type in ("smollm3", "llama4_text") else (
                # EXAONE: with a window in its config its full layers do not rotate, slide any layer or not
                _full_layers(cfg, sliding_layers) if model_type in EXAONES and getattr(cfg, "sliding_window", None)
                else ()) or (
                tuple(range(cfg.num_hidden_layers))
                if (granite4 and getattr(cfg, "position_embedding_type", None) != "rope") or model_type == "nemotron_h"
                else ()) or (_full_layers(cfg, sliding_layers) if model_type == "cohere2" else ()) or swa_nope or (
                _olmo_hybrid_nope(cfg) if model_type == "olmo_hybrid" else ()),
            residual_scale=granite.get("residual_multiplier"),
            logits_scaling=granite.get("logits_scaling"),
            **quantization,
            latent=latent,
            centered_norms=cohere or model_type in LAYER_NORMED,
            norm_bias=model_type in LAYER_NORMED,
            parallel_blocks=cohere,
            logit_scale=_logit_scale(cfg) if cohere else _multiplier(cfg, "lm_head_multiplier") if falcon else None,
            rounded_rotary_tables=cohere,
            qk_norm_per_head=cohere_qk_norms,
            qk_norm_after_rotary=model_type in HUNYUAN,
            **lfm2,
            **gated_delta,
            **mamba,
            **gemma4,
            **llama4,
        )
        # The older families' fields as their configs name them, past what the common reading says.
        return replace(spec, **_layer_normed_fields(cfg, model_type)) if model_type in LAYER_NORMED else spec


def _o_bias(cfg: Any, model_type: str, use_bias: bool) -> bool:
    """Whether o_proj has a bias: Llama's and Mistral's ``attention_bias`` puts one there too;
    Qwen2's, GLM's and GLM-4.5's ``attention_bias`` is q, k and v's only, and Seed-OSS's (its
    ``attention_out_bias`` is o's); ERNIE's ``use_bias`` is every projection's."""
    if model_type in ("ernie4_5", "ernie4_5_moe"):
        return use_bias
    if model_type == "seed_oss":
        return bool(getattr(cfg, "attention_out_bias", False))
    if model_type in ("qwen2", "qwen2_moe", "glm", "glm4", "glm4_moe", "nemotron_h", "solar_open", "helium", *UNBIASED):
        # Nemotron-H: none at all; Solar Open and Helium: q, k and v's only
        return False
    return bool(getattr(cfg, "attention_bias", False))


NORM_EPS = {"cohere": "layer_norm_eps", "cohere2": "layer_norm_eps", "jais2": "layer_norm_eps", "lfm2": "norm_eps",
            "lfm2_moe": "norm_eps", "lfm3": "norm_eps", "nemotron_h": "layer_norm_epsilon", "starcoder2": "norm_epsilon",
            "nemotron": "norm_eps", "stablelm": "layer_norm_eps", "phi": "layer_norm_eps", "gpt_neox": "layer_norm_eps",
            "falcon": "layer_norm_epsilon", "gptj": "layer_norm_epsilon", "gpt2": "layer_norm_epsilon",
            "gpt_bigcode": "layer_norm_epsilon", "olmo": 1e-5, "opt": 1e-5, "bloom": "layer_norm_epsilon",
            "mpt": "layer_norm_epsilon"}
"""The config's name for its norms' epsilon where it is not ``rms_norm_eps``, or the epsilon
where the config has none (OLMo 1's)."""

LAYER_NORMED = ("jais2", "starcoder2", "nemotron", "stablelm", "phi", "gpt_neox", "falcon", "gptj", "gpt2", "gpt_bigcode",
                "olmo", "opt", "bloom", "mpt")
"""Model types whose norms are LayerNorms (``centered_norms``), with biases (``norm_bias``) but
OLMo's, which have neither weight nor bias, and MPT's, which have no bias."""

FIXED_ACTS = {"bloom": "bloom_gelu", "mpt": "gelu"}
"""The activation of the model types whose configs name none: BLOOM's tanh GELU (its own
constants, step by step), MPT's exact GELU."""


def _max_position(cfg: Any, model_type: str) -> int:
    """The longest context: ``max_position_embeddings``, MPT's ``max_seq_len`` (its ALiBi tables'
    length in transformers), BLOOM's ``seq_length`` where its config has one, else 2048, its
    training length (vLLM's default for a config that names none)."""
    if model_type == "bloom":
        return int(getattr(cfg, "seq_length", None) or 2048)
    if model_type == "mpt":
        return int(cfg.max_seq_len)
    return cfg.max_position_embeddings

ACT_NAMES = {"nemotron_h": "mlp_hidden_act", "falcon": "activation", "gptj": "activation_function",
             "gpt2": "activation_function", "gpt_bigcode": "activation_function", "opt": "activation_function"}
"""The config's name for its MLPs' activation where it is not ``hidden_act``."""


def _layer_normed_fields(cfg: Any, model_type: str) -> dict[str, Any]:
    """What the LayerNorm families' configs say otherwise than Llama's: StarCoder2's ``use_bias``
    (every projection's), Nemotron's biases and weights less one, StableLM's q/k/v biases
    (``use_qkv_bias``; o never has one), parallel blocks (``use_parallel_residual``) and query and
    key LayerNorms per head (``qk_layernorm``: Command R+'s), Phi's parallel blocks summed before
    the residual and biases everywhere (the LM head's too), GPT-NeoX's parallel blocks with the
    MLP's own norm (``use_parallel_residual``) and ``attention_bias`` (q, k, v and o's; its
    MLP's always), Falcon's (:func:`_falcon_fields`), GPT-J's parallel blocks summed before the
    residual (Phi's), its MLP of ``n_inner`` (else four times the hidden size) and LM head bias;
    GPT-2's and GPTBigCode's (:func:`_gpt2_fields`)."""
    if model_type == "jais2":
        return {}
    if model_type == "olmo":  # OLMo 1: Llama with LayerNorms of no weight nor bias (NORM_EPS), clip_qkv
        clip = getattr(cfg, "clip_qkv", None)
        return dict(norm_bias=False, weightless_norms=True, clip_qkv=float(clip) if clip is not None else None,
                    float_rotary=True)  # OLMo 2's rotary, float32 tables
    if model_type == "falcon":
        return _falcon_fields(cfg)
    if model_type in ("gpt2", "gpt_bigcode"):
        return _gpt2_fields(cfg)
    if model_type == "opt":
        return _opt_fields(cfg)
    if model_type == "bloom":
        return _bloom_fields(cfg)
    if model_type == "mpt":
        return _mpt_fields(cfg)
    if model_type == "gptj":
        return dict(intermediate_size=getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size, qkv_bias=False, o_bias=False,
                    mlp_bias=True, parallel_blocks=True, parallel_residual_last=True, lm_head_bias=True)
    if model_type == "starcoder2":
        bias = bool(getattr(cfg, "use_bias", True))
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    if model_type == "nemotron":
        return dict(norms_less_one=True)  # its attention_bias and mlp_bias read as Llama's
    if model_type == "stablelm":
        qk_norms = bool(getattr(cfg, "qk_layernorm", False))
        return dict(qkv_bias=bool(getattr(cfg, "use_qkv_bias", False)), o_bias=False, mlp_bias=False,
                    parallel_blocks=bool(getattr(cfg, "use_parallel_residual", False)), qk_norm=qk_norms,
                    qk_norm_per_head=qk_norms)
    if model_type == "phi":
        if getattr(cfg, "qk_layernorm", False):
            raise ModelError("qk_layernorm: Phi's query and key LayerNorms are not supported (no released Phi has them)")
        return dict(qkv_bias=True, o_bias=True, mlp_bias=True, parallel_blocks=True, parallel_residual_last=True,
                    lm_head_bias=True)
    bias, parallel = bool(getattr(cfg, "attention_bias", True)), bool(getattr(cfg, "use_parallel_residual", True))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=True, parallel_blocks=parallel, parallel_residual_last=parallel,
                parallel_mlp_norm=parallel)


def _gpt2_fields(cfg: Any) -> dict[str, Any]:
    """GPT-2 and GPTBigCode (StarCoder 1, SantaCoder): learned positions (``n_positions`` of
    them) instead of a rotary, biases everywhere, ungated MLPs of ``n_inner`` (else four times
    the hidden size); GPTBigCode's multi-query attention (``multi_query``: its config's one
    key-value head).
    ``scale_attn_weights`` false: unscaled scores; GPT-2's scores scaled by their layer
    (``scale_attn_by_inverse_layer_idx``) refused."""
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        raise ModelError("scale_attn_by_inverse_layer_idx: scores scaled by their layer's index are not supported")
    fields = dict(intermediate_size=getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size, qkv_bias=True, o_bias=True,
                  mlp_bias=True, learned_positions=True, nope_layers=tuple(range(cfg.num_hidden_layers)))
    if not getattr(cfg, "scale_attn_weights", True):
        fields["query_scale"] = 1.0
    return fields


def _opt_fields(cfg: Any) -> dict[str, Any]:
    """OPT (125M, 1.3B, 2.7B and up; Galactica): GPT-2's learned positions (their table two rows
    longer: position p reads row p + 2), ReLU (Galactica: GELU) MLPs of ``ffn_dim``, ``enable_bias``
    on every projection, queries scaled as they leave their projection (``prescaled_queries``).
    OPT-350M's norms after each block (``do_layer_norm_before`` false) and embeddings of another
    width (``word_embed_proj_dim``) are refused, as are norms without weights."""
    refused = ((not getattr(cfg, "do_layer_norm_before", True), "do_layer_norm_before false: norms after each block "
                "(OPT-350M's)"),
               (getattr(cfg, "word_embed_proj_dim", cfg.hidden_size) != cfg.hidden_size, "word_embed_proj_dim "
                f"{getattr(cfg, 'word_embed_proj_dim', None)}: embeddings projected in and out (OPT-350M's)"),
               (not getattr(cfg, "layer_norm_elementwise_affine", True), "layer_norm_elementwise_affine false: norms "
                "without weights"),
               (getattr(cfg, "_remove_final_layer_norm", False), "_remove_final_layer_norm: no final norm"))
    for wrong, what in refused:
        if wrong:
            raise ModelError(f"{what} is not supported")
    bias = bool(getattr(cfg, "enable_bias", True))
    return dict(intermediate_size=cfg.ffn_dim, qkv_bias=bias, o_bias=bias, mlp_bias=bias, learned_positions=True,
                position_table_offset=2, nope_layers=tuple(range(cfg.num_hidden_layers)), prescaled_queries=True)


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's slope for each of ``heads`` heads, as BLOOM's and Falcon's releases use them (and
    the paper defines them): ``2 ** (-8 i / n)`` for heads ``i = 1 .. n``, ``n`` the largest power
    of two up to ``heads``; the rest of the heads take every other slope of ``2 n`` heads'."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2 ** (-8 * i / n) for i in range(1, n + 1)]
    return slopes + [2 ** (-4 * i / n) for i in range(1, 2 * (heads - n), 2)]


def _bloom_fields(cfg: Any) -> dict[str, Any]:
    """BLOOM: ALiBi (:func:`alibi_slopes`), its embeddings LayerNormed, q, k and v in one
    ``query_key_value`` head by head (GPT-NeoX's), biases everywhere, ungated MLPs four times the
    hidden size through its tanh GELU. Norms after the residual's branch
    (``apply_residual_connection_post_layernorm``, no release has it) refused."""
    if getattr(cfg, "apply_residual_connection_post_layernorm", False):
        raise ModelError("apply_residual_connection_post_layernorm: BLOOM's residual taken after the norms is not supported")
    return dict(intermediate_size=4 * cfg.hidden_size, qkv_bias=True, o_bias=True, mlp_bias=True,
                alibi=tuple(alibi_slopes(cfg.n_head)), embedding_norm=True, nope_layers=tuple(range(cfg.n_layer)))


def _mpt_fields(cfg: Any) -> dict[str, Any]:
    """MPT (7B, 30B, their -8k, -instruct and -chat): ALiBi with its own slopes (``2 ** (-8 i / n *
    alibi_bias_max / 8)`` over the next power of two ``n``, odd ones first where heads fall
    short), LayerNorms without bias, no bias anywhere, q, k and v in one ``Wqkv`` (all q rows, then
    k's, v's), optionally clamped (``clip_qkv``) and scaled by ``softmax_scale``, exact-GELU MLPs
    four times the hidden size, as transformers runs it (which takes ``alibi_bias_max`` 8 whatever
    the config says: every release says 8; MPT's own code and vLLM read it, as here). What transformers does not run (a
    prefix LM, query and key norms, no ALiBi, biases, scaled logits, multi-query attention, and
    llm-foundry's windows, rotary and gated MLPs) is refused."""
    attn, ffn = cfg.attn_config, getattr(cfg, "ffn_config", None) or {}
    ffn_type = ffn.get("ffn_type") if isinstance(ffn, dict) else getattr(ffn, "ffn_type", None)
    refused = ((getattr(attn, "prefix_lm", False), "attn_config.prefix_lm: a prefix language model"),
               (getattr(attn, "qk_ln", False), "attn_config.qk_ln: query and key LayerNorms"),
               (not getattr(attn, "alibi", True), "attn_config.alibi false: MPT without ALiBi (learned positions)"),
               (getattr(attn, "attn_type", "multihead_attention") != "multihead_attention",
                f"attn_config.attn_type `{getattr(attn, 'attn_type', None)}`: only multihead_attention is"),
               (not getattr(cfg, "no_bias", True), "no_bias false: MPT with biases"),
               (getattr(cfg, "logit_scale", None) is not None, "logit_scale: scaled logits"),
               (getattr(cfg, "expansion_ratio", 4) != 4, f"expansion_ratio {getattr(cfg, 'expansion_ratio', None)}: "
                "MLPs of other than four times the hidden size"),
               (getattr(attn, "sliding_window_size", -1) not in (None, -1),
                f"attn_config.sliding_window_size {getattr(attn, 'sliding_window_size', None)}: a window"),
               (getattr(attn, "rope", False), "attn_config.rope: a rotary"),
               (ffn_type not in (None, "mptmlp"), f"ffn_config.ffn_type `{ffn_type}`: only mptmlp is"))
    for wrong, what in refused:
        if wrong:
            raise ModelError(f"{what} is not supported")
    heads, most = cfg.n_heads, float(getattr(attn, "alibi_bias_max", 8))
    n = 2 ** math.ceil(math.log2(heads))
    slopes = [2 ** (-i * most / n) for i in range(1, n + 1)]
    if n != heads:
        slopes = (slopes[1::2] + slopes[::2])[:heads]
    fields = dict(intermediate_size=4 * cfg.hidden_size, qkv_bias=False, o_bias=False, mlp_bias=False, norm_bias=False,
                  alibi=tuple(slopes), nope_layers=tuple(range(cfg.n_layers)))
    if getattr(attn, "clip_qkv", None):
        fields["clip_qkv"] = float(attn.clip_qkv)
    if getattr(attn, "softmax_scale", None):
        fields["query_scale"] = float(attn.softmax_scale)
    return fields


def _falcon_fields(cfg: Any) -> dict[str, Any]:
    """Falcon: 7B's parallel blocks from one norm, multi-query attention; 40B's and 180B's
    (``new_decoder_architecture``) a norm each (``num_ln_in_parallel_attn`` 2, Falcon 2 11B's 1),
    grouped queries; the blocks' outputs summed before the residual; ungated MLPs of
    ``ffn_hidden_size`` through ``activation``; ``bias`` on every projection; Falcon-RW's ALiBi
    (``alibi``) instead of the rotary, its slopes BLOOM's over the square root of the head size
    (vLLM's; transformers rounds each slope times each position to bfloat16 in every dtype, which
    blurs the nearest keys' biases a few hundred positions on: at 2,047 a 32-head Falcon-RW's
    last keys' biases are up to 0.84 from the exact ones)."""
    alibi = {}
    if getattr(cfg, "alibi", False):
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        alibi = dict(alibi=tuple(s / math.sqrt(head_dim) for s in alibi_slopes(cfg.num_attention_heads)),
                     nope_layers=tuple(range(cfg.num_hidden_layers)))
    new = bool(getattr(cfg, "new_decoder_architecture", False))
    parallel = bool(getattr(cfg, "parallel_attn", True))
    if new and not parallel:  # transformers cannot run it either
        raise ModelError("new_decoder_architecture with parallel_attn false: Falcon's new layers are parallel")
    if not new and not getattr(cfg, "multi_query", True) and cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ModelError(f"num_kv_heads {cfg.num_key_value_heads}: Falcon's layers without new_decoder_architecture or "
                         f"multi_query have a key-value head for each of the {cfg.num_attention_heads} query heads")
    bias = bool(getattr(cfg, "bias", False))
    return dict(intermediate_size=cfg.ffn_hidden_size, qkv_bias=bias, o_bias=bias, mlp_bias=bias, parallel_blocks=parallel,
                parallel_residual_last=parallel,
                parallel_mlp_norm=new and (getattr(cfg, "num_ln_in_parallel_attn", None) or 2) == 2, **alibi)


def _full_layers(cfg: Any, sliding: tuple[int, ...] | None) -> tuple[int, ...]:
    """The layers that attend to every position (all of them where none slides): those that do not
    rotate in EXAONE 4's models with a window in their config, and in Cohere 2's (transformers
    rotates only where a layer slides)."""
    return tuple(i for i in range(cfg.num_hidden_layers) if sliding is None or i not in sliding)


def _lfm2_fields(cfg: Any) -> dict[str, Any]:
    """LFM2's conv layers (``layer_types`` "conv"; the others "full_attention"), their filters'
    taps and biases, and its MLP's width as transformers derives it: with
    ``block_auto_adjust_ff_dim``, two thirds of ``intermediate_size``, times
    ``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of`` if there is one."""
    kinds = list(getattr(cfg, "layer_types", None) or ())
    allowed = ("conv", "full_attention", "sliding_attention") if cfg.model_type == "lfm3" else ("conv", "full_attention")
    if len(kinds) != cfg.num_hidden_layers or set(kinds) - set(allowed):
        raise ModelError(f"layer_types {kinds!r} must name each of the {cfg.num_hidden_layers} layers "
                         + " or ".join(f"`{kind}`" for kind in allowed))
    kernel = getattr(cfg, "conv_L_cache", 3)
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1:
        raise ModelError(f"conv_L_cache {kernel!r} must be a positive integer")
    size = cfg.intermediate_size
    if getattr(cfg, "block_auto_adjust_ff_dim", False) and cfg.model_type == "lfm2":  # LFM2-MoE's and LFM3's MLPs
        # take intermediate_size as it is
        size = int(2 * size / 3)
        multiplier = getattr(cfg, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = cfg.block_multiple_of
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return dict(conv_layers=tuple(i for i, kind in enumerate(kinds) if kind == "conv"), conv_kernel=kernel,
                conv_bias=bool(getattr(cfg, "conv_bias", False)), intermediate_size=size)


def _gemma4_fields(cfg: Any) -> dict[str, Any]:
    """Gemma 4's language model: its full layers' heads (``global_head_dim``, and with
    ``attention_k_eq_v`` ``num_global_key_value_heads`` and values that are the keys'
    projection), value norms and layer scalars; 26B-A4B's experts beside the MLP; E2B's and E4B's
    per-layer embeddings, shared layers (reading an earlier layer's keys and values) and their
    double-wide MLPs."""
    shared = dict(per_layer_input_size=int(getattr(cfg, "hidden_size_per_layer_input", None) or 0))
    if shared["per_layer_input_size"]:  # E2B, E4B: per-layer embeddings
        vocab = int(getattr(cfg, "vocab_size_per_layer_input", None) or cfg.vocab_size)
        if vocab < cfg.vocab_size:  # transformers would index past the table
            raise ModelError(f"vocab_size_per_layer_input {vocab} must be at least vocab_size {cfg.vocab_size}")
        shared["per_layer_vocab"] = vocab
    sources = _gemma4_kv_sources(cfg)
    shared["kv_sources"] = sources
    if getattr(cfg, "use_double_wide_mlp", False):
        shared["wide_mlp_layers"] = tuple(layer for layer, _ in sources)
    experts = {}
    if getattr(cfg, "enable_moe_block", False):  # 26B-A4B: experts beside every layer's MLP
        count = cfg.num_experts or 0
        if not count or not 1 <= (cfg.top_k_experts or 0) <= count or not cfg.moe_intermediate_size:
            raise ModelError(f"enable_moe_block needs num_experts ({cfg.num_experts}), top_k_experts from 1 to "
                             f"num_experts ({cfg.top_k_experts}) and moe_intermediate_size ({cfg.moe_intermediate_size})")
        experts = dict(num_experts=count, experts_per_token=cfg.top_k_experts, expert_size=cfg.moe_intermediate_size,
                       normalize_routing=True, float_routing_weights=True, experts_beside_mlp=True, scaled_router=True)
    if getattr(cfg, "attention_bias", False):  # none of its releases
        raise ModelError("attention_bias: Gemma 4 with biased projections is not supported")
    if "sliding_attention" in cfg.layer_types and not getattr(cfg, "sliding_window", None):
        # its sliding layers would attend to everything, with full layers' heads: none of its releases
        raise ModelError("sliding_window null: Gemma 4's sliding_attention layers need a window")
    k_eq_v = bool(getattr(cfg, "attention_k_eq_v", False))
    # transformers >= 5.25 saves each layer's overrides (its config read as a dict: see
    # from_hf_config); its releases' configs say global_head_dim and num_global_key_value_heads.
    per_layer = getattr(cfg, "per_layer_config", None)
    if per_layer is not None:  # keyed by layer as saved: "05" among 30 layers (zero-padded), or 5
        per_layer = {int(key): value for key, value in per_layer.items()}

    def shape(layer: int, kind: str) -> tuple[int, int]:
        if per_layer is not None:
            each = per_layer.get(layer, {})
            return each.get("head_dim", cfg.head_dim), each.get("num_key_value_heads", cfg.num_key_value_heads)
        if kind != "full_attention":
            return cfg.head_dim, cfg.num_key_value_heads
        kv = getattr(cfg, "num_global_key_value_heads", None) if k_eq_v else None
        return getattr(cfg, "global_head_dim", None) or cfg.head_dim, kv or cfg.num_key_value_heads

    shapes = {kind: {shape(i, kind) for i, kind in enumerate(cfg.layer_types) if kind == each}
              for kind, each in (("full", "full_attention"), ("sliding", "sliding_attention"))}
    if len(shapes["full"]) > 1 or shapes["sliding"] - {(cfg.head_dim, cfg.num_key_value_heads)}:
        raise ModelError(f"per_layer_config: heads of {sorted(shapes['full'] | shapes['sliding'])} (head_dim, key and "
                         "value heads); Gemma 4 is supported with one shape for its full layers and the config's for "
                         "its sliding ones")
    full = next(iter(shapes["full"]), None)
    if full is not None and full[0] % 2:
        raise ModelError(f"global_head_dim {full[0]} must be even (rotary pairs)")
    different = full is not None and full != (cfg.head_dim, cfg.num_key_value_heads)
    return dict(full_head_dim=full[0] if different else None, full_kv_heads=full[1] if different else None,
                value_norms=True, values_from_keys=k_eq_v, layer_scalars=True, **experts, **shared)


def _gemma4_kv_sources(cfg: Any) -> tuple[tuple[int, int], ...]:
    """Gemma 4's last ``num_kv_shared_layers`` layers, each with the layer whose keys and values
    it reads: the last of its kind before them, as transformers' kv_sharing_modes pairs them."""
    shared, kinds = int(getattr(cfg, "num_kv_shared_layers", None) or 0), list(cfg.layer_types)
    first = len(kinds) - shared
    if not 0 <= shared < len(kinds):
        raise ModelError(f"num_kv_shared_layers {shared} must leave some of the {len(kinds)} layers their own keys and values")
    pairs = []
    for layer in range(first, len(kinds)):
        source = next((j for j in range(first - 1, -1, -1) if kinds[j] == kinds[layer]), None)
        if source is None:
            raise ModelError(f"num_kv_shared_layers {shared}: layer {layer} ({kinds[layer]}) has no earlier layer of its "
                             "kind whose keys and values it could read")
        pairs.append((layer, source))
    return tuple(pairs)


def _llama4_fields(cfg: Any) -> dict[str, Any]:
    """Llama 4's query and key norms (``use_qk_norm``: weightless, its rotating layers' only), its
    NoPE layers' temperature (``attn_temperature_tuning``: ``attn_scale``, ``floor_scale``) and
    its chunked layers (``attention_chunk_size``, :func:`_sliding_window`)."""
    tuning = None
    if getattr(cfg, "attn_temperature_tuning", True):  # its releases say 4, meaning on
        scale, floor = getattr(cfg, "attn_scale", 0.1), getattr(cfg, "floor_scale", 8192)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ModelError(f"attn_scale {scale!r} must be a number")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor <= 0:
            raise ModelError(f"floor_scale {floor!r} must be a positive number")
        tuning = (float(scale), floor)
    return dict(weightless_qk_norm=bool(getattr(cfg, "use_qk_norm", True)), nope_temperature=tuning,
                chunked_windows=True)


def _olmo_hybrid_fields(cfg: Any) -> dict[str, Any]:
    """OLMo Hybrid's Gated DeltaNet layers (``layer_types`` "linear_attention"; the others OLMo 3's
    attention): their sizes, beta doubled with ``linear_allow_neg_eigval`` (in [0, 2]), the output
    norm's epsilon flash-linear-attention's 1e-5; each layer's norms where its kind puts them."""
    kinds = list(getattr(cfg, "layer_types", None) or ())
    if len(kinds) != cfg.num_hidden_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ModelError(f"layer_types {kinds!r} must name each of the {cfg.num_hidden_layers} layers "
                         "`linear_attention` or `full_attention`")
    if "full_attention" not in kinds:
        raise ModelError("layer_types names no `full_attention` layer; a model of linear attention alone is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":  # its convolutions take it too
        raise ModelError(f"hidden_act `{cfg.hidden_act}`: OLMo Hybrid's linear layers are supported with `silu` only")
    shape = replace(DeltaShape.of(cfg, ModelError), norm_eps=1e-5,
                                beta_scale=2.0 if getattr(cfg, "linear_allow_neg_eigval", True) else 1.0)
    return dict(linear_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"), delta=shape,
                prenorm_linear_layers=True)


def _olmo_hybrid_nope(cfg: Any) -> tuple[int, ...]:
    """Every layer, where the config has no rotary base (its releases: transformers then builds no
    rotary at all); none otherwise."""
    rope = getattr(cfg, "rope_parameters", None)
    return () if rope is not None and rope.get("rope_theta") is not None else tuple(range(cfg.num_hidden_layers))


def _gated_delta_fields(cfg: Any) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's linear-attention layers (``layer_types`` "linear_attention";
    the others "full_attention", with gated queries) and their sizes."""
    kinds = list(getattr(cfg, "layer_types", None) or ())
    if len(kinds) != cfg.num_hidden_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ModelError(f"layer_types {kinds!r} must name each of the {cfg.num_hidden_layers} layers "
                         "`linear_attention` or `full_attention`")
    if "full_attention" not in kinds:  # the KV blocks would hold nothing (and count nothing)
        raise ModelError("layer_types names no `full_attention` layer; a model of linear attention alone is not supported")
    return dict(linear_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
                delta=DeltaShape.of(cfg, ModelError), gated_attention=True)


def _logit_scale(cfg: Any) -> float | None:
    """Cohere's factor on the logits (``logit_scale``; None: 1, no factor)."""
    value = getattr(cfg, "logit_scale", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelError(f"logit_scale {value!r} must be a positive number")
    return float(value) if value != 1 else None


def _nope_layers(cfg: Any) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: the zeros of ``no_rope_layers`` (one entry a layer; its
    config fills them from ``no_rope_layer_interval`` when the checkpoint has none)."""
    flags = getattr(cfg, "no_rope_layers", None)
    if not flags:  # none, or Llama 4's releases' [] (transformers fills both)
        interval = int(getattr(cfg, "no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(cfg.num_hidden_layers)]
    if len(flags) != cfg.num_hidden_layers:
        raise ModelError(
            f"no_rope_layers has {len(flags)} entries; it needs one for each of the {cfg.num_hidden_layers} layers"
        )
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


GRANITES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa")
"""Granite's model types, which read its four multipliers."""


def _granite4_layers(cfg: Any) -> dict[str, Any]:
    """Granite 4's Mamba2 layers (``layer_types`` "mamba", which transformers 5 reads as
    "linear_attention"; the others "attention") and their shape; none for its attention-only
    models (Granite 4.0 Micro's shape)."""
    kinds = list(getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ())
    kinds = [{"mamba": "linear_attention", "attention": "full_attention"}.get(kind, kind) for kind in kinds]
    other = next((i for i, kind in enumerate(kinds) if kind not in ("full_attention", "linear_attention")), None)
    if other is not None:
        raise ModelError(f"layer {other} is a `{kinds[other]}` layer; Granite 4's layers are `mamba` or `attention`")
    if len(kinds) != cfg.num_hidden_layers:
        raise ModelError(f"layer_types has {len(kinds)} entries; it needs one for each of the {cfg.num_hidden_layers} layers")
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    if not linear:
        return {}
    if len(linear) == len(kinds):  # the KV blocks would hold nothing (and count nothing)
        raise ModelError("layer_types names no `attention` layer; a model of Mamba layers alone is not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":  # transformers' Mamba layers convolve with it too
        raise ModelError(f"hidden_act `{cfg.hidden_act}`: Granite 4's Mamba layers are supported with `silu` only")
    return dict(linear_layers=linear, mamba=MambaShape.of(cfg, ModelError))


NEMOTRON_BLOCKS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
                   "mlp": "mlp", "moe": "moe"}
"""Nemotron-H's block kinds (transformers 5's names and the older ones) -> ours."""


def _nemotron_blocks(cfg: Any) -> dict[str, Any]:
    """Nemotron-H's blocks (``layers_block_type``; older configs' ``hybrid_override_pattern``,
    which transformers reads into it), its Mamba2 layers' shape, and its experts: routed as
    DeepSeek-V3 (sigmoid scores plus a choice bias, groups, ``routed_scaling_factor``), ungated
    squared-ReLU experts of ``moe_intermediate_size`` and one shared expert of
    ``moe_shared_expert_intermediate_size``, added ungated."""
    kinds = [NEMOTRON_BLOCKS.get(kind, kind) for kind in (getattr(cfg, "layers_block_type", None) or ())]
    if len(kinds) != cfg.num_hidden_layers or set(kinds) - set(NEMOTRON_BLOCKS.values()):
        raise ModelError(f"layers_block_type {kinds!r} must name each of the {cfg.num_hidden_layers} layers "
                         "`linear_attention` (Mamba2), `full_attention`, `mlp` or `moe`")
    if "attention" not in kinds:  # the KV blocks would hold nothing (and count nothing)
        raise ModelError("layers_block_type names no `full_attention` layer; a model without attention is not supported")
    if getattr(cfg, "mamba_hidden_act", "silu") != "silu":
        raise ModelError(f"mamba_hidden_act `{cfg.mamba_hidden_act}` is not supported; supported: silu")
    out: dict[str, Any] = dict(block_kinds=tuple(kinds), mamba=MambaShape.of_nemotron(cfg, ModelError),
                               linear_layers=tuple(i for i, kind in enumerate(kinds) if kind == "mamba"))
    if "moe" in kinds:
        if getattr(cfg, "moe_latent_size", None) is not None:
            raise ModelError(f"moe_latent_size {cfg.moe_latent_size}: experts in a latent space are not supported")
        experts = cfg.n_routed_experts
        out.update(num_experts=experts, experts_per_token=_experts_per_token(cfg, experts),
                   expert_size=cfg.moe_intermediate_size, shared_expert_size=cfg.moe_shared_expert_intermediate_size,
                   shared_expert_gated=False, routing_bias=True, sigmoid_routing=True, float_router=True,
                   float_routing_weights=True, normalize_routing=bool(cfg.norm_topk_prob),
                   dense_layers=tuple(i for i, kind in enumerate(kinds) if kind != "moe"),
                   **_groups_and_scale(cfg, experts))
    return out


def _falcon_h1_fields(cfg: Any) -> dict[str, Any]:
    """Falcon-H1: a Mamba2 mixer beside the attention in every layer, and its muP multipliers,
    which scale activations in transformers, folded into the weights they meet first (each is
    linear): the attention's input into q, k and v, ``key_multiplier`` into k, its output into
    o; the Mamba mixer's input into in_proj, ``ssm_multipliers`` into in_proj's sections (z, x,
    B, C, the time steps, as transformers' mup_vector), its output into out_proj; the MLP's
    gate and down multipliers into gate_proj and down_proj. Biases take the factors that apply
    after them, not the input's."""
    if getattr(cfg, "hidden_act", "silu") != "silu":  # transformers' Mamba layers convolve with it too
        raise ModelError(f"hidden_act `{cfg.hidden_act}`: Falcon-H1's Mamba layers are supported with `silu` only")
    shape = MambaShape.of_falcon_h1(cfg, ModelError)
    attn_in, key, attn_out, ssm_in, ssm_out = (
        _multiplier(cfg, name) or 1.0 for name in ("attention_in_multiplier", "key_multiplier", "attention_out_multiplier",
                                                   "ssm_in_multiplier", "ssm_out_multiplier"))
    gate, down = _multipliers(cfg, "mlp_multipliers", 2)
    ssm = _multipliers(cfg, "ssm_multipliers", 5)
    state = shape.groups * shape.state_size
    sections = (shape.inner, shape.inner, state, state, -1)
    scales = {"self_attn.q_proj.weight": ((-1, attn_in),), "self_attn.k_proj.weight": ((-1, attn_in * key),),
              "self_attn.k_proj.bias": ((-1, key),), "self_attn.v_proj.weight": ((-1, attn_in),),
              "self_attn.o_proj.weight": ((-1, attn_out),), "self_attn.o_proj.bias": ((-1, attn_out),),
              "mamba.in_proj.weight": tuple((rows, f * ssm_in) for rows, f in zip(sections, ssm)),
              "mamba.in_proj.bias": tuple(zip(sections, ssm)),
              "mamba.out_proj.weight": ((-1, ssm_out),), "mamba.out_proj.bias": ((-1, ssm_out),),
              "mlp.gate_proj.weight": ((-1, gate),), "mlp.gate_proj.bias": ((-1, gate),),
              "mlp.down_proj.weight": ((-1, down),), "mlp.down_proj.bias": ((-1, down),)}
    return dict(linear_layers=tuple(range(cfg.num_hidden_layers)), mamba=shape, parallel_mamba=True,
                weight_scales=tuple((name, rows) for name, rows in scales.items() if any(f != 1.0 for _, f in rows)))


def _multiplier(cfg: Any, key: str) -> float | None:
    """A positive factor of the config; None where it is absent or 1 (no change)."""
    value = getattr(cfg, key, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelError(f"{key} {value!r} must be a positive number")
    return float(value) if value != 1.0 else None


def _multipliers(cfg: Any, key: str, count: int) -> list[float]:
    """A list of ``count`` factors of the config (all 1 where it is absent)."""
    values = getattr(cfg, key, None)
    if values is None:
        return [1.0] * count
    if not isinstance(values, (list, tuple)) or len(values) != count or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ModelError(f"{key} {values!r} must be a list of {count} numbers")
    return [float(v) for v in values]


GRANITE_SWA = ("granite_swa", "granitemoe_swa")
"""Granite (dense, experts) with sliding-window layers, attention sinks and a rotary base per layer."""


def _granite_swa_thetas(cfg: Any, sliding: tuple[int, ...], theta: float) -> tuple[float, dict | None, tuple[int, ...]]:
    """Granite SWA's ``layer_rope_theta`` (a base per layer; 0: that layer does not rotate) as the
    engine's tables: the full layers' base, the sliding layers' (as Gemma 3's local rotary, the same
    scaling; None where it is the full layers'), and the layers that do not rotate. Refused where the
    full (or the sliding) layers do not share one base."""
    thetas = list(getattr(cfg, "layer_rope_theta", None) or [theta] * cfg.num_hidden_layers)
    if len(thetas) != cfg.num_hidden_layers or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0
                                                   for t in thetas):
        raise ModelError(f"layer_rope_theta {thetas!r} must be a base (0: none) for each of the {cfg.num_hidden_layers} "
                         "layers")
    bases = {kind: {float(t) for i, t in enumerate(thetas) if t and (i in sliding) == (kind == "sliding")}
             for kind in ("full", "sliding")}
    if len(bases["full"]) > 1 or len(bases["sliding"]) > 1:
        raise ModelError(f"layer_rope_theta {thetas!r}: one rotary base for the full layers and one for the sliding "
                         "ones are supported")
    full = next(iter(bases["full"]), next(iter(bases["sliding"]), theta))
    local = next(iter(bases["sliding"]), full)
    return full, ({"rope_theta": local} if local != full else None), tuple(i for i, t in enumerate(thetas) if not t)


def _granite_multipliers(cfg: Any) -> dict[str, float]:
    """Granite's four factors, each checked positive; those at 1 (no change) left out."""
    found = {}
    for key in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        value = getattr(cfg, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelError(f"{key} {value!r} must be a positive number")
        if value != 1.0 or key == "attention_multiplier":  # 1 is a real scale for scores, not "none"
            found[key] = float(value)
    return found


def _quantization(cfg: Any, model_type: str) -> dict[str, Any]:
    """The spec's fields for a quantized checkpoint (``quantization_config``): FP8 weights
    (``fp8``, e4m3, with one scale a tensor or a block of ``weight_block_size``) are decoded as
    they load (weights.dequantize_fp8), gpt-oss's MXFP4 experts too (weights.dequantize_mxfp4);
    any other method (GPTQ, AWQ, bitsandbytes...) is refused: its weights would load as their
    raw values without their scales."""
    found: dict[str, Any] = {}
    for config in (cfg, getattr(cfg, "text_config", None)):
        quant = getattr(config, "quantization_config", None)
        if not quant:
            continue
        get = quant.get if isinstance(quant, dict) else lambda key, default=None: getattr(quant, key, default)
        method = get("quant_method")
        method = getattr(method, "value", method)  # transformers may hold it as an enum
        if method == "mxfp4" and model_type == "gpt_oss":
            continue
        if method == "fp8" and get("fmt", "e4m3") == "e4m3":
            block = get("weight_block_size")
            if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
                    isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise ModelError(f"quantization_config weight_block_size {block!r} must be two positive integers or null")
            found = {"fp8_weights": True, "fp8_block": tuple(block) if block is not None else None}
            continue
        raise ModelError(
            f"quantization_config quant_method `{method}`"
            + (f" fmt `{get('fmt')}`" if method == "fp8" else "")
            + ": quantized checkpoints are not read here (FP8 e4m3 and gpt-oss's MXFP4 aside); use the model's "
            "bfloat16 release (weight_format int8 or int4 quantizes it on the CPU), "
            'or a GGUF file with backend "llamacpp"'
        )
    return found


def _query_position_scaling(scaling: dict[str, Any] | None) -> tuple[float, int] | None:
    """Ministral 3's (beta, original context) from its rope parameters; None without a beta."""
    beta = (scaling or {}).get("llama_4_scaling_beta")
    if beta is None:
        return None
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise ModelError(f"llama_4_scaling_beta {beta!r} must be a number")
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ModelError("llama_4_scaling_beta needs the rope parameters' original_max_position_embeddings, "
                         f"a positive integer; got {original!r}")
    return float(beta), original


def _rope_scaling(rope: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
    """A rope scaling dict, its kind named ``rope_type`` and checked; None: none at all."""
    if not rope:
        return None
    scaling = dict(rope)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ModelSpec.ROPE_SCALINGS:
        raise ModelError(f"rope scaling `{kind}` is not supported; supported: {', '.join(ModelSpec.ROPE_SCALINGS)}")
    scaling["rope_type"] = kind
    if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = getattr(
            cfg, "original_max_position_embeddings", cfg.max_position_embeddings
        )
    if kind in ("linear", "dynamic", "llama3") and not scaling.get("factor"):
        raise ModelError(f"rope scaling `{kind}` needs a `factor`")
    return scaling


def _experts(cfg: Any, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelSpec`, as transformers builds the layers:
    Mixtral's every layer is sparse, its experts of ``intermediate_size``, their weights always
    renormalised; Qwen2-MoE's and Qwen3-MoE's layers are sparse but for ``mlp_only_layers`` and
    those off ``decoder_sparse_step``, their experts of ``moe_intermediate_size``; OLMoE's
    every layer, experts of ``intermediate_size``, renormalised with ``norm_topk_prob``; gpt-oss's
    and Granite-MoE's every layer, experts of ``intermediate_size``, weighted by a softmax of
    the top-k logits alone. Qwen3-Next's and Qwen3.5's are Qwen2-MoE's (with a gated shared
    expert); Qwen3-VL's and Qwen3.5's (whose configs have no ``norm_topk_prob``) always renormalise."""
    renormalised = getattr(cfg, "model_type", None) in ("qwen3_vl_moe_text", "qwen3_5_moe_text")
    qwen3_vl = getattr(cfg, "model_type", None) == "qwen3_vl_moe_text"
    if model_type == "mixtral":
        experts, size, normalize, dense = cfg.num_local_experts, cfg.intermediate_size, True, ()
    elif model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        experts, size = cfg.num_experts, cfg.moe_intermediate_size
        normalize = renormalised or bool(cfg.norm_topk_prob)
        step, only = getattr(cfg, "decoder_sparse_step", 1) or 1, set(getattr(cfg, "mlp_only_layers", None) or ())
        dense = tuple(i for i in range(cfg.num_hidden_layers) if i in only or (i + 1) % step)
    elif model_type == "olmoe":
        experts, size, normalize, dense = cfg.num_experts, cfg.intermediate_size, bool(cfg.norm_topk_prob), ()
    elif model_type in ("gpt_oss", "granitemoe"):  # the softmax over the chosen logits sums to 1 already
        experts, size, normalize, dense = cfg.num_local_experts, cfg.intermediate_size, False, ()
    elif model_type in ("granitemoeshared", "granitemoehybrid", "granitemoe_swa"):  # Granite-MoE's, and a shared MLP
        # added ungated
        if not cfg.num_local_experts:  # Granite 4's dense models (their shared MLP is the layer's MLP)
            return {}
        top_k = _experts_per_token(cfg, cfg.num_local_experts)
        return dict(num_experts=cfg.num_local_experts, experts_per_token=top_k, expert_size=cfg.intermediate_size,
                    softmax_top_k=True, shared_expert_size=int(getattr(cfg, "shared_intermediate_size", 0) or 0),
                    shared_expert_gated=False)
    elif model_type in BIASED_ROUTING:
        return _biased_routing(cfg, model_type)
    elif model_type == "deepseek_v2":
        return _deepseek_v2_routing(cfg)
    elif model_type == "lfm2_moe":
        return _lfm2_moe_routing(cfg)
    elif model_type == "llama4_text":
        return _llama4_routing(cfg)
    elif model_type == "mistral4":
        return _mistral4_routing(cfg)
    elif model_type == "hunyuan_v1_moe":
        return _hunyuan_moe_routing(cfg)
    else:
        return {}
    top_k = _experts_per_token(cfg, experts)
    gated_shared = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")  # a shared expert behind a sigmoid gate
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) if model_type in gated_shared else 0
    gpt_oss = model_type == "gpt_oss"
    # transformers 4 kept gpt-oss's alpha in its code (1.702); 5 reads it from the config.
    swiglu = (float(getattr(cfg, "swiglu_alpha", 1.702)), float(cfg.swiglu_limit)) if gpt_oss else None
    return dict(num_experts=experts, experts_per_token=top_k, expert_size=size, normalize_routing=normalize,
                float_routing_weights=model_type == "mixtral", shared_expert_size=shared or 0, dense_layers=dense,
                stacked_in_out=qwen3_vl,
                router_bias=gpt_oss, softmax_top_k=model_type in ("gpt_oss", "granitemoe"),
                expert_bias=gpt_oss, clamped_swiglu=swiglu)


BIASED_ROUTING = ("glm4_moe", "dots1", "ernie4_5_moe", "minimax_m2", "deepseek_v3", "glm4_moe_lite", "solar_open",
                  "exaone_moe")
"""Mixtures of experts that choose their experts by scores plus a learned bias (DeepSeek-V3's
routing; :class:`ModelSpec`'s ``routing_bias``)."""


def _llama4_routing(cfg: Any) -> dict[str, Any]:
    """Llama 4's experts (``num_local_experts`` of ``intermediate_size``) on its ``moe_layers``
    (transformers fills them from ``interleave_moe_layer_step``: every layer in Scout, every second
    in Maverick): the top-k router logits' sigmoids, each weighting its expert's input, and a
    shared expert of the same size added ungated (:meth:`.moe.SparseMoE.route`); stacked ``[E, in, out]``."""
    experts, layers = cfg.num_local_experts, cfg.num_hidden_layers
    moe = set(getattr(cfg, "moe_layers", None) or ())
    if any(not isinstance(i, int) or not 0 <= i < layers for i in moe):
        raise ModelError(f"moe_layers {sorted(moe)} must name layers from 0 to {layers - 1}")
    return dict(num_experts=experts, experts_per_token=_experts_per_token(cfg, experts), expert_size=cfg.intermediate_size,
                weights_on_input=True, shared_expert_size=cfg.intermediate_size,
                shared_expert_gated=False, dense_layers=tuple(i for i in range(layers) if i not in moe))


HUNYUAN = ("hunyuan_v1_dense", "hunyuan_v1_moe")
"""Hunyuan's model types: query and key norms after the rotary, its "dynamic" rope with an alpha."""

UNBIASED = ("youtu", "exaone_moe")
"""Model types whose projections have no biases, whatever ``attention_bias`` and ``mlp_bias`` say
(transformers builds them without)."""

EXAONES = ("exaone4", "exaone_moe")
"""EXAONE 4's attention (per-head query and key norms, windows by its pattern, the full layers
without rotary where it has windows), dense and with experts."""


def _hunyuan_moe_routing(cfg: Any) -> dict[str, Any]:
    """Hunyuan-A13B's experts (``num_experts`` of ``intermediate_size`` on every layer, ``moe_topk``
    a token; one number for every layer, as a list where the config gives one): a float32 router,
    softmax, renormalised over the chosen, their float32 weights; a shared MLP of the same size
    added ungated."""
    def one(key: str) -> int:
        value = getattr(cfg, key)
        values = set(value) if isinstance(value, (list, tuple)) else {value}
        if len(values) != 1 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ModelError(f"{key} {value!r}: one positive number for every layer is supported")
        return values.pop()

    experts = one("num_experts")
    top_k = one("moe_topk")
    if top_k > experts:
        raise ModelError(f"moe_topk {top_k} must be at most num_experts, {experts}")
    return dict(num_experts=experts, experts_per_token=top_k, expert_size=cfg.intermediate_size, normalize_routing=True,
                float_router=True, float_routing_weights=True, shared_expert_size=cfg.intermediate_size,
                shared_expert_gated=False)


def _mistral4_routing(cfg: Any) -> dict[str, Any]:
    """Mistral 4's experts (``n_routed_experts`` of ``moe_intermediate_size``) from layer
    ``first_k_dense_replace`` on, as DeepSeek-V3's groups choose them (``n_group``, ``topk_group``,
    by their two best scores) but from softmax scores and with no choice bias, all in the router's
    dtype (the model's), renormalised with ``norm_topk_prob`` (by the sum plus 1e-20: the sum, for
    sums of at least 1e-12), times ``routed_scaling_factor``; ``n_shared_experts`` of the same size
    added ungated."""
    experts, size = cfg.n_routed_experts, cfg.moe_intermediate_size
    return dict(num_experts=experts, experts_per_token=_experts_per_token(cfg, experts), expert_size=size,
                dense_layers=_first_dense_layers(cfg), normalize_routing=bool(getattr(cfg, "norm_topk_prob", True)),
                scores_in_model_dtype=True, shared_expert_gated=False, **_groups_and_scale(cfg, experts),
                shared_expert_size=size * int(getattr(cfg, "n_shared_experts", 0) or 0))


def _lfm2_moe_routing(cfg: Any) -> dict[str, Any]:
    """LFM2-MoE's experts (``num_experts`` of ``moe_intermediate_size``) in every layer from
    ``num_dense_layers`` on: sigmoid scores of the router's logits, the experts chosen by the
    scores plus ``expert_bias`` (``use_expert_bias``, float32), weighted by their scores,
    renormalised with ``norm_topk_prob`` (by the sum plus 1e-6), times ``routed_scaling_factor``,
    all in the model's dtype (``scores_in_model_dtype``); no shared expert."""
    experts = cfg.num_experts
    dense = int(getattr(cfg, "num_dense_layers", 0) or 0)
    return dict(num_experts=experts, experts_per_token=_experts_per_token(cfg, experts),
                expert_size=cfg.moe_intermediate_size, dense_layers=tuple(range(min(dense, cfg.num_hidden_layers))),
                sigmoid_routing=True, routing_bias=bool(getattr(cfg, "use_expert_bias", True)), scores_in_model_dtype=True,
                renorm_eps=1e-6,
                normalize_routing=bool(getattr(cfg, "norm_topk_prob", True)), **_groups_and_scale(cfg, experts))


def _experts_per_token(cfg: Any, experts: int) -> int:
    top_k = cfg.num_experts_per_tok
    if experts and not 1 <= top_k <= experts:
        raise ModelError(f"num_experts_per_tok {top_k} must be from 1 to the number of experts, {experts}")
    return top_k


def _biased_routing(cfg: Any, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of the models routed by biased scores, as transformers
    builds them. GLM-4.5 (``glm4_moe``) and dots.llm1 (``dots1``) route as DeepSeek-V3: sigmoid
    scores, groups, ``routed_scaling_factor``, float32 weights; their first
    ``first_k_dense_replace`` layers are dense, and ``n_shared_experts`` experts of
    ``moe_intermediate_size`` run for every token, ungated. ERNIE 4.5 softmaxes its logits,
    renormalises always, and has MoE layers every ``moe_layer_interval`` from
    ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last); its weights are rounded
    to the model's dtype. MiniMax-M2: sigmoid scores, every layer sparse (experts of
    ``intermediate_size``), renormalised always, no shared expert, its router in the model's
    dtype. Renormalising divides by the sum plus 1e-20 (GLM-4.5, dots.llm1) or by at least
    ``moe_norm_min`` (ERNIE): for sums of at least 1e-12, a plain division (in float32), which
    is what the engine does."""
    layers = cfg.num_hidden_layers
    routing: dict[str, Any] = dict(routing_bias=True, shared_expert_gated=False)
    if model_type == "ernie4_5_moe":
        experts, size = cfg.moe_num_experts, cfg.moe_intermediate_size
        if getattr(cfg, "use_bias", False):
            raise ModelError("use_bias: ERNIE 4.5's mixture of experts with biases is not supported")
        start, end = int(getattr(cfg, "moe_layer_start_index", 1)), int(getattr(cfg, "moe_layer_end_index", -1))
        interval = int(getattr(cfg, "moe_layer_interval", 1) or 1)
        end = layers - 1 if end == -1 else end
        dense = tuple(i for i in range(layers) if not ((i + 1) % interval == 0 and start <= i <= end))
        routing.update(normalize_routing=True, float_router=True,
                       shared_expert_size=size * int(getattr(cfg, "moe_num_shared_experts", 0) or 0))
    elif model_type == "minimax_m2":
        experts, size, dense = cfg.num_local_experts, cfg.intermediate_size, ()
        routing.update(normalize_routing=True, sigmoid_routing=True, float_routing_weights=True)
    else:  # glm4_moe, dots1, deepseek_v3, glm4_moe_lite, solar_open (GLM-4.5's experts on every layer), exaone_moe
        exaone = model_type == "exaone_moe"  # its names: num_experts, num_shared_experts
        experts, size = cfg.num_experts if exaone else cfg.n_routed_experts, cfg.moe_intermediate_size
        dense = _first_dense_layers(cfg) if model_type != "solar_open" else ()  # Solar Open's: every layer, as transformers
        kinds = getattr(cfg, "mlp_layer_types", None) if model_type in ("glm4_moe_lite", "exaone_moe") else None
        if kinds is not None:  # GLM-4.7-Flash and EXAONE-MoE name each layer's kind
            if len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
                raise ModelError(f"mlp_layer_types {list(kinds)!r} must name each of the {layers} layers "
                                 "`dense` or `sparse`")
            dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
        routing.update(normalize_routing=bool(cfg.norm_topk_prob), sigmoid_routing=True, float_router=True,
                       float_routing_weights=True, **_groups_and_scale(cfg, experts),
                       shared_expert_size=size * int(getattr(cfg, "num_shared_experts" if exaone else "n_shared_experts", 0)
                                                     or 0))
    return dict(num_experts=experts, experts_per_token=_experts_per_token(cfg, experts), expert_size=size,
                dense_layers=dense, **routing)


def _first_dense_layers(cfg: Any, every: int = 1) -> tuple[int, ...]:
    """The layers with a plain MLP: the first ``first_k_dense_replace``, and (``every``:
    DeepSeek-V2's ``moe_layer_freq``) those whose index it does not divide."""
    first = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    return tuple(i for i in range(cfg.num_hidden_layers) if i < first or i % every)


def _groups_and_scale(cfg: Any, experts: int) -> dict[str, Any]:
    """DeepSeek's expert groups (``n_group``, ``topk_group``: None where there is one) and
    ``routed_scaling_factor`` (None where 1), checked."""
    groups, chosen = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
    top_k = _experts_per_token(cfg, experts)
    if experts % groups or experts // groups < 2 or not 1 <= chosen <= groups or top_k > chosen * (experts // groups):
        raise ModelError(
            f"n_group {groups} and topk_group {chosen} do not fit {experts} experts, {top_k} a token: the groups "
            "must split the experts evenly, at least 2 each, and the chosen groups hold the token's experts"
        )
    scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
    if not scale > 0:
        raise ModelError(f"routed_scaling_factor {scale} must be a positive number")
    return dict(expert_groups=(groups, chosen) if groups > 1 else None, routed_scale=scale if scale != 1.0 else None)


DEEPSEEK_V2_TOPK = ("greedy", "group_limited_greedy")


def _deepseek_v2_routing(cfg: Any) -> dict[str, Any]:
    """DeepSeek-V2's mixture of experts: softmax scores (float32 router), the best
    ``num_experts_per_tok`` (``topk_method`` "greedy"), or among the ``topk_group`` groups whose
    best expert scores highest ("group_limited_greedy"); weights times
    ``routed_scaling_factor``, renormalised first with ``norm_topk_prob`` (as vLLM does;
    DeepSeek's code then leaves the factor out, transformers ignores the key; V2's releases set
    it false); ``n_shared_experts`` experts of ``moe_intermediate_size`` added ungated; plain MLPs on the first
    ``first_k_dense_replace`` layers and off ``moe_layer_freq``."""
    experts, size = cfg.n_routed_experts, cfg.moe_intermediate_size
    method = getattr(cfg, "topk_method", "greedy") or "greedy"
    if method not in DEEPSEEK_V2_TOPK:
        raise ModelError(f"topk_method `{method}` is not supported; supported: {', '.join(DEEPSEEK_V2_TOPK)}")
    every = getattr(cfg, "moe_layer_freq", None)
    every = 1 if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ModelError(f"moe_layer_freq {every!r} must be a positive integer")
    grouping = _groups_and_scale(cfg, experts)
    if method == "greedy":
        grouping["expert_groups"] = None
    return dict(num_experts=experts, experts_per_token=_experts_per_token(cfg, experts), expert_size=size,
                dense_layers=_first_dense_layers(cfg, every), normalize_routing=bool(getattr(cfg, "norm_topk_prob", False)),
                float_router=True, float_routing_weights=True, groups_by_best=True,
                shared_expert_size=size * int(getattr(cfg, "n_shared_experts", 0) or 0), shared_expert_gated=False,
                **grouping)


def _sliding_window(cfg: Any, model_type: str) -> tuple[int | None, tuple[int, ...] | None]:
    """The window and the layers that use it, as transformers decides them: Mistral, Mixtral and
    Phi-3 slide on every layer, and Qwen3-MoE does with ``use_sliding_window`` (its config drops
    the window without it); the other Qwens only with ``use_sliding_window``, dots.llm1 always, on
    the layers ``layer_types`` names (transformers >= 4.53), else from ``max_window_layers`` on; Gemma 2
    and 3, gpt-oss, OLMo 3, Ministral and EXAONE 4 on the layers ``layer_types`` names (else every
    second, five of every six, three of every four, all, or by EXAONE 4's sliding_window_pattern:
    "LLLG" or 4); Ministral 3 on every layer; Llama and Gemma never."""
    window = getattr(cfg, "sliding_window", None)
    if model_type == "llama4_text":  # its chunked layers (ModelSpec.chunked_windows): those layer_types names
        window, types = getattr(cfg, "attention_chunk_size", None), getattr(cfg, "layer_types", None) or ()
        layers = tuple(i for i, kind in enumerate(types) if kind == "chunked_attention")
        if layers and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ModelError(f"attention_chunk_size {window!r}: the chunked_attention layers need a positive number "
                             "of positions")
        return (window, layers) if layers else (None, None)
    if model_type in ("llama", "gemma") or not window:
        return None, None
    if model_type in ("mistral", "phi3", "mixtral", "qwen3_moe", "ministral3", "starcoder2"):
        return int(window), None
    types = getattr(cfg, "layer_types", None)
    if model_type in ("gemma2", "gemma3_text", "gemma4_text", "vaultgemma", "gpt_oss", "olmo3", "ministral", *EXAONES,
                      "cohere2", "lfm3",
                      *GRANITE_SWA):
        pattern = getattr(cfg, "sliding_window_pattern", None)
        if types is None and model_type in EXAONES and isinstance(pattern, str) and pattern:  # "LLLG"
            types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                     for i in range(cfg.num_hidden_layers)]
        if types is None:  # transformers 4.x: the pattern alone (Ministral: every layer)
            pattern = {"gemma3_text": getattr(cfg, "sliding_window_pattern", 6), "olmo3": 4,
                       "ministral": cfg.num_hidden_layers + 1, "exaone4": pattern or 4, "exaone_moe": pattern or 4,
                       "cohere2": pattern or 4}.get(model_type, 2)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg.num_hidden_layers)]
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return (int(window), layers) if layers else (None, None)
    if model_type != "dots1" and not getattr(cfg, "use_sliding_window", False):
        return None, None
    if types is not None:
        layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    else:
        layers = tuple(range(getattr(cfg, "max_window_layers", 0), cfg.num_hidden_layers))
    return (int(window), layers) if layers else (None, None)


def rope_inv_freq(spec: ModelSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies per rotated pair with the config's scaling applied, and the factor
    the cos and sin tables are multiplied by (YaRN's and LongRoPE's attention factor; 1
    otherwise). ``seq_len``: the length of the sequence, for the two scalings that depend on it
    (LongRoPE's long factors beyond the original length; dynamic NTK's base), as transformers
    takes it."""
    dim = spec.rotated
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (spec.rope_theta**exponents)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "dynamic":
        if seq_len is not None and seq_len > spec.max_position:
            return _dynamic_inv_freq(spec, torch.tensor([seq_len]))[0], 1.0
        # transformers' initial frequencies: the base in Python floats (unchanged up to
        # max_position_embeddings whatever the factor, up to rounding).
        factor = float(scaling["factor"])
        base = spec.rope_theta * ((factor * spec.max_position / spec.max_position) - (factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (base**exponents)
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "proportional":  # LFM3's full layers: the first pairs rotate (over the whole head), the rest not
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv = torch.cat((inv[:angles], torch.zeros(dim // 2 - angles))) / float(scaling.get("factor", 1.0))
    elif kind == "yarn":
        return _yarn(spec, scaling, exponents)
    elif kind == "longrope":
        return _longrope(spec, scaling, exponents, seq_len)
    return inv, 1.0


def _dynamic_inv_freq(spec: ModelSpec, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK scaling's frequencies for sequences longer than ``max_position_embeddings``,
    one row per length, with the bits of transformers' forward pass: float32 arithmetic, but its
    power of a one-element tensor rounds as float64 does."""
    dim, factor = spec.rotated, float(spec.rope_scaling["factor"])  # type: ignore[index]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    ratio = (factor * seq_lens / spec.max_position) - (factor - 1)
    base = spec.rope_theta * (ratio.double() ** (dim / (dim - 2))).float()
    return 1.0 / (base[:, None] ** exponents)


def _longrope(
    spec: ModelSpec, scaling: dict[str, Any], exponents: torch.Tensor, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini) as transformers computes it: each pair's wavelength
    stretched by ``short_factor`` within the original context, by ``long_factor`` beyond it;
    cos and sin scaled by sqrt(1 + ln(factor) / ln(original length))."""
    old_ctx = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else spec.max_position / old_ctx
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    stretch = scaling["long_factor"] if seq_len and seq_len > old_ctx else scaling["short_factor"]
    return 1.0 / (torch.tensor(stretch, dtype=torch.float32) * spec.rope_theta**exponents), float(attention_factor)


def _yarn(spec: ModelSpec, scaling: dict[str, Any], exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: the fast-rotating pairs keep their
    frequency (extrapolate), the slow ones are divided by ``factor`` (interpolate), a linear
    ramp between, over the pairs that turn between ``beta_slow`` and ``beta_fast`` times in the
    original context; cos and sin scaled by 0.1 ln(factor) + 1 (or the config's mscale ratio)."""
    dim, base = spec.rotated, spec.rope_theta
    old_ctx = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else spec.max_position / old_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:  # the pair index that turns ``turns`` times in old_ctx
        return dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    freqs = base**exponents
    extrapolated, interpolated = 1.0 / freqs, 1.0 / (factor * freqs)
    keep = 1 - ramp  # 1: the pair keeps its frequency
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def rope_angles(spec: ModelSpec, max_len: int) -> tuple[torch.Tensor, float]:
    """The angle of every rotated pair at every position, ``[max_len, rotated / 2]``, and the
    tables' factor (:func:`rope_inv_freq`).

    LongRoPE and dynamic NTK change with the sequence's length; transformers recomputes them per
    forward pass from the longest position in it. Here a position's angles depend on the position
    alone (so that a step's batch, its chunking and the prefix cache change nothing): position
    ``p`` takes what transformers uses for a sequence of ``p + 1`` tokens. That is transformers'
    own result for every token it generates one at a time, and for whole prompts within the
    original context; a prompt beyond it is rotated there with the short factors (LongRoPE) or
    the original base (dynamic) in its first part, where transformers uses the long ones."""
    positions = torch.arange(max_len, dtype=torch.float32)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    inv, factor = rope_inv_freq(spec)
    if kind == "longrope":
        old_ctx = int(scaling["original_max_position_embeddings"])
        long_inv, _ = rope_inv_freq(spec, seq_len=old_ctx + 1)
        inv = torch.where((positions >= old_ctx)[:, None], long_inv, inv)
    elif kind == "dynamic" and max_len > spec.max_position:
        beyond = _dynamic_inv_freq(spec, torch.arange(spec.max_position + 1, max_len + 1))
        inv = torch.cat((inv.expand(spec.max_position, -1), beyond))
    return positions[:, None] * inv, factor


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length, computed once.

    Each row is laid out for :func:`apply_rotary`: dimension ``j`` pairs with ``j + head_dim/2``.
    With a partial rotary the passed dimensions (see :meth:`ModelSpec.qk_layout`) take cos 1 and
    sin 0."""

    def __init__(self, spec: ModelSpec, max_len: int) -> None:
        super().__init__()
        freqs, factor = rope_angles(spec, max_len)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * factor, emb.sin() * factor
        pairs, rest = freqs.shape[1], (spec.head_dim - spec.rotated) // 2
        passed = torch.zeros(max_len, rest)
        # HF's rotate_half(x) * sin is cat(-x2, x1) * sin; with the first half of sin negated it
        # is roll(x) * sin': the same products, one op instead of four.
        cos = torch.cat((cos[:, :pairs], passed + 1, cos[:, pairs:], passed + 1), dim=-1)
        sin = torch.cat((-sin[:, :pairs], passed, sin[:, pairs:], passed), dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.half = spec.head_dim // 2

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               rounded: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and (signed) sin rows for a step's positions, shaped to broadcast over heads, in
        ``dtype`` (first rounded to ``rounded``, Cohere's tables, if given)."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if rounded is not None:
            cos, sin = cos.to(rounded), sin.to(rounded)
        return cos.to(dtype), sin.to(dtype)


def query_position_scales(beta: float, original: float, max_len: int, shift: int = 0) -> torch.Tensor:
    """The factor on the query at each position up to ``max_len``, float32, as transformers
    computes it: Ministral 3's ``1 + beta * ln(1 + floor(position / original))``; Llama 4's
    temperature (``shift`` 1) ``1 + beta * ln(1 + floor((position + 1) / original))``."""
    if shift:
        return torch.log1p(torch.floor((torch.arange(max_len).float() + shift) / original)) * beta + 1.0
    positions = torch.arange(max_len)
    return 1 + beta * torch.log(1 + torch.floor(positions / original))


class RMSNorm(nn.Module):
    """``x / rms(x)`` times a weight per dimension: Llama's (the normalised ``x`` rounded to the
    model's dtype, then scaled), with ``float_scale`` gpt-oss's (scaled in float32, rounded once),
    or with ``offset`` Gemma's (scaled by ``1 + weight`` in float32, rounded once); ``weighted``
    False: no weight (Gemma 4's value norms and router input), normalised in float32, rounded once;
    ``centered`` and ``bias``: torch's LayerNorm (the LayerNorm families'); ``centered`` without a
    weight: torch's, in float32 (OLMo 1's)."""

    def __init__(self, size: int | tuple[int, ...], eps: float, offset: bool = False, float_scale: bool = False,
                 centered: bool = False, weighted: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size)) if weighted else None
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps
        self.offset = offset
        self.float_scale = float_scale or offset or centered
        self.centered = centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:  # torch's LayerNorm, as transformers runs it (its variance rounds otherwise)
            return F.layer_norm(x, self.bias.shape, self.weight, self.bias, self.eps)
        if self.centered and self.weight is None:  # OLMo 1's: torch's, in float32
            return F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps).to(x.dtype)
        dtype = x.dtype
        x = x.float()
        if self.centered:  # Cohere's LayerNorm (no bias): the deviation from the mean, normalised
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return x.to(dtype)
        if self.float_scale:
            return (x * self.scale()).to(dtype)
        return self.weight * x.to(dtype)

    def scale(self) -> torch.Tensor:
        """The float32 factor per dimension (what the C kernels multiply by)."""
        return 1.0 + self.weight.float() if self.offset else self.weight.float()


def _norm(spec: ModelSpec, size: int | tuple[int, ...], bias: bool | None = None) -> RMSNorm:
    """One of the model's norms, in its family's arithmetic (``bias`` None: as its norms have)."""
    return RMSNorm(size, spec.rms_norm_eps, spec.offset_norms, spec.float_norms, spec.centered_norms,
                   weighted=not spec.weightless_norms, bias=spec.norm_bias if bias is None else bias)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.kv_heads_of(layer), spec.head_dim_of(layer)
        self.q_size = spec.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen3-Next, Qwen3.5: a gate for every query dimension, after the values (out * sigmoid(gate));
        # LFM3: one for every head.
        self.gate_size = self.q_size if spec.gated_attention else spec.num_heads if spec.head_gates else 0
        # Gemma 4's shared layers: queries alone, attending to an earlier layer's cache.
        self.kv_source = spec.kv_source(layer)
        if self.kv_source != layer:
            self.kv_size = 0
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size + self.gate_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        # OPT's: the queries scaled as they leave their projection, the scores not again
        self.query_prescale = spec.attention_scale if spec.prescaled_queries else None
        self.scale = 1.0 if spec.prescaled_queries else spec.attention_scale
        self.softcap = spec.attn_softcap
        self.half = self.head_dim // 2
        self.sliding = spec.window_of(layer) is not None
        self.rotates = layer not in spec.nope_layers
        self.whole_qk_norm = spec.qk_norm_whole
        self.norm_after_rotary = spec.qk_norm_after_rotary or spec.weightless_qk_norm
        q_norm, k_norm = (self.q_size, self.kv_size) if self.whole_qk_norm else (self.head_dim, self.head_dim)
        if spec.qk_norm_per_head:  # Command R+: a weight of its own for every head
            q_norm, k_norm = (spec.num_heads, spec.head_dim), (spec.num_kv_heads, spec.head_dim)
        self.v_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, weighted=False) if spec.value_norms else None
        self.q_norm = _norm(spec, q_norm, bias=False) if spec.qk_norm else None  # StableLM's have no bias either
        self.k_norm = _norm(spec, k_norm, bias=False) if spec.qk_norm and self.kv_size else None
        if spec.weightless_qk_norm and self.rotates:  # Llama 4's: no weight, on the rotating layers only
            self.q_norm = self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, weighted=False)
        # The queries scaled by position: all of Ministral 3's, Llama 4's NoPE layers'.
        self.scaled_queries = spec.query_position_scaling is not None or (
            spec.nope_temperature is not None and not self.rotates)
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads)) if spec.attention_sinks else None
        self.clip_qkv = spec.clip_qkv
        self.register_buffer("alibi", None, persistent=False)  # ALiBi's slopes [heads], float32 (CausalLM._rotaries')

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q_scale``: each row's factor on its rotated query ``[n, 1, 1]`` (Ministral 3's in the
        model's dtype, Llama 4's in float32, the product rounded), or None."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:  # OLMo 1
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        if not self.kv_size:  # Gemma 4's shared layers: the queries over an earlier layer's keys and values
            q = qkv.view(n, self.num_heads, self.head_dim)
            q = self.q_norm(q) if self.q_norm is not None else q
            q = apply_rotary(q, *rope, self.half).to(qkv.dtype) if self.rotates else q
            out = paged_attention(q, None, None, meta, self.kv_source, self.scale, self.sliding, self.softcap, self.sinks)
            return self.o_proj(out.reshape(n, self.q_size))
        if self.whole_qk_norm:  # OLMo: each projection normalised as one vector
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1).view(n, -1, self.head_dim)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim)
            if self.q_norm is not None and not self.norm_after_rotary:  # Qwen3, Gemma 3: each head normalised
                qk = self._head_norms(qk)
        if self.rotates:  # q and k together: one set of ops for both (float32 tables: OLMo's, rounded once)
            qk = apply_rotary(qk, *rope, self.half).to(qkv.dtype)
        if self.norm_after_rotary and self.q_norm is not None:  # Hunyuan, Llama 4: the rotated heads normalised
            qk = self._head_norms(qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.query_prescale is not None:  # OPT (no rotary: the projection's output as it is)
            q = q * self.query_prescale
        if q_scale is not None and self.scaled_queries:
            q = (q * q_scale).to(qk.dtype)
        v = qkv[:, self.q_size + self.kv_size : self.q_size + 2 * self.kv_size].view(n, self.num_kv_heads, self.head_dim)
        if self.v_norm is not None:  # Gemma 4: each value head normalised, no weight
            v = self.v_norm(v)
        out = paged_attention(q, k, v, meta, self.layer, self.scale, self.sliding, self.softcap, self.sinks, self.alibi)
        if self.gate_size:
            gates = torch.sigmoid(qkv[:, -self.gate_size :])
            out = out * (gates.view(n, -1, 1) if self.gate_size == self.num_heads else gates.view(out.shape))
        return self.o_proj(out.reshape(n, self.q_size))

    def _head_norms(self, qk: torch.Tensor) -> torch.Tensor:
        """Each query head through ``q_norm``, each key head through ``k_norm`` (``qk``: the
        step's query heads, then its key heads)."""
        return torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)


class XieluMLP(nn.Module):
    """Apertus's MLP: ``down(xielu(up(x)))``, not gated, with xIELU (arXiv 2411.13010), whose two
    slopes are learned per layer: ``alpha_p x^2 + beta x`` for positive ``x``, else
    ``alpha_n (expm1(min(x, eps)) - x) + beta x``, ``alpha_p = softplus(a_p)``, ``alpha_n = beta +
    softplus(a_n)``, in the model's dtype as transformers computes it."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        self.beta = nn.Parameter(torch.empty(()), requires_grad=False)
        self.eps = nn.Parameter(torch.empty(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up_proj(x)
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        positive = alpha_p * x * x + self.beta * x
        negative = (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x
        return self.down_proj(torch.where(x > 0, positive, negative))

    def load(self, prefix: str, weights: WeightReader) -> None:
        """``prefix``: ``layers.N.mlp.``; the activation's slopes under ``act_fn.``, and its
        ``beta`` and ``eps`` (transformers' defaults, 0.5 and -1e-6, where a checkpoint has none)."""
        weights.copy(self.up_proj.weight, prefix + "up_proj.weight")
        weights.copy(self.down_proj.weight, prefix + "down_proj.weight")
        for name, default in (("alpha_p", None), ("alpha_n", None), ("beta", 0.5), ("eps", -1e-6)):
            key = f"{prefix}act_fn.{name}"
            value = torch.tensor(default) if default is not None and not weights.has(key) else None
            weights.copy(getattr(self, name), key, value)


class PlainMLP(nn.Module):
    """An ungated MLP, ``down(act(up(x)))``: squared ReLU (Nemotron-H's blocks and experts,
    Arcee's, Jais 2's, Nemotron's), a GELU (``activation``: StarCoder2's tanh form, Phi's
    ``gelu_new``, BLOOM's, GPT-NeoX's and MPT's exact one) or a ReLU (OPT's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "relu2") -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.activation == "relu2":
            h = torch.square(F.relu(h))
        elif self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu_new":  # step by step in the model's dtype, as transformers rounds it
            h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        elif self.activation == "bloom_gelu":  # the same form, BLOOM's constants and order
            h = h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(h)

    def load(self, prefix: str, weights: WeightReader) -> None:
        """``prefix``: ``layers.N.mlp.`` (or an expert's)."""
        for name in ("up_proj", "down_proj"):
            linear = getattr(self, name)
            weights.copy(linear.weight, f"{prefix}{name}.weight")
            if linear.bias is not None:
                weights.copy(linear.bias, f"{prefix}{name}.bias")


class MLP(nn.Module):
    """A gated MLP, ``down(act(gate(x)) * up(x))`` with gate and up in one matmul: SwiGLU
    (``act`` SiLU), or Gemma's GeGLU (``activation="gelu_tanh"``: GELU's tanh form), or with
    ``clamp = (alpha, limit)`` gpt-oss's experts' clamped SwiGLU: the gate clamped to at most
    ``limit``, up to within it, ``gate * sigmoid(alpha * gate) * (up + 1)``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu",
        clamp: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        self.intermediate = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gelu = activation == "gelu_tanh"
        self.clamp = clamp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        if self.clamp is not None:
            alpha, limit = self.clamp
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * alpha)))
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Norm, attention, residual add; norm, MLP, residual add. Gemma 2/3 also normalise each
    block's output before its add (``attn_out_norm``, ``mlp_out_norm``), OLMo 2/3 do instead of
    normalising its input; Granite scales it (``residual_scale``); Falcon-H1 adds a Mamba2
    mixer's output to the attention's (``mamba``)."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        norm = lambda: _norm(spec, spec.hidden_size)  # noqa: E731
        # OLMo Hybrid's linear layers normalise inputs as Llama's, its attention layers outputs as OLMo's.
        prenorm = spec.prenorm_linear_layers and layer in spec.linear_layers
        input_norms, sandwich = spec.input_norms or prenorm, spec.sandwich_norms and not prenorm
        self.input_layernorm = norm() if input_norms else None
        self.self_attn: Attention | LatentAttention | ShortConv | GatedDeltaNet | Mamba2Mixer | None
        self.mlp: MLP | SparseMoE | XieluMLP | PlainMLP | None
        self.block = spec.block_kinds[layer] if spec.block_kinds else None
        self.mamba = None  # Falcon-H1's Mamba2 mixer beside the attention
        self.moe = None  # Gemma 4's experts beside the MLP
        if self.block is not None:  # Nemotron-H: one block, one kind
            self._single_block(spec, layer)
            return
        if spec.parallel_mamba:
            self.self_attn = Attention(spec, layer)
            self.mamba = Mamba2Mixer(spec.hidden_size, spec.mamba, spec.rms_norm_eps, layer)
        elif layer in spec.conv_layers:  # LFM2: a short convolution in attention's place
            self.self_attn = ShortConv(spec.hidden_size, spec.conv_kernel, spec.conv_bias, layer)
        elif layer in spec.linear_layers and spec.mamba is not None:  # Granite 4's hybrids
            self.self_attn = Mamba2Mixer(spec.hidden_size, spec.mamba, spec.rms_norm_eps, layer)
        elif layer in spec.linear_layers:  # Qwen3-Next, Qwen3.5: linear attention
            self.self_attn = GatedDeltaNet(spec.hidden_size, spec.delta, spec.rms_norm_eps, layer)
        elif spec.latent is not None:
            self.self_attn = LatentAttention(spec.hidden_size, spec.num_heads, spec.latent, spec.o_bias, layer,
                                             spec.attention_scale, lambda size: RMSNorm(size, LATENT_NORM_EPS))
        else:
            self.self_attn = Attention(spec, layer)
        # Llama's name for the MLP's input norm (Cohere's MLP reads the attention's input, GPT-NeoX's
        # a norm of its own of the same input)
        self.post_attention_layernorm = norm() if input_norms and (
            not spec.parallel_blocks or spec.parallel_mlp_norm) else None
        self.parallel = spec.parallel_blocks
        self.residual_last = spec.parallel_residual_last
        self.attn_out_norm = norm() if sandwich else None
        self.mlp_out_norm = norm() if sandwich else None
        self.residual_scale = spec.residual_scale
        # Gemma 4: the layer's whole output (the residual stream) times its layer_scalar
        self.scalar = nn.Parameter(torch.ones(1), requires_grad=False) if spec.layer_scalars else None
        if spec.activation == "xielu":
            self.mlp = XieluMLP(spec.hidden_size, spec.intermediate_size)
        elif spec.ungated_mlp:
            self.mlp = PlainMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, spec.activation)
        elif spec.is_sparse(layer) and not spec.experts_beside_mlp:
            self.mlp = SparseMoE(spec, lambda size: MLP(
                spec.hidden_size, size, spec.expert_bias, spec.activation, spec.clamped_swiglu
            ))
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_of(layer), spec.mlp_bias, spec.activation)
        self.per_layer_gate = self.per_layer_up = self.per_layer_norm = None
        if spec.per_layer_input_size:  # Gemma 4 E2B, E4B: the layer's own embedding gates a residual branch
            self.per_layer_gate = nn.Linear(spec.hidden_size, spec.per_layer_input_size, bias=False)
            self.per_layer_up = nn.Linear(spec.per_layer_input_size, spec.hidden_size, bias=False)
            self.per_layer_norm = norm()
            self.per_layer_gelu = spec.activation == "gelu_tanh"  # the config's hidden_activation, as the MLP's
        if spec.experts_beside_mlp and spec.is_sparse(layer):  # Gemma 4: the input, the MLP's and the experts'
            # outputs normed apart (pre_feedforward_layernorm_2, post_feedforward_layernorm_1 and _2)
            self.moe = SparseMoE(spec, lambda size: MLP(spec.hidden_size, size, False, spec.activation),
                                 router_norm=RMSNorm(spec.hidden_size, spec.rms_norm_eps, weighted=False))
            self.moe_in_norm, self.dense_out_norm, self.moe_out_norm = norm(), norm(), norm()

    def _single_block(self, spec: ModelSpec, layer: int) -> None:
        """A Nemotron-H block: its norm, then its one mixer (Mamba2, attention) or MLP (ungated,
        or experts of ungated ones)."""
        self.self_attn = self.mlp = None
        if self.block == "mamba":
            self.self_attn = Mamba2Mixer(spec.hidden_size, spec.mamba, spec.rms_norm_eps, layer)
        elif self.block == "attention":
            self.self_attn = Attention(spec, layer)
        elif self.block == "moe":
            self.mlp = SparseMoE(spec, lambda size: PlainMLP(spec.hidden_size, size),
                                 lambda size: PlainMLP(spec.hidden_size, size, spec.mlp_bias))
        else:
            self.mlp = PlainMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias)
        self.post_attention_layernorm = self.attn_out_norm = self.mlp_out_norm = self.scalar = None
        self.parallel, self.residual_scale = False, None

    @property
    def sliding(self) -> bool:
        """Whether the layer's attention slides (takes the local rotary tables)."""
        return self.self_attn is not None and self.self_attn.sliding

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
        q_scale: torch.Tensor | None = None, per_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``per_layer``: the layer's per-layer embedding of each row (Gemma 4 E2B, E4B), or None."""
        normed = _normed(self.input_layernorm, x)
        if self.block is not None:  # one block: its mixer or its MLP, added to the residual
            return x + (self.self_attn(normed, rope, meta, q_scale) if self.self_attn is not None else self.mlp(normed))
        h = self.self_attn(normed, rope, meta, q_scale)
        if self.mamba is not None:  # Falcon-H1: both mixers from the same input, summed
            h = self.mamba(normed, rope, meta) + h
        if self.parallel:  # Cohere, Phi, GPT-J, GPT-NeoX, Falcon: both blocks from the same input, both added to it
            m = self.mlp(normed if self.post_attention_layernorm is None else self.post_attention_layernorm(x))
            return h + m + x if self.residual_last else x + h + m
        x = x + self._branch(h, self.attn_out_norm)
        h = self.mlp(_normed(self.post_attention_layernorm, x))
        if self.moe is not None:  # Gemma 4: the experts' output beside the MLP's, routed from the residual
            h = self.dense_out_norm(h) + self.moe_out_norm(self.moe(self.moe_in_norm(x), routed=x))
        x = x + self._branch(h, self.mlp_out_norm)
        if self.per_layer_gate is not None:  # Gemma 4 E2B, E4B: act(gate(x)) times the layer's embedding, back up
            gate = self.per_layer_gate(x)
            h = (F.gelu(gate, approximate="tanh") if self.per_layer_gelu else F.silu(gate)) * per_layer
            x = x + self.per_layer_norm(self.per_layer_up(h))
        return x if self.scalar is None else x * self.scalar

    def _branch(self, h: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """A block's output as it joins the residual stream."""
        if norm is not None:
            return norm(h)
        return h if self.residual_scale is None else h * self.residual_scale


def _load_norm(norm: RMSNorm, name: str, weights: WeightReader, less_one: bool = False) -> None:
    """A norm's weight (``name.weight``; ``less_one``: stored less one, Nemotron's; none for OLMo
    1's) and its bias where it has one (the LayerNorms')."""
    if norm.weight is None:
        return
    weights.copy(norm.weight, name + ".weight", weights.take(name + ".weight").to(norm.weight.dtype) + 1 if less_one else None)
    if norm.bias is not None:
        weights.copy(norm.bias, name + ".bias")


def _grouped_qkv(value: torch.Tensor, attn: Attention) -> list[torch.Tensor]:
    """A fused ``query_key_value``'s rows (or bias) by key-value group, ``[kv_heads, (the group's
    queries, k, v), head_dim]``, as the q, k and v projections' rows: GPT-NeoX's (a group a
    head: ``[q, k, v]`` head by head), Falcon 40B's grouped queries, Falcon 7B's one group
    (every query head, then k and v)."""
    rest = value.shape[1:]
    groups = value.view(attn.num_kv_heads, attn.num_heads // attn.num_kv_heads + 2, attn.head_dim, *rest)
    return [groups[:, :-2].reshape(-1, *rest), groups[:, -2].reshape(-1, *rest), groups[:, -1].reshape(-1, *rest)]


def _qk_norm_weight(weights: WeightReader, name: str, norm: RMSNorm) -> torch.Tensor:
    """A query or key norm's weight: ``name.weight``, or StableLM's LayerNorm a head
    (``name.norms.H.weight``) stacked as ``norm``'s ``[heads, head_dim]``."""
    if not weights.has(name + ".norms.0.weight"):
        return weights.take(name + ".weight")
    return torch.stack([weights.take(f"{name}.norms.{h}.weight") for h in range(norm.weight.shape[0])])


def _rows(tables: tuple[torch.Tensor, ...], rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A step's rotary rows (cos, signed sin) for ``rows`` alone."""
    return tuple(t[rows] for t in tables)


def _normed(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class CausalLM(nn.Module):
    """The whole decoder: token ids and positions in, logits for chosen rows out."""

    def __init__(self, spec: ModelSpec, max_len: int) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = _norm(spec, spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=spec.lm_head_bias)
        self.embed_positions = nn.Embedding(spec.max_position, spec.hidden_size) if spec.learned_positions else None
        self.embed_norm = _norm(spec, spec.hidden_size) if spec.embedding_norm else None  # BLOOM's
        self.per_layer_embed = self.per_layer_projection = self.per_layer_norm = None
        if spec.per_layer_input_size:  # Gemma 4 E2B, E4B: every layer's embedding of a token in one row
            width = spec.num_layers * spec.per_layer_input_size
            self.per_layer_embed = nn.Embedding(spec.per_layer_vocab, width)
            self.per_layer_projection = nn.Linear(spec.hidden_size, width, bias=False)
            self.per_layer_norm = _norm(spec, spec.per_layer_input_size)
        self._rotaries(max_len)
        self._embed_scales: dict[torch.dtype, float] = {}
        # The layer from which only the rows whose logits are wanted are computed (Gemma 4's shared
        # layers, ModelSpec.cacheless_from); None: every layer computes every row.
        self.wanted_rows_from = spec.cacheless_from

    def _rotaries(self, max_len: int) -> None:
        """The rotary tables: every layer's, or (Gemma 3) the full-attention layers' in ``rotary``
        and the sliding-window layers' in ``local_rotary``; Ministral 3's and Llama 4's query scales
        by position (``query_scales``, else None); ALiBi's slopes (each attention's ``alibi``)."""
        local = self.spec.local_rope()
        self.rotary = Rotary(self.spec.full_rope(), max_len)
        self.local_rotary = Rotary(local, max_len) if local is not None else None
        scales = None
        if (scaling := self.spec.query_position_scaling) is not None:
            scales = query_position_scales(*scaling, max_len)
        elif (tuning := self.spec.nope_temperature) is not None:
            scales = query_position_scales(*tuning, max_len, shift=1)
        self.register_buffer("query_scales", scales, persistent=False)  # moves with the model, as the tables do
        if self.spec.alibi:
            for layer in self.layers:
                layer.self_attn.register_buffer("alibi", torch.tensor(self.spec.alibi, dtype=torch.float32),
                                                persistent=False)

    def embed_scale(self, dtype: torch.dtype) -> float | None:
        """The embeddings' factor: Granite's as it is, Gemma's rounded to ``dtype`` (transformers
        multiplies by it as a tensor of the weights' dtype: sqrt(3072) = 55.43 is 55.5 in
        bfloat16); None: no factor."""
        if self.spec.embed_scale is None or not self.spec.embed_scale_rounded:
            return self.spec.embed_scale
        scale = self._embed_scales.get(dtype)
        if scale is None:
            scale = self._embed_scales[dtype] = float(torch.tensor(self.spec.embed_scale).to(dtype))
        return scale

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer embeddings ``[tokens, layers, size]`` of the tokens whose scaled
        embeddings are ``x``: the table's rows (times sqrt(size), rounded as the embeddings'
        factor is) and a normed projection of ``x`` (times hidden_size ** -0.5), their sum times
        2 ** -0.5, as transformers computes them."""
        spec = self.spec
        shape = (x.shape[0], spec.num_layers, spec.per_layer_input_size)
        table = self.per_layer_embed(input_ids) * float(torch.tensor(spec.per_layer_input_size**0.5).to(x.dtype))
        projected = self.per_layer_norm((self.per_layer_projection(x) * spec.hidden_size**-0.5).view(shape))
        return (projected + table.view(shape)) * 2**-0.5

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output as the model gives it: Gemma 2's cap (``cap * tanh(logits /
        cap)``), Granite's division by ``logits_scaling``, Cohere's ``logit_scale``; as it is for
        the others."""
        cap, scaling = self.spec.final_softcap, self.spec.logits_scaling
        if scaling is not None:
            logits = logits / scaling
        if self.spec.logit_scale is not None:
            logits = logits * self.spec.logit_scale
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @classmethod
    def from_state_dict(
        cls, spec: ModelSpec, max_len: int, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
        pack: Callable[[nn.Module], None] | None = None,
    ) -> "CausalLM":
        """The model with ``state``'s tensors as its weights, in ``dtype`` (taken out of
        ``state``). Built on the meta device first, so that no memory is allocated and randomly
        initialised for weights about to be replaced, and a bfloat16 checkpoint for a bfloat16
        model is never widened to float32 on the way.

        ``pack`` (a weight format's packing, :mod:`.quantize`): called on each decoder layer as
        soon as its weights are in, then on the whole model (what is left: the LM head), so that
        a packed model is never whole in ``dtype``: loading holds the packed layers and one layer
        in ``dtype``, not the float model too."""
        with torch.device("meta"):
            model = cls(spec, 1).to(dtype)
            for module in model.modules():
                if isinstance(module, SparseMoE):
                    module.keep_float_router()
        model._rotaries(max_len)  # computed, not loaded
        model.load_hf_state_dict(state, pack)
        _all_loaded(model)
        if pack is not None:
            pack(model)
        return model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if (scale := self.embed_scale(x.dtype)) is not None:
            x = x * scale
        if self.embed_positions is not None:  # GPT-2's: positions past the table are never admitted (context_length)
            x = x + self.embed_positions(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        rope_dtype = torch.float32 if self.spec.float_rotary else x.dtype
        rope = self.rotary.tables(positions, rope_dtype, x.dtype if self.spec.rounded_rotary_tables else None)
        local = self.local_rotary.tables(positions, rope_dtype) if self.local_rotary is not None else rope
        q_scale = None
        if self.query_scales is not None:  # Llama 4's stays float32, as transformers multiplies by it
            q_scale = self.query_scales[positions][:, None, None]
            q_scale = q_scale if self.spec.nope_temperature is not None else q_scale.to(x.dtype)
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_embed is not None else None
        for i, layer in enumerate(self.layers):
            if i == self.wanted_rows_from and meta.prefills:
                # Gemma 4's shared layers write nothing a later step reads: past them only the rows
                # whose logits are wanted matter, so the others (a prompt chunk's but its last) stop here.
                rows = meta.wanted_rows if meta.wanted_rows is not None else logits_rows.tolist()
                if not rows:
                    break
                cut = only_rows(meta, rows) if len(rows) < x.shape[0] else None
                if cut is not None:
                    x, meta, rope, local = x[logits_rows], cut, _rows(rope, logits_rows), _rows(local, logits_rows)
                    q_scale = q_scale[logits_rows] if q_scale is not None else None
                    per_layer = per_layer[logits_rows] if per_layer is not None else None
                    logits_rows = torch.arange(len(rows), device=x.device)
            x = layer(x, local if layer.sliding else rope, meta, q_scale, per_layer[:, i] if per_layer is not None else None)
        # Only rows that sample need the (large) vocabulary projection.
        return self.final_logits(self.lm_head(self.norm(x[logits_rows])))

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], loaded: Callable[[nn.Module], None] | None = None) -> None:
        """Copy weights named as in Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM (and the
        other supported architectures' own names). ``loaded``: called on each decoder layer once
        its weights are all in."""
        spec = self.spec
        if spec.block_kinds:
            _name_blocks(state, spec.block_kinds)
        scales = dict(spec.weight_scales)
        fused = next((key for key in state if scales and key.endswith(("qkv_proj.weight", "gate_up_proj.weight"))), None)
        if fused is not None:  # the factors are a projection's each, by its name
            raise ModelError(f"weight `{fused}`: a fused projection in a checkpoint whose multipliers scale q, k, v, "
                             "gate and up apart is not supported")
        weights = WeightReader(state, ModelError, self, fp8=spec.fp8_block if spec.fp8_weights else False,
                               scales=scales)
        weights.copy(self.embed_tokens.weight, "embed_tokens.weight")
        if self.embed_positions is not None:
            weights.copy(self.embed_positions.weight, "embed_positions.weight",
                         weights.take("embed_positions.weight")[spec.position_table_offset:])
        if self.embed_norm is not None:
            _load_norm(self.embed_norm, "embed_norm", weights)
        rows, layout = spec.qkv_row_order(), spec.qk_layout()  # partial rotary: see qk_layout

        def reorder(value: torch.Tensor) -> torch.Tensor:
            return value if rows is None or value.shape[0] != rows.numel() else value[rows]

        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn = layer.self_attn
            if layer.block is not None:  # Nemotron-H: one block's weights, then its norm
                self._load_block(layer, p, weights, reorder)
                if loaded is not None:
                    _all_loaded(layer, p)
                    loaded(layer)
                continue
            if isinstance(attn, ShortConv):
                attn.load(p + "conv.", weights)
            elif isinstance(attn, GatedDeltaNet):
                attn.load(p + "linear_attn.", weights)
            elif isinstance(attn, Mamba2Mixer):
                attn.load(p + "mamba.", weights)
            elif isinstance(attn, LatentAttention):
                attn.load(p + "self_attn.", weights, layout)
            else:
                self._load_attention(attn, p, weights, reorder)
            if layer.mamba is not None:
                layer.mamba.load(p + "mamba.", weights)
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.load(p, weights)
            elif isinstance(layer.mlp, (XieluMLP, PlainMLP)):
                layer.mlp.load(p + "mlp.", weights)
            elif weights.has(p + "shared_mlp.input_linear.weight"):  # Granite 4's dense models: gate and up fused
                load_fused_mlp(layer.mlp, p + "shared_mlp.", weights)
            else:
                load_mlp(layer.mlp, p + "mlp.", weights)
            if spec.qk_norm and isinstance(attn, Attention):
                for name in ("q_norm", "k_norm") if attn.k_norm is not None else ("q_norm",):
                    norm = _qk_norm_weight(weights, p + f"self_attn.{name}", getattr(attn, name))
                    if layout is not None and spec.qk_norm_per_head:  # [heads, head_dim]
                        norm = norm[:, layout]
                    elif layout is not None and norm.shape == layout.shape:
                        norm = norm[layout]
                    elif layout is not None and spec.qk_norm_whole:  # MiniMax-M2's: each head's dimensions move
                        norm = norm.view(-1, spec.head_dim)[:, layout].flatten()
                    weights.copy(getattr(attn, name).weight, p + f"self_attn.{name}.weight", norm)
            if layer.input_layernorm is not None:
                _load_norm(layer.input_layernorm, p + "input_layernorm", weights, spec.norms_less_one)
            if spec.glm_norm_names:
                weights.copy(layer.attn_out_norm.weight, p + "post_self_attn_layernorm.weight")
                weights.copy(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
                weights.copy(layer.mlp_out_norm.weight, p + "post_mlp_layernorm.weight")
            elif layer.attn_out_norm is not None:  # Gemma 2/3 and OLMo name the attention's output norm post_attention_layernorm
                weights.copy(layer.attn_out_norm.weight, p + "post_attention_layernorm.weight")
                if layer.post_attention_layernorm is not None:
                    weights.copy(layer.post_attention_layernorm.weight, p + "pre_feedforward_layernorm.weight")
                weights.copy(layer.mlp_out_norm.weight, p + "post_feedforward_layernorm.weight")
            elif layer.post_attention_layernorm is not None:
                _load_norm(layer.post_attention_layernorm, p + "post_attention_layernorm", weights, spec.norms_less_one)
            if layer.moe is not None:  # Gemma 4's, under the layer itself
                layer.moe.load(p, weights)
                for norm, name in ((layer.moe_in_norm, "pre_feedforward_layernorm_2"),
                                   (layer.dense_out_norm, "post_feedforward_layernorm_1"),
                                   (layer.moe_out_norm, "post_feedforward_layernorm_2")):
                    weights.copy(norm.weight, p + name + ".weight")
            if layer.per_layer_gate is not None:
                weights.copy(layer.per_layer_gate.weight, p + "per_layer_input_gate.weight")
                weights.copy(layer.per_layer_up.weight, p + "per_layer_projection.weight")
                weights.copy(layer.per_layer_norm.weight, p + "post_per_layer_input_norm.weight")
            if layer.scalar is not None:
                weights.copy(layer.scalar, p + "layer_scalar")
            if loaded is not None:
                _all_loaded(layer, p)
                loaded(layer)
        _load_norm(self.norm, "norm", weights, spec.norms_less_one)
        if self.per_layer_embed is not None:
            weights.copy(self.per_layer_embed.weight, "embed_tokens_per_layer.weight")
            weights.copy(self.per_layer_projection.weight, "per_layer_model_projection.weight")
            weights.copy(self.per_layer_norm.weight, "per_layer_projection_norm.weight")
        # Every expert the config has was taken; the layers past the last (GLM-4.5's multi-token
        # prediction layer) and the tensors of no decoder layer (ERNIE 4.5's mtp_block), which
        # the engine does not run, are left unread.
        extra = next((key for key in state if ".experts." in key and 0 <= _layer_of(key) < spec.num_layers), None)
        if extra is not None:
            raise ModelError(f"weight `{extra}`: the checkpoint has more experts than the config's {spec.num_experts}")
        if spec.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head.weight = self.embed_tokens.weight
            state.pop("lm_head.weight", None)
        else:
            weights.copy(self.lm_head.weight, "lm_head.weight")
        if spec.lm_head_bias:
            weights.copy(self.lm_head.bias, "lm_head.bias")


    def _load_attention(self, attn: Attention, p: str, weights: WeightReader,
                        reorder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Layer ``p``'s q, k, v (fused, their rotated rows moved by ``reorder``), o and sinks."""
        spec = self.spec
        fused = p + "self_attn.qkv_proj.weight"  # Phi-3 stores q, k and v as one matrix, as we do
        grouped = p + "self_attn.query_key_value."  # GPT-NeoX's and Falcon's: q, k and v rows by group
        if weights.has(fused):
            qkv = reorder(weights.take(fused))
        elif weights.has(grouped + "weight"):
            qkv = self._gated(attn, _grouped_qkv(weights.take(grouped + "weight"), attn), reorder)
        else:
            names = "q" if not attn.kv_size else "qk" if spec.values_from_keys and not attn.sliding else "qkv"
            parts = [weights.take(p + f"self_attn.{n}_proj.weight") for n in names]
            if len(parts) == 2:  # Gemma 4's attention_k_eq_v: its full layers' values are the keys' projection
                parts.append(parts[1])
            qkv = self._gated(attn, parts, reorder)
            if spec.head_gates:  # LFM3: a gate a head, its own projection's rows after q, k and v
                qkv = torch.cat((qkv, weights.take(p + "self_attn.g_proj.weight")))
        weights.copy(attn.qkv_proj.weight, fused, qkv)
        if spec.qkv_bias and weights.has(p + "self_attn.qkv_proj.bias"):  # GPT-2's and GPTBigCode's, fused as ours
            weights.copy(attn.qkv_proj.bias, p + "self_attn.qkv_proj.bias", reorder(weights.take(p + "self_attn.qkv_proj.bias")))
        elif spec.qkv_bias and weights.has(grouped + "bias"):
            weights.copy(attn.qkv_proj.bias, p + "qkv bias", self._gated(attn, _grouped_qkv(weights.take(grouped + "bias"), attn),
                                                                         reorder))
        elif spec.qkv_bias:
            bias = self._gated(attn, [weights.take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], reorder)
            if spec.head_gates:  # g_proj has none
                bias = torch.cat((bias, bias.new_zeros(attn.num_heads)))
            weights.copy(attn.qkv_proj.bias, p + "qkv bias", bias)
        weights.copy(attn.o_proj.weight, p + "self_attn.o_proj.weight")
        if spec.o_bias:
            weights.copy(attn.o_proj.bias, p + "self_attn.o_proj.bias")
        if attn.sinks is not None:
            weights.copy(attn.sinks, p + "self_attn.sinks")


    def _load_block(self, layer: DecoderLayer, p: str, weights: WeightReader,
                    reorder: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A Nemotron-H block's weights, named by :func:`_name_blocks`."""
        if isinstance(layer.self_attn, Mamba2Mixer):
            layer.self_attn.load(p + "mamba.", weights)
        elif layer.self_attn is not None:
            self._load_attention(layer.self_attn, p, weights, reorder)
        elif isinstance(layer.mlp, SparseMoE):
            layer.mlp.load(p, weights)
        else:
            layer.mlp.load(p + "mlp.", weights)
        weights.copy(layer.input_layernorm.weight, p + "input_layernorm.weight")

    @staticmethod
    def _gated(attn: Attention, qkv: list[torch.Tensor], reorder: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """q, k and v's rows as one (their rotated rows moved by ``reorder``), then the gates';
        a gated checkpoint's q_proj holds each head's query rows, then that head's gate rows."""
        gate = None
        if attn.gate_size == attn.q_size:  # Qwen3-Next's and Qwen3.5's gates (LFM3's have a projection of their own)
            if qkv[0].shape[0] != 2 * attn.q_size:
                raise ModelError(f"q_proj has {qkv[0].shape[0]} rows; gated attention needs {2 * attn.q_size}: a query "
                                 f"and a gate of {attn.head_dim} for each of the {attn.num_heads} heads")
            heads = qkv[0].view(attn.num_heads, 2, attn.head_dim, *qkv[0].shape[1:])
            qkv[0], gate = heads[:, 0].flatten(0, 1), heads[:, 1].flatten(0, 1)
        merged = reorder(torch.cat(qkv))
        return merged if gate is None else torch.cat((merged, gate))


BLOCK_PARTS = {"mamba": "mamba.", "attention": "self_attn.", "mlp": "mlp.", "moe": "mlp."}
"""Where a Nemotron-H block's ``mixer.`` weights go, by its kind: the names our layers read."""


def _name_blocks(state: dict[str, torch.Tensor], kinds: tuple[str, ...]) -> None:
    """Rename a Nemotron-H checkpoint's block weights (``layers.N.mixer.`` and ``layers.N.norm.``)
    in place to the names our layers read, by each block's kind."""
    for key in list(state):
        found = re.match(r"((?:model\.)?layers\.(\d+)\.)(mixer\.|norm\.)", key)
        if found is None or int(found.group(2)) >= len(kinds):
            continue
        part = BLOCK_PARTS[kinds[int(found.group(2))]] if found.group(3) == "mixer." else "input_layernorm."
        state[found.group(1) + part + key[found.end():]] = state.pop(key)


def _layer_of(key: str) -> int:
    """The decoder layer a checkpoint's tensor belongs to (``layers.N.``); -1: none."""
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
    return int(found.group(1)) if found else -1


def _all_loaded(module: nn.Module, prefix: str = "") -> None:
    """Refuse a module some of whose weights the checkpoint did not give (still on the meta device)."""
    missing = next((name for name, p in module.named_parameters() if p.is_meta), None)
    if missing is not None:
        raise ModelError(f"checkpoint has no weight `{prefix}{missing}`")
