"""Throughput of the torch engine under staggered arrivals: where steps mix decodes and prompts.

In ``bench/engines.py`` every request of a level starts together and runs to the same length, so
its steps either prefill (all prompts at once) or only decode. Real traffic is staggered: a new
request arrives while others are decoding, and its prompt shares a step with their decode rows.
Here ``--clients`` closed-loop clients send greedy requests one after another, each for a random
output length (16 to 112 tokens, seeded, the same sequence for every mode), straight to the engine
(no HTTP), on the bundled SmolLM2 in ``--format`` (int4 by default).

Two modes alternate, ``--rounds`` times, each for ``--seconds``:

- ``C``: as served, steps with short prompt chunks run in the one C call
  (``CpuDecoder.prompt_positions`` at its default);
- ``decode-only C``: only steps without prompt chunks do (``prompt_positions = 0``), the others
  run as torch operations: what the engine did before steps with prompts went to C.

Per mode it prints the completion tokens per second and, per kind of step (``prefill``: only
prompt chunks, ``mixed``, ``decode``), how many ran, their mean time and the mean number of
decode rows in them.

    .venv/bin/python bench/staggered.py
    .venv/bin/python bench/staggered.py --clients 8 --seconds 30 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from router.engine import EngineRequest, SamplingParams  # noqa: E402
from test_torch_engine import PROMPTS, engine_for, run  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402

MODES = {"C": None, "decode-only C": 0}  # CpuDecoder.prompt_positions; None: the default


class StepLog:
    """Wraps ``ModelRunner.run`` to time every step by kind (read the kind before the step runs:
    running it advances the sequences)."""

    def __init__(self, runner) -> None:  # type: ignore[no-untyped-def]
        self.steps: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
        inner = runner.run

        def timed(step):  # type: ignore[no-untyped-def]
            decodes = sum(1 for w in step.work if w.is_decode)
            kind = "decode" if decodes == len(step.work) else "prefill" if decodes == 0 else "mixed"
            start = time.perf_counter()
            out = inner(step)
            entry = self.steps[kind]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            entry[2] += decodes
            return out

        runner.run = timed


async def load(engine, prompts: list[list[int]], clients: int, seconds: float) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """Closed-loop clients for ``seconds`` (each finishes the request it has started); the
    completion tokens and the wall time."""
    tokens = 0
    start = time.perf_counter()
    deadline = start + seconds

    async def client(k: int) -> None:
        nonlocal tokens
        rng = random.Random(k)
        while time.perf_counter() < deadline:
            prompt = prompts[rng.randrange(len(prompts))]
            req = EngineRequest("t", prompt, SamplingParams(temperature=0.0), rng.randint(16, 112), ignore_eos=True)
            async for out in engine.generate(req):
                tokens += len(out.token_ids)

    await asyncio.gather(*(client(k) for k in range(clients)))
    return tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="int4", choices=["int8", "int4"], help="weight format (default: int4)")
    p.add_argument("--clients", type=int, default=32, help="concurrent closed-loop clients (default: 32)")
    p.add_argument("--seconds", type=float, default=60.0, help="load per mode and round (default: 60)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both modes, alternating (default: 2)")
    args = p.parse_args()
    engine = engine_for(smollm2_folder(), weight_format=args.format, max_model_len=2048, kv_cache_gb=0.5,
                        max_num_seqs=max(args.clients, 1))
    try:
        decoder = engine.runner.decoder
        default = decoder.prompt_positions
        template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
        prompts = [engine.tokenizer.encode(template.format(t), add_special_tokens=False) for t in PROMPTS]
        log = StepLog(engine.runner)
        print(f"{args.clients} clients, {args.format}, {args.seconds:.0f} s per mode and round")
        print(f"{'round':>5} {'mode':<14} {'tok/s':>7}  {'kind':<8} {'steps':>6} {'ms/step':>8} {'decode rows':>12}")
        for r in range(1, args.rounds + 1):
            for mode, limit in MODES.items():
                decoder.prompt_positions = default if limit is None else limit
                log.steps.clear()
                tokens, wall = run(load(engine, prompts, args.clients, args.seconds))
                first = True
                for kind in ("prefill", "mixed", "decode"):
                    n, total, rows = log.steps.get(kind, (0, 0.0, 0))
                    head = f"{r:>5} {mode:<14} {tokens / wall:>7.1f}" if first else " " * 28
                    ms = f"{1e3 * total / n:>8.1f}" if n else f"{'-':>8}"
                    mean_rows = f"{rows / n:>12.1f}" if n else f"{'-':>12}"
                    print(f"{head}  {kind:<8} {n:>6} {ms} {mean_rows}", flush=True)
                    first = False
    finally:
        run(engine.stop())


if __name__ == "__main__":
    main()
