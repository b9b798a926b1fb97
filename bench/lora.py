"""What serving a LoRA adapter costs on the torch engine (or with ``--backend llamacpp``, the
llama.cpp one): the same greedy generations on the base model and under an adapter, alternating,
in one process.

The bundled SmolLM2 with a random rank-``--rank`` adapter on all seven projections of every
layer (the worst case; a q/v adapter costs less). ``--streams`` requests at once, each a fresh
prompt of ``--prompt`` random tokens and ``--max-tokens`` new ones; prints the wall time and
tokens/s of each way and their ratio. With ``--weight-format int8`` or ``int4`` both run the one C
call, which adds the adapter's rows itself (``lora_add``). llama.cpp runs the bundled Q4_1 file
with the same PEFT adapter converted to its adapter format, one request at a time.

    .venv/bin/python bench/lora.py                                   # float32, 1 and 8 streams
    .venv/bin/python bench/lora.py --weight-format int4 --streams 1,8
    .venv/bin/python bench/lora.py --backend llamacpp --streams 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="torch", choices=["torch", "llamacpp"])
    ap.add_argument("--weight-format", default="native", choices=["native", "fp16", "int8", "int4"],
                    help="the torch engine's weights (default native: float32)")
    ap.add_argument("--streams", default="1,8", help="concurrent requests, comma-separated (default 1,8)")
    ap.add_argument("--rank", type=int, default=16, help="the adapter's rank (default 16)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request (default 64)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each way per level (default 3)")
    args = ap.parse_args()

    from router.engine import EngineRequest, SamplingParams
    from torch_models import GGUF, smollm2_folder, write_lora

    base = smollm2_folder()
    adapter = write_lora(Path(tempfile.mkdtemp()) / "adapter", base, rank=args.rank, alpha=2.0 * args.rank)
    if args.backend == "llamacpp":
        from backends.llamacpp.engine import LlamaCppEngine

        threads = os.cpu_count()
        engine = LlamaCppEngine(str(GGUF), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                                adapters={"adapter": adapter})
        asyncio.run(engine.start())
        what = "llama.cpp, Q4_1"
    else:
        from backends.torch import TorchConfig
        from backends.torch.setup import build_engine

        cfg = TorchConfig(name="bench", backend="torch", path=str(base), max_model_len=1024, kv_cache_gb=0.5,
                          weight_format=args.weight_format, prefix_caching=False)
        engine = build_engine(cfg, base, {"adapter": adapter})
        what = f"torch, weight_format {args.weight_format}"
    rng = random.Random(0)

    async def one(adapter_name: str | None) -> int:
        prompt = [rng.randrange(3, 49152) for _ in range(args.prompt)]
        req = EngineRequest("b", prompt, SamplingParams(temperature=0.0), args.max_tokens, ignore_eos=True,
                            adapter=adapter_name)
        count = 0
        async for step in engine.generate(req):
            count += len(step.token_ids)
        return count

    async def level(streams: int, adapter_name: str | None) -> tuple[float, int]:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(adapter_name) for _ in range(streams)))
        return time.perf_counter() - start, sum(counts)

    print(f"SmolLM2-135M, {what}, adapter rank {args.rank} on all 7 projections, "
          f"{args.prompt}-token prompts, {args.max_tokens} new tokens, median of {args.runs} alternating runs")
    print(f"{'streams':>7} {'base s':>8} {'adapter s':>10} {'base tok/s':>11} {'adapter tok/s':>14} {'adapter/base':>13}")
    try:
        asyncio.run(level(1, None))  # warm-up: first-step allocations, thread pools
        asyncio.run(level(1, "adapter"))
        for streams in (int(s) for s in args.streams.split(",")):
            times: dict[str | None, list[float]] = {None: [], "adapter": []}
            tokens = 0
            for _ in range(args.runs):
                for name in (None, "adapter"):
                    seconds, tokens = asyncio.run(level(streams, name))
                    times[name].append(seconds)
            b, a = statistics.median(times[None]), statistics.median(times["adapter"])
            print(f"{streams:>7} {b:>8.2f} {a:>10.2f} {tokens / b:>11.1f} {tokens / a:>14.1f} {b / a:>13.2f}")
    finally:
        asyncio.run(engine.stop())


if __name__ == "__main__":
    main()
