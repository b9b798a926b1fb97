"""Time of one decode token at batch 1 inside the torch engine, per CPU weight format (no HTTP).

Builds the engine on the bundled SmolLM2 for each format, warms it up, then times a 101-token
greedy generation and a 1-token one from the same prompt; the difference over 100 is one decode
step plus the engine loop's own work (sampling, posting the token). Medians of ``--repeats``.

    .venv/bin/python bench/decode_step.py
    .venv/bin/python bench/decode_step.py --formats int8,int4 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_torch_engine import PROMPTS, engine_for, generate, run  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402


def per_token_ms(weight_format: str, repeats: int) -> list[float]:
    engine = engine_for(smollm2_folder(), weight_format=weight_format)
    try:
        ids = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
        run(generate(engine, ids, 8))
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            run(generate(engine, ids, 101))
            long = time.perf_counter() - start
            start = time.perf_counter()
            run(generate(engine, ids, 1))
            short = time.perf_counter() - start
            out.append((long - short) / 100 * 1e3)
        return out
    finally:
        run(engine.stop())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="native,fp16,int8,int4", help="weight formats (default: native,fp16,int8,int4)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"{'format':<8} {'ms/token median':>16} {'runs':>24}")
    for fmt in args.formats.split(","):
        times = per_token_ms(fmt, args.repeats)
        print(f"{fmt:<8} {statistics.median(times):>16.1f} {' '.join(f'{t:.1f}' for t in times):>24}")


if __name__ == "__main__":
    main()
