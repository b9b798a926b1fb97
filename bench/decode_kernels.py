"""Where one token's time goes at batch 1 on a CPU: memory bandwidth against the projection kernels.

A decode step at batch 1 multiplies one activation row by every weight matrix once. This script
times that part alone, on SmolLM2-135M's shapes (30 layers of fused qkv 960x576, o 576x576,
fused gate/up 3072x576, down 576x1536, then the 49,152x576 LM head), with fresh random weights
(so they come from memory, not cache), next to the machine's plain read bandwidth (a float32 sum
over 512 MiB). It answers "how fast could a token be if the projections ran at memory speed" for
the torch engine's CPU weight formats: float32 (``native``), float16 through fbgemm (``fp16``),
8-bit and 4-bit weights through the engine's own C kernel (``int8``, and ``int4`` with the LM
head at 8 bits as that format keeps it). A second table times the fp16 and C kernels at batches
of 1 to 512 rows (prefill chunks reach 512). The packed formats run decode-only steps of any
size through the C kernel (one call for the whole step, see backends/torch/cpu_decode.py) and
the larger matrices of prefill and mixed steps, above ``quantize.SMALL_BATCH`` rows, through
fbgemm's fp16 copy of the same weights, where one is kept (``quantize.large_batch_copy``).

``--base REV`` adds a third table: this tree's C kernel against the one at a git revision
(built from its source with the same flags, same packed weights), alternating, medians.
``--builds NAME=FLAGS ...`` does the same for this tree's source built with other compiler
flags (AVX2 alone against AVX2 with AVX-VNNI, say).

    .venv/bin/python bench/decode_kernels.py
    .venv/bin/python bench/decode_kernels.py --base 8c89b60 --rows 1,2,4,8,12
    .venv/bin/python bench/decode_kernels.py --builds "avx2=-march=x86-64-v3" "avx-vnni=-march=x86-64-v3 -mavxvnni"
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from backends.torch import native  # noqa: E402
from backends.torch.quantize import PackedLinear  # noqa: E402
from test_cpu_kernels import linear_with  # noqa: E402

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


def against_base(rev: str, rows: list[int], int8: list[PackedLinear], int4: list[PackedLinear]) -> None:
    """This tree's C kernel against ``rev``'s on the same packed weights, alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "base.c"
        source.write_bytes(subprocess.run(["git", "show", f"{rev}:backends/torch/csrc/cpu_kernels.c"], cwd=ROOT,
                                          check=True, capture_output=True).stdout)
        native.compile_library(Path(tmp) / "base.so", native._compiler(), native._FLAGS, source)
        compare({rev: native.load(Path(tmp) / "base.so"), "this tree": native.kernels()}, rows, int8, int4)


def against_flags(builds: list[str], rows: list[int], int8: list[PackedLinear], int4: list[PackedLinear]) -> None:
    """This tree's C kernel built with other flags (``name=flags``), alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {}
        for build in builds:
            name, _, flags = build.partition("=")
            path = Path(tmp) / f"{len(loaded)}.so"
            native.compile_library(path, native._compiler(), ("-O3", *flags.split(), "-ffp-contract=off", "-shared", "-fPIC"))
            loaded[name] = native.load(path)
        compare(loaded, rows, int8, int4)


def compare(builds: dict, rows: list[int], int8: list[PackedLinear], int4: list[PackedLinear]) -> None:
    """Every projection of one step through each build, alternating, medians; the ratio of the
    first build's time to the second's."""
    first, second = list(builds)[:2]
    print(f"\nall projections of one step, {first} against {second} (ms, median of {REPS + 2}, alternating):")
    print(f"{'rows':>4} {'format':>6} " + " ".join(f"{name:>10}" for name in builds) + "   ratio")
    for m in rows:
        batch = {k: torch.randn(m, k) for k in (576, 1536)}
        for name, lins in (("int8", int8), ("int4", int4)):
            times: dict[str, list[float]] = {b: [] for b in builds}
            for rep in range(REPS + 2):
                order = list(builds.items()) if rep % 2 == 0 else list(builds.items())[::-1]
                for build, k in order:
                    start = time.perf_counter()
                    for lin in lins:
                        linear_with(k, lin, batch[lin.in_features])
                    times[build].append(time.perf_counter() - start)
            ms = [statistics.median(t) * 1e3 for t in times.values()]
            print(f"{m:>4} {name:>6} " + " ".join(f"{t:>10.1f}" for t in ms) + f"   {ms[0] / ms[1]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="also time the C kernel at this git revision against this tree's")
    p.add_argument("--builds", nargs="+", metavar="NAME=FLAGS",
                   help="also time this tree's C kernel built with these compiler flags against each other")
    p.add_argument("--rows", default="1,2,4,8,12,16,32,64",
                   help="rows for --base and --builds (default 1,2,4,8,12,16,32,64)")
    args = p.parse_args()
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
    int8, int4 = [], []
    for i, w in enumerate(weights):
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w
        int8.append(PackedLinear(layer, 8))
        int4.append(PackedLinear(layer, 8 if i == len(weights) - 1 else 4))  # the LM head stays at 8
    head = LM_HEAD[0] * LM_HEAD[1]
    int4_bytes = ((n_params - head) * 0.75 + head * 1.25) / n_params
    half_rows = {k: v.half() for k, v in rows.items()}
    variants = {
        "float32 (F.linear, MKL)": (4, lambda: [torch.nn.functional.linear(rows[w.shape[1]], w) for w in weights]),
        "float16 weights (fbgemm, float32 activations)": (
            2, lambda: [torch.ops.quantized.linear_dynamic_fp16(rows[w.shape[1]], p) for w, p in zip(weights, packed)]),
        "float16 weights and activations (F.linear)": (
            2, lambda: [torch.nn.functional.linear(half_rows[w.shape[1]], w) for w in halves]),
        "int8 weights (own C kernel, int16 activations)": (
            1.25, lambda: [lin(rows[lin.in_features]) for lin in int8]),
        "int4 weights, LM head int8 (own C kernel)": (
            int4_bytes, lambda: [lin(rows[lin.in_features]) for lin in int4]),
    }
    print(f"\nall projections of one token at batch 1 ({n_params / 1e6:.1f} M weights):")
    print(f"{'kernel':<48} {'ms':>7} {'GB/s':>6} {'tok/s if nothing else':>22}")
    with torch.inference_mode():
        for name, (nbytes, fn) in variants.items():
            seconds = timed(fn)
            print(f"{name:<48} {seconds * 1e3:>7.1f} {n_params * nbytes / seconds / 1e9:>6.1f} {1 / seconds:>22.1f}")

        print("\nall projections of one step, by rows in the batch (ms):")
        print(f"{'rows':>4} {'fp16 (fbgemm)':>14} {'int8 (C)':>9} {'int4 (C)':>9}")
        for m in (1, 2, 4, 8, 12, 16, 32, 64, 512):
            batch = {k: torch.randn(m, k) for k in (576, 1536)}
            reps = REPS if m <= 64 else 2
            fp16 = timed(lambda: [torch.ops.quantized.linear_dynamic_fp16(batch[w.shape[1]], p) for w, p in zip(weights, packed)], reps)
            own = timed(lambda: [lin.kernel_forward(batch[lin.in_features]) for lin in int8], reps)
            own4 = timed(lambda: [lin.kernel_forward(batch[lin.in_features]) for lin in int4], reps)
            print(f"{m:>4} {fp16 * 1e3:>14.1f} {own * 1e3:>9.1f} {own4 * 1e3:>9.1f}")
        if args.base:
            against_base(args.base, [int(r) for r in args.rows.split(",")], int8, int4)
        if args.builds:
            against_flags(args.builds, [int(r) for r in args.rows.split(",")], int8, int4)


if __name__ == "__main__":
    main()
