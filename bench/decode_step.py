"""Time of one decode step inside the torch engine, per CPU weight format and batch size (no HTTP).

Builds the engine on the bundled SmolLM2 (or ``--model``, a Hugging Face folder) for each format, warms it up, then times ``rows``
concurrent greedy generations of 101 tokens and of 1 token from the same prompts; the difference
over 100 is one decode step of ``rows`` sequences plus the engine loop's own work (sampling,
posting the tokens). Medians of ``--repeats``.

With ``--torch-ops`` the packed formats (int8, int4) also run every step as torch operations
(the model's modules; fbgemm's fp16 GEMM above :data:`backends.torch.quantize.SMALL_BATCH`
rows) instead of the one C call of
``backends/torch/cpu_decode.py``, in the same process, alternating.

``--context N`` gives each sequence a prompt of N random tokens instead of a short text (the
prompts are in the prefix cache after the warm-up, so each measurement computes one token of
them); ``--kv`` builds an engine per KV cache type (kv_cache_dtype) and alternates them too.

    .venv/bin/python bench/decode_step.py
    .venv/bin/python bench/decode_step.py --formats int8,int4 --repeats 5
    .venv/bin/python bench/decode_step.py --formats int4 --rows 1,8,16,32,64 --torch-ops
    .venv/bin/python bench/decode_step.py --formats int4 --rows 8,32 --context 1000 --kv float32,float16 --kv-cache-gb 2
    .venv/bin/python bench/decode_step.py --model /tmp/gemma3 --formats int4 --rows 1,8,32 --torch-ops
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_torch_engine import PROMPTS, engine_for, generate, random_prompts, run  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402


def step_ms(engine, prompts: list[list[int]], decoder) -> float:  # type: ignore[no-untyped-def]
    """One timed measurement: ms per decode step of ``len(prompts)`` sequences."""
    engine.runner.decoder = decoder

    def timed(n: int) -> float:
        async def all_at_once() -> None:
            await asyncio.gather(*(generate(engine, p, n) for p in prompts))

        start = time.perf_counter()
        run(all_at_once())
        return time.perf_counter() - start

    return (timed(101) - timed(1)) / 100 * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="native,fp16,int8,int4", help="weight formats (default: native,fp16,int8,int4)")
    p.add_argument("--rows", default="1", help="sequences decoding together (default: 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--torch-ops", action="store_true", help="packed formats: also time steps as torch operations")
    p.add_argument("--context", type=int, default=0, help="prompt tokens per sequence (default: short texts)")
    p.add_argument("--kv", default="auto", help="KV cache types, an engine each (default: auto)")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV budget of each engine (default: 0.5)")
    p.add_argument("--model", type=Path, default=None,
                   help="a Hugging Face folder instead of SmolLM2 (bench/random_checkpoint.py writes random ones)")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{'format':<8} {'kv':<8} {'rows':>4} {'step':<10} {'ms/step median':>15} {'runs':>24}")
    engines = {}
    try:
        for fmt in args.formats.split(","):
            for kv in args.kv.split(","):
                engines[fmt, kv] = engine_for(
                    args.model or smollm2_folder(), weight_format=fmt, kv_cache_dtype=kv, kv_cache_gb=args.kv_cache_gb,
                    max_num_seqs=max(rows), max_model_len=args.context + 128 if args.context else 512,
                )
        # Every (format, KV type, path) in turn, so that the machine's drift spreads over them all.
        paths = {}
        for (fmt, kv), engine in engines.items():
            decoder = engine.runner.decoder
            paths[fmt, kv, "one C call" if decoder is not None else "torch ops"] = (engine, decoder)
            if decoder is not None and args.torch_ops:
                paths[fmt, kv, "torch ops"] = (engine, None)
        for n in rows:
            if args.context:
                prompts = random_prompts(n, [args.context] * n)
            else:
                encode = next(iter(engines.values())).tokenizer.encode
                prompts = [encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False) for i in range(n)]
            for engine, d in paths.values():
                step_ms(engine, prompts, d)  # warm-up: this batch shape once (and the prompts cached)
            times: dict[tuple, list[float]] = {key: [] for key in paths}
            for _ in range(args.repeats):
                for key, (engine, d) in paths.items():
                    times[key].append(step_ms(engine, prompts, d))
            for (fmt, kv, name), ts in times.items():
                runs = " ".join(f"{t:.1f}" for t in ts)
                print(f"{fmt:<8} {kv:<8} {n:>4} {name:<10} {statistics.median(ts):>15.1f} {runs:>24}", flush=True)
    finally:
        for engine in engines.values():
            run(engine.stop())


if __name__ == "__main__":
    main()
