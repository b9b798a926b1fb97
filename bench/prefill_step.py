"""Time for many prompts to get their first token together inside the torch engine (no HTTP):
one prefill step and the engine's own work around it, each chunk's attention alone (``spans``)
against chunks of like sizes in one padded batch (``batched``, attention.PrefillBatch), in the
same process, alternating; and the torch operations that step dispatches.

``prompts`` fresh prompts of ``--length`` random tokens (new ones each time: no prefix cache
hits) go in at once, each for one token: one step prefills them all (``max_batched_tokens`` is set
so). The default model is a random Llama with SmolLM2-135M's 30 layers and heads at a tiny width
(72), so that a step's time is what the engine launches, not its arithmetic: the cost a GPU's
eager prefill pays per launch, measured on any machine. ``--model`` takes a real folder.

    .venv/bin/python bench/prefill_step.py
    .venv/bin/python bench/prefill_step.py --prompts 1,8,32,64 --length 38 --repeats 5
    .venv/bin/python bench/prefill_step.py --device cuda --model /tmp/gpu/smol
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from backends.torch import attention  # noqa: E402
from test_torch_engine import engine_for, generate, random_prompts, run  # noqa: E402
from torch_models import smollm2_folder  # noqa: E402


def narrow_smollm2(folder: Path) -> Path:
    """A random Llama of SmolLM2-135M's depth and heads (30 layers, 9 query heads on 3 KV heads)
    at width 72 (head size 8), with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=72, intermediate_size=192, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_folder() / name).exists():
            shutil.copy(smollm2_folder() / name, folder / name)
    return folder


class OpCounter:
    """Counts the torch operations of the engine's steps while ``on`` (each a kernel launch on a
    GPU, but for views): wraps ``engine.runner.run``, which runs on the engine's own thread, where
    a dispatch mode must be entered."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                counter.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops, self.on, real = 0, False, engine.runner.run

        def run_step(step):  # type: ignore[no-untyped-def]
            if not self.on:
                return real(step)
            with Mode():
                return real(step)

        engine.runner.run = run_step


def step_ms(engine, n: int, length: int, seed: int) -> float:  # type: ignore[no-untyped-def]
    """ms for ``n`` fresh prompts to get their first token together (one prefill step)."""
    prompts = random_prompts(seed, [length] * n)

    async def all_at_once() -> None:
        await asyncio.gather(*(generate(engine, p, 1) for p in prompts))

    start = time.perf_counter()
    run(all_at_once())
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="1,8,32,64", help="prompts prefilled together (default: 1,8,32,64)")
    p.add_argument("--length", type=int, default=38, help="tokens a prompt (default: 38, the engines benchmark's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", type=Path, default=None, help="a Hugging Face folder (default: SmolLM2's layers, narrow)")
    args = p.parse_args()
    counts = [int(c) for c in args.prompts.split(",")]
    budget = attention.PREFILL_BATCH_SCORES
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or narrow_smollm2(Path(tmp) / "narrow")
        engine = engine_for(folder, device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16",
                            max_num_seqs=max(counts), max_batched_tokens=max(counts) * args.length,
                            max_model_len=args.length + 16, kv_cache_gb=0.25, cuda_graphs=False)
        print(f"{folder}, {args.device}, {args.length} tokens a prompt; ms a step, median of {args.repeats}")
        print(f"{'prompts':>7} {'spans':>10} {'batched':>10} {'ratio':>7}   torch operations a step, spans / batched")
        counter = OpCounter(engine)
        try:
            seed = 1
            for n in counts:
                times: dict[str, list[float]] = {"spans": [], "batched": []}
                for rep in range(args.repeats + 1):  # the first round warms this shape up, untimed
                    for mode in (("spans", "batched") if rep % 2 else ("batched", "spans")):
                        # A budget of 0 leaves every chunk alone (no batch fits it).
                        attention.PREFILL_BATCH_SCORES = budget if mode == "batched" else 0
                        seed += 1
                        ms = step_ms(engine, n, args.length, seed)
                        if rep:
                            times[mode].append(ms)
                ops = {}
                for mode in ("spans", "batched"):  # one more step each, counted (untimed: counting is slow)
                    attention.PREFILL_BATCH_SCORES = budget if mode == "batched" else 0
                    counter.ops, counter.on, seed = 0, True, seed + 1
                    step_ms(engine, n, args.length, seed)
                    ops[mode], counter.on = counter.ops, False
                spans, batched = (statistics.median(times[m]) for m in ("spans", "batched"))
                print(f"{n:>7} {spans:>10.1f} {batched:>10.1f} {spans / batched:>6.2f}x   "
                      f"{ops['spans']:,} / {ops['batched']:,}", flush=True)
        finally:
            attention.PREFILL_BATCH_SCORES = budget
            run(engine.stop())


if __name__ == "__main__":
    main()
