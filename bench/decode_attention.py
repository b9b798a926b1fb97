"""Time of the C decode attention (``rk_decode_attention``) for one step of SmolLM2, per context.

A decode step's attention, per layer: rotary on the new token's q and k, the cache write, then
every head over its sequence's paged cache. This times it for the 30 layers of SmolLM2-135M (9
heads on 3 KV heads of 64, 16-token blocks, each layer its own cache) at several context lengths
and batch sizes, with the caches pushed out of the CPU's caches before every step (in the engine
the weights' pass does that). Each KV cache type of ``--kv`` (kv_cache_dtype) is a column; with
``--base REV`` the same kernel built from the source at a git revision is one more (float32), and
all are timed in alternation, so one run compares them.

    .venv/bin/python bench/decode_attention.py
    .venv/bin/python bench/decode_attention.py --rows 32 --contexts 1000 --kv float32,float16,bfloat16
    .venv/bin/python bench/decode_attention.py --base 72b43ef --kv float32
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from backends.torch import native  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16
_P, _I = ctypes.c_void_p, ctypes.c_int64
# Up to ABI 6 the caller passed the scores' scratch and a table row per sequence; from ABI 7 each
# row names its table row (prompt chunks share one) and the kernel keeps its own scratch.
ARGTYPES_6 = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _I, ctypes.c_float, _I, _P, _P]
ARGTYPES_7 = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, ctypes.c_float, _I, _P]
# ABI 8: the cache's element type (native.KV_KINDS) before the output.
ARGTYPES_8 = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, ctypes.c_float, _I, ctypes.c_int, _P]
# ABI 11: the scores' tanh cap (Gemma 2; 0 here: none) after the scale.
ARGTYPES = ARGTYPES_8[:19] + [ctypes.c_float] + ARGTYPES_8[19:]


def build(source: Path, workdir: Path, name: str):
    """``rk_decode_attention`` from ``source``, compiled as the engine compiles its kernels, and
    the library's ABI number."""
    target = workdir / f"{name}.so"
    cmd = [native._compiler(), *native._FLAGS, "-fopenmp", str(source), "-o", str(target), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    lib = ctypes.CDLL(str(target))
    abi = lib.rk_abi()
    fn = lib.rk_decode_attention
    fn.argtypes, fn.restype = {6: (ARGTYPES_6, None), 7: (ARGTYPES_7, ctypes.c_int)}.get(
        abi, (ARGTYPES_8 if abi <= 10 else ARGTYPES, ctypes.c_int)
    )
    return fn, abi


class Step:
    """The tensors of one decode step: M sequences of ``context`` tokens, blocks scattered."""

    def __init__(self, m: int, context: int, kv_dtypes: list[torch.dtype]) -> None:
        g = torch.Generator().manual_seed(m * 10_000 + context)
        per_seq = -(-context // BLOCK)
        blocks = m * per_seq + 1
        order = torch.randperm(blocks, generator=g)[: m * per_seq].view(m, per_seq)
        self.m, self.context = m, context
        shape = (blocks * BLOCK, KV_HEADS, DIM)
        caches = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYERS)]
        self.caches = {dt: [(k.to(dt), v.to(dt)) for k, v in caches] for dt in kv_dtypes}
        self.table = order.contiguous()
        self.positions = torch.full((m,), context - 1, dtype=torch.long)
        self.lengths = torch.full((m,), context, dtype=torch.long)
        self.slots = (self.table[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK).contiguous()
        self.qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * DIM, generator=g)
        angles = torch.arange(context)[:, None] * torch.rand(DIM, generator=g)[None]
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()
        self.scratch = torch.empty(m * HEADS * context)
        self.table_of = torch.arange(m)
        self.out = torch.empty(m, HEADS * DIM)

    def run(self, kernel, kv_dtype: torch.dtype) -> None:
        fn, abi = kernel
        for k, v in self.caches[kv_dtype]:
            head = (
                self.qkv.data_ptr(), self.m, self.qkv.shape[1], HEADS, KV_HEADS, DIM, self.positions.data_ptr(),
                self.cos.data_ptr(), self.sin.data_ptr(), k.data_ptr(), v.data_ptr(), self.slots.data_ptr(),
                self.table.data_ptr(), self.table.shape[1],
            )
            if abi <= 6:
                fn(*head, self.lengths.data_ptr(), BLOCK, 0, DIM**-0.5, self.context, self.scratch.data_ptr(),
                   self.out.data_ptr())
                continue
            cap = () if abi <= 10 else (0.0,)
            tail = (self.table_of.data_ptr(), self.lengths.data_ptr(), BLOCK, 0, DIM**-0.5, *cap, self.context)
            kind = () if abi == 7 else (native.KV_KINDS[kv_dtype],)
            if not fn(*head, *tail, *kind, self.out.data_ptr()):
                raise MemoryError("rk_decode_attention could not allocate its scratch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="100,400,1000")
    p.add_argument("--rows", default="1,8", help="sequences per step")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--kv", default="float32,float16", help="KV cache types of this tree's kernel to time")
    p.add_argument("--base", help="also time the kernel at this git revision (float32 cache)")
    args = p.parse_args()
    torch.manual_seed(0)
    evict = torch.empty(48 * 2**20)  # 192 MiB, read between steps as the weights' pass would
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tree = build(native.SOURCE, work, "tree")
        kernels = {name: (tree, getattr(torch, name)) for name in args.kv.split(",")}
        if args.base:
            old = work / "base.c"
            old.write_bytes(subprocess.run(
                ["git", "show", f"{args.base}:backends/torch/csrc/cpu_kernels.c"], cwd=ROOT, check=True,
                capture_output=True).stdout)
            kernels = {args.base: (build(old, work, "base"), torch.float32), **kernels}
        print(f"threads {torch.get_num_threads()}; ms per step (30 layers), median of {args.repeats}")
        print(f"{'rows':>4} {'context':>7} " + " ".join(f"{name:>12}" for name in kernels))
        for m in map(int, args.rows.split(",")):
            for context in map(int, args.contexts.split(",")):
                step = Step(m, context, sorted({dt for _, dt in kernels.values()}, key=str))
                times = {name: [] for name in kernels}
                for _ in range(args.repeats):
                    for name, (fn, kv_dtype) in kernels.items():
                        evict.add_(1.0)
                        start = time.perf_counter()
                        step.run(fn, kv_dtype)
                        times[name].append(time.perf_counter() - start)
                print(f"{m:>4} {context:>7} " + " ".join(f"{statistics.median(t) * 1e3:>12.2f}" for t in times.values()))


if __name__ == "__main__":
    main()
