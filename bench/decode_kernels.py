"""Where one token's time goes at batch 1 on a CPU: memory bandwidth against the projection kernels.

A decode step at batch 1 multiplies one activation row by every weight matrix once. This script
times that part alone, on SmolLM2-135M's shapes (30 layers of fused qkv 960x576, o 576x576,
fused gate/up 3072x576, down 576x1536, then the 49,152x576 LM head), with fresh random weights
(so they come from memory, not cache), next to the machine's plain read bandwidth (a float32 sum
over 512 MiB). It answers "how fast could a token be if the projections ran at memory speed" for
the torch engine's CPU weight formats: float32 (``native``) and float16 through fbgemm (``fp16``).

    .venv/bin/python bench/decode_kernels.py
"""

from __future__ import annotations

import time

import torch

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)
REPS = 5


def timed(fn, reps: int = REPS) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    torch.manual_seed(0)
    print(f"threads: {torch.get_num_threads()}, torch {torch.__version__}")
    big = torch.randn(128 * 2**20)
    read = timed(lambda: big.sum())
    print(f"plain read bandwidth (float32 sum of 512 MiB): {big.numel() * 4 / read / 1e9:.1f} GB/s")
    del big

    weights = [torch.randn(n, k) for _ in range(LAYERS) for n, k in SHAPES] + [torch.randn(*LM_HEAD)]
    rows = {k: torch.randn(1, k) for k in (576, 1536)}
    n_params = sum(w.numel() for w in weights)
    packed = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in weights]
    halves = [w.half() for w in weights]
    half_rows = {k: v.half() for k, v in rows.items()}
    variants = {
        "float32 (F.linear, MKL)": (4, lambda: [torch.nn.functional.linear(rows[w.shape[1]], w) for w in weights]),
        "float16 weights (fbgemm, float32 activations)": (
            2, lambda: [torch.ops.quantized.linear_dynamic_fp16(rows[w.shape[1]], p) for w, p in zip(weights, packed)]),
        "float16 weights and activations (F.linear)": (
            2, lambda: [torch.nn.functional.linear(half_rows[w.shape[1]], w) for w in halves]),
    }
    print(f"\nall projections of one token at batch 1 ({n_params / 1e6:.1f} M weights):")
    print(f"{'kernel':<48} {'ms':>7} {'GB/s':>6} {'tok/s if nothing else':>22}")
    with torch.inference_mode():
        for name, (nbytes, fn) in variants.items():
            seconds = timed(fn)
            print(f"{name:<48} {seconds * 1e3:>7.1f} {n_params * nbytes / seconds / 1e9:>6.1f} {1 / seconds:>22.1f}")


if __name__ == "__main__":
    main()
