"""What every engine is asked to do, and how one level's timings become numbers.

The three engines must see the same work: the same chat prompts in the same order, the same
number of requests per concurrency level, the same output length. Both the HTTP client and the
Hugging Face worker import this module so the definition lives in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Short and different from each other: different prompt lengths exercise batched prefill, and no
# two requests share a whole prompt (a prefix cache still sees the shared chat-template preamble,
# as it would in real traffic).
PROMPTS = [
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "List four animals that live in the desert.",
    "Translate 'good morning' into Spanish.",
    "What does a compiler do?",
    "Suggest a name for a small black cat.",
    "How many legs does a spider have?",
    "Describe a sunset in two sentences.",
    "What is 12 times 7?",
    "Recommend a book for a long train ride.",
    "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.",
]


def prompt(i: int) -> str:
    """The i-th request's user message (the list is cycled)."""
    return PROMPTS[i % len(PROMPTS)]


def requests_for(level: int, fixed: int | None) -> int:
    """Requests sent at one concurrency level: ``fixed`` if given, else 2 x level and at least 8,
    so every level keeps its slots busy for about two rounds."""
    return fixed if fixed else max(2 * level, 8)


@dataclass
class RequestTiming:
    """One request as its client saw it: seconds to the first token, the gaps between later
    tokens (or chunks), and the tokens it produced."""

    ttft: float
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), without importing numpy."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _spread(values: list[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
    }


def summarize(timings: list[RequestTiming], wall_s: float, concurrency: int, max_tokens: int) -> dict:
    """One level's numbers: aggregate completion tokens/s over the level's wall time, TTFT over
    requests, ITL over every gap of every request (pooled, so long requests weigh more)."""
    tokens = sum(t.completion_tokens for t in timings)
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "completion_tokens": tokens,
        "short_requests": sum(1 for t in timings if t.completion_tokens != max_tokens),
        "mean_prompt_tokens": sum(t.prompt_tokens for t in timings) / len(timings) if timings else None,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_s": _spread([t.ttft for t in timings]),
        "itl_s": _spread([gap for t in timings for gap in t.itls]),
    }
