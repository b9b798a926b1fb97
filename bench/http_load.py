"""Closed-loop streaming load over HTTP: n requests, at most c in flight, timed per chunk.

One ``httpx.AsyncClient`` serves every request of a level; the SSE stream is parsed by hand
(``data: {...}`` lines, then ``data: [DONE]``) so the timing of each chunk is the moment its line
arrived, with no SDK buffering in between.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

from workload import RequestTiming, prompt, summarize

PROGRESS_EVERY_S = 15.0


class StreamError(RuntimeError):
    """The router answered with an HTTP error or an in-stream error event."""


def request_body(model: str, i: int, max_tokens: int, extra: dict | None = None) -> dict:
    """Greedy, exactly ``max_tokens`` tokens (``ignore_eos`` is a vendor extra both local
    backends honour), usage reported in the last chunk; ``extra`` fields added as they are."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    """Send one streaming chat request; TTFT is measured from just before sending to the first
    chunk whose delta has text, ITL between consecutive chunks with text."""
    start = time.perf_counter()
    first: float | None = None
    last = 0.0
    timing = RequestTiming(ttft=0.0)
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise StreamError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"error event: {event['error']}")
            if event.get("usage"):
                timing.completion_tokens = event["usage"]["completion_tokens"]
                timing.prompt_tokens = event["usage"]["prompt_tokens"]
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                if first is None:
                    first = now
                    timing.ttft = now - start
                else:
                    timing.itls.append(now - last)
                last = now
    if first is None:
        raise StreamError(f"no content chunk for prompt {body['messages'][0]['content']!r}")
    return timing


async def _run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int,
                     label: str, extra: dict | None = None) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timings: list[RequestTiming] = []
    next_index = 0

    async def worker(client: httpx.AsyncClient) -> None:
        # Each worker is one in-flight slot: it sends its next request as soon as the last one
        # ends, so exactly `concurrency` requests are open until the queue runs dry.
        nonlocal next_index
        while next_index < n_requests:
            i = next_index
            next_index += 1
            timings.append(await stream_one(client, url, request_body(model, i, max_tokens, extra)))

    async def ticker(started: float) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            print(f"  [{label}] c={concurrency}: {len(timings)}/{n_requests} requests done, "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0)) as client:
        started = time.perf_counter()
        tick = asyncio.create_task(ticker(started))
        try:
            await asyncio.gather(*(worker(client) for _ in range(min(concurrency, n_requests))))
        finally:
            tick.cancel()
        wall = time.perf_counter() - started
    return summarize(timings, wall, concurrency, max_tokens)


def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, label: str,
              extra: dict | None = None) -> dict:
    """One concurrency level against a running router; the summary of :func:`workload.summarize`."""
    return asyncio.run(_run_level(url, model, concurrency, n_requests, max_tokens, label, extra))


def warm_up(url: str, model: str, max_tokens: int = 8, concurrency: int = 1) -> None:
    """``concurrency`` short requests at once, so the first measured ones do not pay for lazy
    start-up work (on a GPU, each kernel's first use of a shape: bench/engines.py)."""
    asyncio.run(_run_level(url, model, concurrency, concurrency, max_tokens, "warm-up"))
