"""Time of the steps that compute prompts in the torch engine: one C call or torch operations.

``CpuDecoder`` (``backends/torch/cpu_decode.py``) runs a step with prompt chunks in its one C call
unless the chunks' tokens attend to more than ``PROMPT_POSITIONS`` positions in all, because its
attention takes a token and a head at a time. This measures where that limit should sit: for each
``--prompts`` entry, ``L`` (one prompt of L random tokens) or ``LxN`` (N of them at once), it
times 1-token greedy generations with every prompt step in C and with every prompt step as torch
operations (the packed projections through fbgemm's fp16 copy of their weights, or the C kernel
where none is kept, ``quantize.large_batch_copy``; SDPA), alternating, fresh prompts each time
and the prefix cache off, on the bundled SmolLM2. Prompts longer than ``--chunk`` (the step's
token budget) run in several steps. Prints the (token, position) pairs of the prompts (what the
limit counts) and the median ms of both paths.

    .venv/bin/python bench/prompt_step.py
    .venv/bin/python bench/prompt_step.py --prompts 1500 --chunk 128
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_torch_engine import engine_for, generate, run  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402

PATHS = {"one C call": 1 << 62, "torch ops": 0}  # CpuDecoder.prompt_positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="8,37,128,256,512,16x8,16x16,16x32",
                   help="L (a prompt of L tokens) or LxN (N of them at once), comma-separated")
    p.add_argument("--chunk", type=int, default=512, help="max_batched_tokens (default: 512, as served)")
    p.add_argument("--format", default="int4", choices=["int8", "int4"])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    engine = engine_for(smollm2_folder(), weight_format=args.format, max_model_len=2048, kv_cache_gb=0.5,
                        max_num_seqs=64, max_batched_tokens=args.chunk, prefix_caching=False)
    rng = random.Random(0)
    try:
        decoder = engine.runner.decoder
        print(f"{args.format}, chunks of up to {args.chunk} tokens; ms per 1-token generation, median of {args.repeats}")
        print(f"{'prompts':>9} {'pairs':>9} " + " ".join(f"{name:>11}" for name in PATHS))
        for entry in args.prompts.split(","):
            length, _, count = entry.partition("x")
            L, N = int(length), int(count or 1)
            times: dict[str, list[float]] = {name: [] for name in PATHS}
            for _ in range(args.repeats + 1):  # the first round warms this shape up
                for name, limit in PATHS.items():
                    decoder.prompt_positions = limit
                    prompts = [[rng.randrange(3, 49152) for _ in range(L)] for _ in range(N)]

                    async def all_at_once() -> None:
                        await asyncio.gather(*(generate(engine, q, 1) for q in prompts))

                    start = time.perf_counter()
                    run(all_at_once())
                    times[name].append(time.perf_counter() - start)
            pairs = N * L * (L + 1) // 2
            cells = " ".join(f"{statistics.median(t[1:]) * 1e3:>11.0f}" for t in times.values())
            print(f"{entry:>9} {pairs:>9} {cells}", flush=True)
    finally:
        run(engine.stop())


if __name__ == "__main__":
    main()
