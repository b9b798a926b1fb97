"""Models with per-sequence states (Qwen3.5, Qwen3-Next, Granite 4's hybrids, Bamba, Nemotron-H, Falcon-H1): what
the prefix cache's kept states save a chat.

A chat of several turns, each prompt the previous one, its answer and a new message, runs
through two engines of the same checkpoint, one keeping states at block boundaries (the prefix
cache) and one without the prefix cache, turn by turn alternating in one process. Prints each
turn's prompt length, the tokens the engine keeping states found cached, and each engine's
time to first token and whole turn. Whichever engine runs a turn first is slower at it on this
machine (by up to a quarter, whichever it is): compare the first turn across both orders, or
measure it alone with ``--fresh``. With ``--users N``, N users instead, each with one message after
the same system prompt: the second keeps the state where the system prompt's shared blocks end,
the third and later start there.

    .venv/bin/python bench/random_checkpoint.py --out /tmp/q35 --arch qwen3_5_text
    .venv/bin/python bench/state_prefix.py --model /tmp/q35
    .venv/bin/python bench/state_prefix.py --model /tmp/q35 --plain-first
    .venv/bin/python bench/state_prefix.py --model /tmp/q35 --fresh 8   # what a first turn pays
    .venv/bin/python bench/state_prefix.py --model /tmp/q35 --users 6   # one system prompt, six users
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
sys.path.insert(0, str(ROOT / "tests"))


async def one_turn(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], int, float, float]:
    """Greedy tokens for ``prompt``, the tokens found cached, time to first token, whole time."""
    from router.engine import EngineRequest, SamplingParams

    time.sleep(1.0)  # the previous turn's threads settle

    request = EngineRequest("bench", prompt, SamplingParams(temperature=0.0), max_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens, cached, first = [], 0, None
    async for step in engine.generate(request):
        if first is None and step.token_ids:
            first = time.perf_counter() - start
        if step.cached_tokens is not None:
            cached = step.cached_tokens
        tokens += step.token_ids
    return tokens, cached, first, time.perf_counter() - start


def fresh_prompts(kept, plain, prompts: list[list[int]]) -> None:
    """What keeping states costs a prompt nobody shares: each prompt's first token on both engines,
    the order alternating (whichever runs first is slower); the medians."""
    times: dict[str, list[float]] = {"kept": [], "none": []}
    for i, prompt in enumerate(prompts):
        order = [("kept", kept), ("none", plain)][:: 1 if i % 2 else -1]
        for name, engine in order:
            times[name].append(asyncio.run(one_turn(engine, prompt, 1))[2])
    for name, seconds in times.items():
        print(f"{name:>5}: median first token {statistics.median(seconds):.3f}s of {len(seconds)} prompts of "
              f"{len(prompts[0])} tokens ({' '.join(f'{t:.3f}' for t in seconds)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a checkpoint with linear-attention or Mamba2 layers")
    ap.add_argument("--turns", type=int, default=4, help="turns of the chat (default 4)")
    ap.add_argument("--system", type=int, default=500, help="tokens of the first prompt (default 500)")
    ap.add_argument("--message", type=int, default=40, help="tokens of each later message (default 40)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer (default 32)")
    ap.add_argument("--fresh", type=int, default=0, metavar="N",
                    help="instead: N fresh first prompts (--system tokens, a one-token answer each), the order alternating; "
                         "the median first token")
    ap.add_argument("--users", type=int, default=0, metavar="N",
                    help="instead: N users, each one message (--message tokens) after one system prompt (--system tokens)")
    ap.add_argument("--plain-first", action="store_true",
                    help="run each turn on the engine without the prefix cache first (whichever runs first is slower)")
    args = ap.parse_args()

    from test_torch_engine import engine_for

    options = dict(max_model_len=4096, kv_cache_gb=0.5, max_batched_tokens=1024)
    kept, plain = engine_for(args.model, **options), engine_for(args.model, prefix_caching=False, **options)
    rng = random.Random(0)
    words = lambda n: [rng.randrange(3, kept.tokenizer.vocab_size) for _ in range(n)]  # noqa: E731 - random ids
    try:
        if kept.state_cache is None:
            sys.exit(f"{args.model}: no per-sequence states (linear attention, Mamba2) to keep")
        print(f"{args.model}: at most {kept.state_cache.count} states kept; blocks of {kept.options.block_size}")
        print(f"{'turn' if not args.users else 'user':>4} {'prompt':>7} {'cached':>7} {'first token: kept':>18} {'none':>7} {'ratio':>6}"
              f" {'turn: kept':>11} {'none':>7} {'ratio':>6}")
        for engine in (kept, plain):  # warm up: a first step pays for what later ones reuse
            asyncio.run(one_turn(engine, words(20), 2))
        if args.fresh:
            return fresh_prompts(kept, plain, [words(args.system) for _ in range(args.fresh)])
        prompt = words(args.system)
        chat = args.users == 0
        if not chat:  # each "turn" a user's one message after the system prompt
            system, args.turns = prompt, args.users
            prompt = system + words(args.message)
        for turn in range(1, args.turns + 1):
            if args.plain_first:
                same, _, first_plain, whole_plain = asyncio.run(one_turn(plain, prompt, args.max_tokens))
            answer, cached, first, whole = asyncio.run(one_turn(kept, prompt, args.max_tokens))
            if not args.plain_first:
                same, _, first_plain, whole_plain = asyncio.run(one_turn(plain, prompt, args.max_tokens))
            if same != answer:
                sys.exit(f"turn {turn}: the engines' answers differ")
            print(f"{turn:>4} {len(prompt):>7} {cached:>7} {first:>17.3f}s {first_plain:>6.3f}s {first_plain / first:>5.2f}x"
                  f" {whole:>10.3f}s {whole_plain:>6.3f}s {whole_plain / whole:>5.2f}x")
            prompt = prompt + answer + words(args.message) if chat else system + words(args.message)
    finally:
        asyncio.run(kept.stop())
        asyncio.run(plain.stop())


if __name__ == "__main__":
    main()
