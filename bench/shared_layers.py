"""Gemma 4 E2B's and E4B's shared layers: what computing only the rows whose logits are wanted saves a prompt.

Their last ``num_kv_shared_layers`` layers keep no keys or values of their own, so past the first of
them only the rows whose logits are wanted matter (``CausalLM.wanted_rows_from``): a prompt's last
row, each decoding row. This times 1-token greedy generations of fresh random prompts (the prefix
cache off) with those rows cut and with every row computed (``wanted_rows_from = None``),
alternating on one engine, and prints the median ms of each and their ratio.

    .venv/bin/python bench/random_checkpoint.py --out /tmp/e2b --arch gemma4_e
    .venv/bin/python bench/shared_layers.py --model /tmp/e2b
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_torch_engine import engine_for, generate, run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a Gemma 4 folder with shared layers")
    p.add_argument("--prompts", default="64,256,1024", help="prompt lengths, comma-separated")
    p.add_argument("--chunk", type=int, default=512, help="max_batched_tokens (default: 512, as served)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    engine = engine_for(args.model, max_model_len=2048, kv_cache_gb=0.5, max_batched_tokens=args.chunk,
                        prefix_caching=False)
    model, rng = engine.model, random.Random(0)
    cut_from = model.wanted_rows_from
    if cut_from is None:
        sys.exit(f"{args.model}: no shared layers (num_kv_shared_layers)")
    paths = {"wanted rows": cut_from, "every row": None}
    try:
        print(f"layers {cut_from} to {len(model.layers) - 1} of {len(model.layers)} shared; chunks of up to "
              f"{args.chunk} tokens; ms per 1-token generation, median of {args.repeats}")
        print(f"{'prompt':>7} " + " ".join(f"{name:>11}" for name in paths) + f" {'ratio':>7}")
        for length in map(int, args.prompts.split(",")):
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats + 1):  # the first round warms this shape up
                for name, start in paths.items():
                    model.wanted_rows_from = start
                    prompt = [rng.randrange(3, 49152) for _ in range(length)]
                    began = time.perf_counter()
                    run(generate(engine, prompt, 1))
                    times[name].append(time.perf_counter() - began)
            medians = [statistics.median(t[1:]) * 1e3 for t in times.values()]
            cells = " ".join(f"{m:>11.0f}" for m in medians)
            print(f"{length:>7} {cells} {medians[1] / medians[0]:>6.2f}x", flush=True)
    finally:
        model.wanted_rows_from = cut_from
        run(engine.stop())


if __name__ == "__main__":
    main()
