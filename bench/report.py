"""The benchmark's results as text tables: per level and engine, ratios, memory, bandwidth."""

from __future__ import annotations

LABELS = {"hf": "generate", "llamacpp": "llamacpp", "torch": "torch"}


def _ms(spread: dict) -> str:
    vals = [spread.get(k) for k in ("mean", "p50", "p90")]
    return " / ".join("-" if v is None else f"{v * 1000:.1f}" for v in vals)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def levels_table(results: dict, levels: list[int]) -> str:
    header = (f"{'engine':<9} {'conc':>4} {'reqs':>4} {'tokens':>6} {'wall s':>7} {'tok/s':>8} "
              f"{'TTFT ms mean/p50/p90':>24} {'ITL ms mean/p50/p90':>22} {'prompt':>6} {'other':>5}")
    lines = [header, "-" * len(header)]
    worst = 0.0
    for level in levels:
        for engine, res in results.items():
            row = res["levels"].get(str(level))
            if row is None:
                continue
            other = (row.get("cpu") or {}).get("other_cores")
            worst = max(worst, other or 0.0)
            short = f"  ({row['short_requests']} requests short of max_tokens!)" if row["short_requests"] else ""
            lines.append(
                f"{LABELS[engine]:<9} {level:>4} {row['requests']:>4} {row['completion_tokens']:>6} "
                f"{row['wall_s']:>7.1f} {row['tokens_per_s']:>8.1f} {_ms(row['ttft_s']):>24} "
                f"{_ms(row['itl_s']):>22} {row['mean_prompt_tokens']:>6.1f} {'-' if other is None else f'{other:.1f}':>5}{short}"
            )
        lines.append("")
    lines.append("prompt: mean prompt tokens (equal across engines = same prompts); other: cores busy with "
                 "processes outside the measurement, on average over the level")
    if worst > 0.25:
        lines.append(f"WARNING: other processes used up to {worst:.1f} cores during a level; "
                     "those numbers are disturbed, rerun on a quiet machine")
    return "\n".join(lines)


def ratios_table(ratios: dict) -> str:
    lines = [f"{'conc':>4} {'torch/generate':>15} {'torch/llamacpp':>15}   (aggregate tokens/s)"]
    for level, r in ratios.items():
        lines.append(f"{level:>4} {_ratio(*r['torch/generate']):>15} {_ratio(*r['torch/llamacpp']):>15}")
    return "\n".join(lines)


def memory_table(results: dict) -> str:
    lines = [f"{'engine':<9} {'peak RSS':>12} {'GPU peak allocated':>19} {'GPU peak reserved':>18}   process"]
    for engine, res in results.items():
        mem = res["memory"]
        cuda = mem.get("cuda") or {}
        lines.append(
            f"{LABELS[engine]:<9} {_mib(mem.get('peak_rss_bytes')):>12} {_mib(cuda.get('max_allocated_bytes')):>19} "
            f"{_mib(cuda.get('max_reserved_bytes')):>18}   {res['process']}"
        )
    return "\n".join(lines)


def bandwidth_table(bound: dict) -> str:
    b = bound
    return "\n".join([
        f"weights: {b['params']:,} parameters x {b['bytes_per_param']} bytes = {b['weight_bytes'] / 1e6:,.1f} MB; "
        f"bandwidth {b['bandwidth_gbs']:,.0f} GB/s -> bound {b['bound_tokens_per_s']:,.0f} tokens/s (one sequence)",
        f"torch, concurrency 1: aggregate {b['aggregate_tokens_per_s']:,.1f} tok/s = {b['aggregate_fraction'] * 100:.2f}% "
        f"of the bound; decode only (1 / mean ITL) {b['decode_tokens_per_s']:,.1f} tok/s = "
        f"{b['decode_fraction'] * 100:.2f}%",
    ])
