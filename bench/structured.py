"""What a JSON-schema constraint costs the torch engine: tokens/s with and without one.

One router process serves SmolLM2-135M-Instruct on the torch engine. At each concurrency level
the same streaming requests run twice, one level after the other: unconstrained, then with
``response_format: {"type": "json_schema", ...}``. The schema holds one string of at least
``MIN_CHARS`` characters, so no constrained request can finish before ``--max-tokens``: both runs
produce exactly the same number of tokens and only the per-token cost differs (the grammar
engine computing the allowed-token mask, applying it to the logits, advancing the matcher).

    .venv/bin/python bench/structured.py                      # levels 1,16, 64 tokens
    .venv/bin/python bench/structured.py --levels 1 --max-tokens 16

Target (docs/benchmarks.md): the constrained run keeps at least 80% of the unconstrained tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import http_load
from cpu_meter import CpuMeter
from engines import GGUF, MODEL_NAME, log
from router_server import RouterServer
from workload import requests_for

MODEL = MODEL_NAME["torch"]
MIN_CHARS = 1000  # several times what --max-tokens 64 can write: the grammar never completes
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": MIN_CHARS}},
    "required": ["answer"],
    "additionalProperties": False,
}
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 16],
                   help="concurrency levels (default: 1,16)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level and run (default: 2 x concurrency, at least 8)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", type=Path, default=None, help="also save every number here")
    return p.parse_args(argv)


def router_config(device: str, levels: list[int]) -> str:
    lines = ["[[models]]", f'name = "{MODEL}"', 'backend = "torch"', f'path = "{GGUF}"',
             "max_model_len = 2048", f'device = "{device}"', f"max_num_seqs = {max(16, *levels)}"]
    if device == "cpu":
        lines.append('weight_format = "int4"')  # what the default router.toml serves
    return "\n".join(lines) + "\n"


def check_constrained_output(url: str, max_tokens: int) -> str:
    """One non-streaming constrained request: its text must be the start of the schema's JSON."""
    body = http_load.request_body(MODEL, 0, max_tokens, CONSTRAINED)
    body.pop("stream_options")
    body["stream"] = False
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        text = json.load(r)["choices"][0]["message"]["content"]
    if not text.startswith('{"answer": "'):
        raise SystemExit(f"the constrained output does not follow the schema: {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict = {"command": " ".join(["bench/structured.py", *(argv or sys.argv[1:])]), "levels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = RouterServer("torch", router_config(args.device, args.levels), Path(tmp))
        try:
            http_load.warm_up(server.url, MODEL)
            sample = check_constrained_output(server.url, args.max_tokens)  # also compiles the schema once
            log(f"constrained output: {sample[:80]!r}...")
            for c in args.levels:
                n = requests_for(c, args.requests_per_level)
                row = {}
                for label, extra in (("free", None), ("json_schema", CONSTRAINED)):
                    meter = CpuMeter([server.proc.pid, "self"])
                    r = http_load.run_level(server.url, MODEL, c, n, args.max_tokens, label, extra)
                    r["cpu"] = meter.stop()
                    log(f"c={c} {label}: {r['tokens_per_s']:.1f} tok/s ({r['short_requests']} short)")
                    row[label] = r
                row["ratio"] = row["json_schema"]["tokens_per_s"] / row["free"]["tokens_per_s"]
                results["levels"][str(c)] = row
        finally:
            server.stop()
    print(table(results, args.max_tokens))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def table(results: dict, max_tokens: int) -> str:
    head = (f"{'conc':>4} {'run':<12} {'reqs':>4} {'tokens':>6} {'tok/s':>7} {'ITL p50 ms':>10} "
            f"{'TTFT p50 ms':>11} {'short':>5} {'other':>5}")
    lines = [head, "-" * len(head)]
    for c, row in results["levels"].items():
        for label in ("free", "json_schema"):
            r = row[label]
            other = (r.get("cpu") or {}).get("other_cores")
            lines.append(f"{c:>4} {label:<12} {r['requests']:>4} {r['completion_tokens']:>6} "
                         f"{r['tokens_per_s']:>7.1f} {r['itl_s']['p50'] * 1000:>10.1f} "
                         f"{r['ttft_s']['p50'] * 1000:>11.1f} {r['short_requests']:>5} "
                         f"{'-' if other is None else f'{other:.1f}':>5}")
        verdict = "met" if row["ratio"] >= 0.8 else "MISSED"
        lines.append(f"{c:>4} constrained / free: {row['ratio']:.0%} of the tokens/s (target >= 80%: {verdict})")
        lines.append("")
    lines.append(f"short: requests that ended before {max_tokens} tokens (should be 0); other: cores "
                 "busy outside the measurement")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
