"""A bounded load generator for the soak and load tests (loopback only)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from sse_util import parse_events

PROMPTS = ["Name a colour.", "Count to five.", "Say hello in French.", "What is 2+2?", "Name a fruit.",
           "Give me a word that rhymes with cat.", "Describe the sea in three words.", "Name a planet."]


@dataclass
class Outcome:
    counts: Counter = field(default_factory=Counter)
    malformed: list[str] = field(default_factory=list)
    sent: int = 0
    unsent: int = 0
    """Requests given up before their headers were written to the socket: the router never
    saw them, so they are in no router count."""

    def add(self, kind: str) -> None:
        self.counts[kind] += 1


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def tree_rss_kb(pid: int) -> int:
    """The RSS of a process and its children: a router and its worker processes."""
    import psutil

    total = rss_kb(pid)
    for child in psutil.Process(pid).children():
        try:
            total += child.memory_info().rss // 1024
        except psutil.NoSuchProcess:
            pass
    return total


class RssSamples:
    """A router's RSS over a run, its worker processes' included: pass :meth:`tick` as
    ``run_clients``' ``on_tick`` (once a second)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = time.monotonic()
        self.samples: list[tuple[float, int]] = []

    def tick(self) -> None:
        self.samples.append((time.monotonic() - self.start, tree_rss_kb(self.pid)))

    def growth_after(self, seconds: float) -> tuple[int, int, float]:
        """First and last kB sampled from ``seconds`` into the run on, and the growth between them."""
        warm = [rss for t, rss in self.samples if t >= seconds]
        return warm[0], warm[-1], (warm[-1] - warm[0]) / warm[0]


async def one_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, out: Outcome,
                      disconnect_p: float, stream_p: float = 1.0) -> None:
    stream = rng.random() < stream_p
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(4, 24), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    out.sent += 1
    disconnect_after = rng.randint(0, 6) if rng.random() < disconnect_p else None
    try:
        if not stream:
            if disconnect_after is not None:
                # the client gives up before the answer comes: its connection is closed
                written = []

                async def trace(event: str, info: dict) -> None:
                    if event == "http11.send_request_headers.complete":
                        written.append(event)

                try:
                    await asyncio.wait_for(client.post(f"{url}/v1/chat/completions", json=body,
                                                       extensions={"trace": trace}),
                                           timeout=rng.uniform(0.01, 0.3))
                    out.add("ok")
                except asyncio.TimeoutError:
                    out.add("disconnected")
                    out.unsent += not written
                return
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code == 200:
                data = r.json()
                ok = data["choices"][0]["finish_reason"] in ("stop", "length") and data["usage"]["total_tokens"] > 0
                out.add("ok" if ok else "malformed")
                if not ok:
                    out.malformed.append(r.text[:300])
            else:
                out.add(str(r.status_code))
                json.loads(r.text)["error"]  # every error is an envelope
            return
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out.add(str(r.status_code))
                json.loads(r.text)["error"]
                return
            if disconnect_after is not None:
                seen = 0
                async for _ in r.aiter_raw():
                    seen += 1
                    if seen > disconnect_after:
                        break
                out.add("disconnected")
                return
            raw = await r.aread()
        try:
            events = parse_events(raw)
            finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
            assert len(finishes) == 1 and "usage" in events[-1] and events[-1]["choices"] == []
            out.add("ok")
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on by the test
            out.add("malformed")
            out.malformed.append(f"{exc!r}: {raw[-300:]!r}")
    except (httpx.TransportError, json.JSONDecodeError, KeyError) as exc:
        out.add(f"transport:{type(exc).__name__}")


async def run_clients(url: str, models: list[str], clients: int, *, until: float | None = None,
                      total: int | None = None, disconnect_p: float = 0.1, stream_p: float = 1.0,
                      seed: int = 0, on_tick=None) -> Outcome:
    """``clients`` loops sending requests until the deadline or the total is reached."""
    out = Outcome()
    budget = [total]
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:
            while True:
                if until is not None and time.monotonic() >= until:
                    return
                if budget[0] is not None:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                await one_request(client, url, rng.choice(models), rng, out, disconnect_p, stream_p)

    async def ticker() -> None:
        while on_tick is not None:
            await asyncio.sleep(1)
            on_tick()

    tick = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(client_loop(i) for i in range(clients)))
    finally:
        tick.cancel()
    return out
