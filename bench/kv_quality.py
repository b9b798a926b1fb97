"""How far a 16-bit KV cache (kv_cache_dtype) moves the torch engine's greedy output.

For each weight format, the bundled SmolLM2 generates 64 greedy tokens for each of the 8
engine-test prompts with the cache in the model's own float32 (``auto``) and in each 16-bit type;
for every prompt it prints the first position where the 16-bit cache's tokens part from
float32's (64: all agree). Greedy decoding amplifies any rounding once two candidates are near a
tie, so a parting says where one flipped, not how far the distributions moved. No server.

    .venv/bin/python bench/kv_quality.py
    .venv/bin/python bench/kv_quality.py --formats native --tokens 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_torch_engine import PROMPTS, engine_for, generate_all, run  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="native,int4", help="weight formats (default: native,int4)")
    p.add_argument("--kv", default="float16,bfloat16", help="KV cache types against auto (default: float16,bfloat16)")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    print(f"{'format':<8} {'kv':<9} {'all agree':>9}  first parting per prompt")
    for fmt in args.formats.split(","):
        outputs = {}
        for kv in ["auto", *args.kv.split(",")]:
            engine = engine_for(smollm2_folder(), weight_format=fmt, kv_cache_dtype=kv, max_model_len=1024)
            try:
                ids = [engine.tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
                outputs[kv] = generate_all(engine, ids, args.tokens)
            finally:
                run(engine.stop())
            if kv == "auto":
                continue
            parting = [
                next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), args.tokens)
                for ours, ref in zip(outputs[kv], outputs["auto"])
            ]
            full = sum(j == args.tokens for j in parting)
            print(f"{fmt:<8} {kv:<9} {full:>5} / {len(parting)}  {parting}", flush=True)


if __name__ == "__main__":
    main()
