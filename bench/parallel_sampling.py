"""n > 1 on the torch engine: a prompt's choices started together against staged.

The serving pipeline starts a prompt's other choices once its first has its first token, so they
find the prompt in the prefix cache instead of each computing it (``Generation.run``). This runs
the same request both ways, alternating, in one process (the bundled SmolLM2, int4 weights), a
fresh prompt every run so that no run finds another's cache, and prints the wall time of each:

    .venv/bin/python bench/parallel_sampling.py                  # n = 8, a ~500-token prompt
    .venv/bin/python bench/parallel_sampling.py --n 4 --repeats 20 --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="choices per request (default 8)")
    ap.add_argument("--repeats", type=int, default=60, help="sentences in the system prompt (default 60: ~500 tokens)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per choice (default 32)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each way (default 3)")
    args = ap.parse_args()

    import router.serving as serving
    from router.engine import SamplingParams
    from router.params import GenerationParams
    from test_torch_engine import engine_for
    from torch_models import smollm2_folder

    engine = engine_for(smollm2_folder(), weight_format="int4", max_model_len=2048, kv_cache_gb=0.5)
    staged_leads = serving.Generation._leads
    system = "<|im_start|>system\n" + "Answer with care and in full sentences. " * args.repeats + "<|im_end|>\n"

    async def once(staged: bool, salt: str) -> tuple[int, float]:
        # Unstaged: every choice "leads", so all start at once (the pipeline before staging).
        serving.Generation._leads = staged_leads if staged else (lambda self, choice: True)
        prompt = engine.tokenizer.encode(f"{salt} {system}<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)
        params = GenerationParams(n=args.n, sampling=SamplingParams(temperature=1.0, seed=1))
        gen = serving.Generation(SimpleNamespace(engine=engine), [prompt], params, args.max_tokens, "bench")
        start = time.perf_counter()
        async for _ in gen.run():
            pass
        return len(prompt), time.perf_counter() - start

    async def all_runs() -> dict[bool, list[float]]:
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.runs):
            for staged in (False, True):
                tokens, seconds = await once(staged, f"run {i} {staged}")
                times[staged].append(seconds)
                print(f"run {i}  {'staged  ' if staged else 'at once '}  prompt {tokens} tokens  "
                      f"n={args.n} x {args.max_tokens} tokens  {seconds:.2f} s", flush=True)
        return times

    try:
        times = asyncio.run(all_runs())
    finally:
        serving.Generation._leads = staged_leads
        asyncio.run(engine.stop())
    at_once, staged = statistics.median(times[False]), statistics.median(times[True])
    print(f"median: at once {at_once:.2f} s, staged {staged:.2f} s, {at_once / staged:.2f}x")


if __name__ == "__main__":
    main()
