"""Remote relay overhead: what the router costs in front of an OpenAI-compatible upstream.

One command starts, on loopback, a canned upstream (a few lines of raw ASGI under uvicorn that
answers instantly) and one router worker whose ``remote`` models point at it, then measures with
``wrk`` (a native load generator; Debian: ``apt-get install -y wrk``):

- requests/s and p50/p99 latency, client -> upstream directly versus client -> router -> upstream,
  for non-streaming requests and for 16-token streams, at concurrency 1 and 32;
- the gaps between events of a stream whose upstream emits one event every 10 ms, directly and
  through the router (a Python client timestamps every event): the distributions must match;
- for reference, the same router app with an in-process backend that answers the canned reply
  itself ("floor"): how much of the added time is request handling, how much relaying.

Results go to stdout and, unless ``--no-docs``, into ``docs/benchmarks.md`` under the heading
"Remote relay overhead" (only that section is rewritten).

    .venv/bin/python bench/remote.py                 # about 3 minutes
    .venv/bin/python bench/remote.py --duration 3 --no-docs
    .venv/bin/python bench/remote.py ab --base HEAD~1   # a change, side by side with the code before it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Remote relay overhead"
STREAM_TOKENS = 16
PACED_EVENTS = 50
PACED_GAP_S = 0.010


# --- the canned upstream ----------------------------------------------------------------------


def _canned() -> dict[str, bytes]:
    def chunk(choice: dict, **extra: object) -> bytes:
        payload = {"id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": 1730000000,
                   "model": "canned", "choices": [choice] if choice else [], **extra}
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    body = {"id": "chatcmpl-canned", "object": "chat.completion", "created": 1730000000, "model": "canned",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Red, green and blue."},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 14, "completion_tokens": 6, "total_tokens": 20}}
    return {
        "json": json.dumps(body, separators=(",", ":")).encode(),
        "role": chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}),
        "token": chunk({"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}),
        "finish": chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}),
        "usage": chunk({}, usage={"prompt_tokens": 14, "completion_tokens": STREAM_TOKENS, "total_tokens": 30}),
    }


def upstream_app():  # type: ignore[no-untyped-def]
    """Raw ASGI: a canned chat completion, or a stream of 16 tokens at once, or (model `paced`)
    50 tokens one every 10 ms. The usage chunk comes only when asked for, like vLLM's."""
    c = _canned()
    json_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(c["json"])).encode())]
    sse_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}'})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if b'"stream":true' not in body:
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": c["json"]})
            return
        paced = b'"model":"paced"' in body
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        await send({"type": "http.response.body", "body": c["role"], "more_body": True})
        for _ in range(PACED_EVENTS if paced else STREAM_TOKENS):
            if paced:
                await asyncio.sleep(PACED_GAP_S)
            await send({"type": "http.response.body", "body": c["token"], "more_body": True})
        await send({"type": "http.response.body", "body": c["finish"], "more_body": True})
        if b'"include_usage":true' in body:
            await send({"type": "http.response.body", "body": c["usage"], "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


def serve_upstream(port: int, stack: str = "auto") -> None:
    """``stack``: ``auto`` is uvicorn's own choice (uvloop and httptools, both installed with
    the router), ``stdlib`` the pure-Python pair (asyncio, h11): a slower upstream."""
    import uvicorn

    choice = {"http": "h11", "loop": "asyncio"} if stack == "stdlib" else {}
    uvicorn.run(upstream_app(), host="127.0.0.1", port=port, interface="asgi3", lifespan="off",
                log_level="warning", access_log=False, **choice)


# --- the floor: the same router with nothing behind it ------------------------------------------


def serve_floor(port: int) -> None:
    """The router app with an in-process backend that answers the canned reply at once: what
    the router's own request handling costs, before any relaying."""
    import logging

    import uvicorn

    from router import sse
    from router.app import create_app
    from router.backend import Backend
    from router.config import parse_config
    from router.hookspecs import hookimpl
    from router.plugins import load_plugins

    c = _canned()
    events = [c["role"], *[c["token"]] * STREAM_TOKENS, c["finish"], sse.DONE]

    class Canned(Backend):
        async def chat(self, request, params):  # type: ignore[no-untyped-def]
            if not params.stream:
                return c["json"]

            async def stream():  # type: ignore[no-untyped-def]
                for event in events:
                    yield event

            return stream()

        async def complete(self, request, params):  # type: ignore[no-untyped-def]
            return c["json"]

    class CannedPlugin:
        __name__ = "canned"

        @hookimpl
        def register_backends(self, register):  # type: ignore[no-untyped-def]
            register("canned", Canned)

    logging.basicConfig(level=logging.WARNING)
    plugins = load_plugins(extra=[CannedPlugin()])
    config = parse_config(b'[server]\nlog_level = "warning"\n[[models]]\nname = "relay"\nbackend = "canned"\n',
                          plugins.backends)
    uvicorn.run(create_app(config, plugins, tune_gc=True), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- the HTTP client choice -------------------------------------------------------------------


def serve_client_relay(port: int, upstream_port: int, client: str) -> None:
    """A minimal Litestar relay (decode, rewrite `model`, POST upstream, rewrite, answer) with
    one HTTP client: the remote backend's own (``backends.remote.http``), httpx or aiohttp.
    What the choice of client rests on."""
    import logging

    import msgspec
    import uvicorn
    from litestar import Litestar, Request, Response, post

    url = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
    decode, encode = msgspec.json.decode, msgspec.json.encode
    headers = {"content-type": "application/json"}
    state: dict = {}

    async def startup() -> None:
        if client == "httpx":
            import httpx

            logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
            state["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))
        elif client == "aiohttp":
            import aiohttp

            state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), skip_auto_headers=("Accept-Encoding",))
        else:
            from backends.remote.http import Pool

            state["c"] = Pool(url.removesuffix("/chat/completions"))

    @post("/v1/chat/completions", signature_namespace={"Request": Request, "Response": Response})
    async def chat(request: Request) -> Response:
        body = decode(await request.body())
        body["model"] = "canned"
        if client == "httpx":
            r = await state["c"].post(url, content=encode(body), headers=headers)
            out = decode(r.content)
        elif client == "aiohttp":
            async with state["c"].post(url, data=encode(body), headers=headers) as r:
                out = decode(await r.read())
        else:
            r = await state["c"].request("POST", "/v1/chat/completions", body=encode(body), headers=headers)
            out = decode(await r.read())
            r.release()
        out["model"] = "relay"
        return Response(content=encode(out), media_type="application/json")

    app = Litestar([chat], on_startup=[startup], logging_config=None)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def compare_clients(args: argparse.Namespace) -> None:
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    up_port = free_port()
    clients = ["own", "httpx"] + (["aiohttp"] if _importable("aiohttp") else [])
    ports = {client: free_port() for client in clients}
    procs = [subprocess.Popen([sys.executable, __file__, "upstream", "--port", str(up_port)])]
    try:
        for client, port in ports.items():
            procs.append(subprocess.Popen([sys.executable, __file__, "client-relay", "--port", str(port),
                                           "--upstream", str(up_port), "--client", client]))
        wait_http(f"http://127.0.0.1:{up_port}/health")
        for port in ports.values():
            wait_port(port)
        script = lua_script(tmp, "json", {"model": "relay", "messages": [{"role": "user", "content": "hi"}]})
        print("| client | c | req/s | p50 | p99 |\n| --- | --- | --- | --- | --- |")
        for c in (1, 32):
            for client, port in ports.items():
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                wrk(url, script, c, 1)  # warm-up
                r = wrk(url, script, c, args.duration)
                print(f"| {client} | {c} | {r.rps:,.0f} | {r.p50_ms:.2f} ms | {r.p99_ms:.2f} ms |", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


# --- A/B: the router at another commit, side by side -------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def compare_commits(args: argparse.Namespace) -> None:
    """The router at ``--base`` (a git revision, in a temporary worktree) and the working tree,
    both in front of one canned upstream, measured in alternating wrk rounds: on a shared machine
    whose speed drifts by tens of percent within minutes, only side-by-side medians tell a
    change of a few percent. Reports requests/s and the router process's CPU time per request."""
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    base_tree = tmp / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base],
                   check=True, capture_output=True)
    up_port = free_port()
    ports = {"base": free_port(), "work": free_port()}
    procs = []
    try:
        log = open(tmp / "servers.log", "wb")
        procs.append(subprocess.Popen([sys.executable, __file__, "upstream", "--port", str(up_port)], stdout=log, stderr=log))
        wait_http(f"http://127.0.0.1:{up_port}/health")
        (tmp / "router.toml").write_text(ROUTER_TOML.format(port=up_port))
        for name, tree in (("base", base_tree), ("work", ROOT)):
            # `-m` puts the working directory first on sys.path: each router imports its own tree.
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(tmp / "router.toml"),
                 "--port", str(ports[name])], cwd=tree, stdout=log, stderr=log))
        for port in ports.values():
            wait_http(f"http://127.0.0.1:{port}/health")
        pids = dict(zip(ports, (p.pid for p in procs[1:])))
        body = {"model": "relay", "messages": [{"role": "user", "content": "Name three colours."}],
                "max_tokens": STREAM_TOKENS, **({"stream": True} if args.kind == "stream16" else {})}
        script = lua_script(tmp, args.kind, body)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ports}
        for name, port in ports.items():
            wrk(f"http://127.0.0.1:{port}/v1/chat/completions", script, args.c, 1)  # warm-up
        for i in range(args.rounds):
            order = list(ports) if i % 2 == 0 else list(reversed(ports))
            for name in order:
                cpu = _cpu_seconds(pids[name])
                r = wrk(f"http://127.0.0.1:{ports[name]}/v1/chat/completions", script, args.c, args.round_seconds)
                us = (_cpu_seconds(pids[name]) - cpu) / max(r.requests, 1) * 1e6
                samples[name].append((r.rps, us))
                print(f"  round {i + 1:2} {name}: {r.rps:8,.0f} req/s  {us:6.1f} us CPU/request", flush=True)
        med = {name: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for name, v in samples.items()}
        print(f"\n{args.kind}, c={args.c}, {args.rounds} rounds of {args.round_seconds:g} s, base = {args.base}")
        for name, (rps, us) in med.items():
            print(f"  {name}: median {rps:8,.0f} req/s, {us:6.1f} us of router CPU per request")
        print(f"  work / base: requests/s x{med['work'][0] / med['base'][0]:.3f}, "
              f"CPU per request x{med['work'][1] / med['base'][1]:.3f}")
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], capture_output=True)


# --- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} never answered 200")


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


ROUTER_TOML = """
[server]
log_level = "warning"

[[models]]
name = "relay"
backend = "remote"
upstream_model = "canned"
[[models.deployments]]
url = "http://127.0.0.1:{port}/v1"

[[models]]
name = "paced-relay"
backend = "remote"
upstream_model = "paced"
[[models.deployments]]
url = "http://127.0.0.1:{port}/v1"
"""


# --- wrk ---------------------------------------------------------------------------------------


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"wrk latency `{text}`")
    return float(m.group(1)) * _UNITS[m.group(2)]


def lua_script(tmp: Path, name: str, body: dict) -> Path:
    path = tmp / f"{name}.lua"
    payload = json.dumps(body, separators=(",", ":")).replace("\\", "\\\\").replace("'", "\\'")
    path.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = '{payload}'\n"
    )
    return path


def wrk(url: str, script: Path, connections: int, duration: float) -> WrkResult:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", "--timeout", "10s",
           "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(x) for x in m.groups())
    return WrkResult(rps, p50, p99, requests, errors)


# --- inter-event gaps --------------------------------------------------------------------------


async def _event_times(port: int, body: bytes) -> list[float]:
    """One stream over a raw connection; the arrival time of every complete event."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    times: list[float] = []
    tail = b""
    while data := await reader.read(65536):
        now = time.perf_counter()
        # "\n\n" ends an event; chunked framing is "\r\n" and never adds one.
        times.extend([now] * (tail + data).count(b"\n\n"))
        tail = data[-1:]
    writer.close()
    return times


async def _gaps(port: int, model: str, concurrency: int, streams: int) -> list[float]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True},
                      separators=(",", ":")).encode()
    gaps: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            times = await _event_times(port, body)
        # role, then PACED_EVENTS tokens 10 ms apart: the gaps between tokens
        tokens = times[1:1 + PACED_EVENTS]
        assert len(tokens) == PACED_EVENTS, len(times)
        gaps.extend((b - a) * 1e3 for a, b in zip(tokens, tokens[1:]))

    await asyncio.gather(*(one() for _ in range(streams)))
    return gaps


def gap_stats(gaps: list[float]) -> dict[str, float]:
    q = statistics.quantiles(gaps, n=100, method="inclusive")
    return {"p1": q[0], "p50": statistics.median(gaps), "p99": q[98], "max": max(gaps),
            "clumped": sum(g < 2.0 for g in gaps) / len(gaps), "n": len(gaps)}


# --- the run -----------------------------------------------------------------------------------


def machine() -> str:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from importlib.metadata import PackageNotFoundError, version

    mods = []
    for name in ("uvicorn", "litestar", "msgspec"):
        try:
            mods.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    fast = [n for n in ("httptools", "uvloop") if _importable(n)]
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {', '.join(mods)}; "
            f"uvicorn's HTTP parser: {'httptools' if 'httptools' in fast else 'h11 (pure Python)'}, "
            f"event loop: {'uvloop' if 'uvloop' in fast else 'asyncio'}")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def run(args: argparse.Namespace) -> str:
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    up_port, router_port, floor_port = free_port(), free_port(), free_port()
    load = os.getloadavg()[0]
    procs = []
    try:
        log = open(tmp / "servers.log", "wb")
        procs.append(subprocess.Popen([sys.executable, __file__, "upstream", "--port", str(up_port),
                                       "--stack", args.upstream_stack],
                                      stdout=log, stderr=log))
        wait_http(f"http://127.0.0.1:{up_port}/health")
        (tmp / "router.toml").write_text(ROUTER_TOML.format(port=up_port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(tmp / "router.toml"),
             "--port", str(router_port)], cwd=ROOT, stdout=log, stderr=log))
        procs.append(subprocess.Popen([sys.executable, __file__, "floor", "--port", str(floor_port)],
                                      cwd=ROOT, stdout=log, stderr=log))
        wait_http(f"http://127.0.0.1:{router_port}/health")
        wait_http(f"http://127.0.0.1:{floor_port}/health")

        targets = {"direct": (up_port, "canned"), "router": (router_port, "relay"), "floor": (floor_port, "relay")}
        kinds = {"json": {}, "stream16": {"stream": True}}
        rows = []
        for kind, extra in kinds.items():
            for c in (1, 32):
                result = {}
                for target, (port, model) in targets.items():
                    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}],
                            "max_tokens": STREAM_TOKENS, **extra}
                    script = lua_script(tmp, f"{target}-{kind}", body)
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    wrk(url, script, c, 1)  # warm-up: connections, caches
                    result[target] = wrk(url, script, c, args.duration)
                    r = result[target]
                    print(f"  {kind:8} c={c:<3} {target:7} {r.rps:9.0f} req/s  p50 {r.p50_ms:7.2f} ms  "
                          f"p99 {r.p99_ms:7.2f} ms  errors {r.errors}", flush=True)
                rows.append((kind, c, result["direct"], result["router"], result["floor"]))

        gap_rows = []
        for c in (1, 32):
            streams = 10 if c == 1 else 64
            direct = gap_stats(asyncio.run(_gaps(up_port, "paced", c, streams)))
            routed = gap_stats(asyncio.run(_gaps(router_port, "paced-relay", c, streams)))
            gap_rows.append((c, direct, routed))
            print(f"  gaps c={c}: direct p50 {direct['p50']:.2f} ms p99 {direct['p99']:.2f} ms; "
                  f"router p50 {routed['p50']:.2f} ms p99 {routed['p99']:.2f} ms", flush=True)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
    return report(rows, gap_rows, args, load)


def report(rows, gap_rows, args, load: float) -> str:  # type: ignore[no-untyped-def]
    command = ".venv/bin/python bench/remote.py" + (f" --duration {args.duration:g}" if args.duration != 10 else "")
    if args.upstream_stack != "auto":
        command += f" --upstream-stack {args.upstream_stack}"
    upstream = ("the canned upstream on asyncio and h11" if args.upstream_stack == "stdlib"
                else "the canned upstream on the same uvicorn stack")
    lines = [
        HEADING, "",
        f"`{command}` (wrk {_wrk_version()}, one router worker, upstream and wrk on the same machine;",
        f"{machine()}; {upstream}; load average {load:.2f} at the start). `wrk -t1 -c<c> -d{args.duration:g}s` per cell after a",
        "1 s warm-up; a 16-token stream counts as one request and its latency is the whole stream.",
        "",
        "| request | c | direct req/s | router req/s | router / direct | direct p50 | router p50 | added p50 | direct p99 | router p99 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, c, d, r, _ in rows:
        name = "non-streaming" if kind == "json" else "16-token stream"
        lines.append(
            f"| {name} | {c} | {d.rps:,.0f} | {r.rps:,.0f} | {r.rps / d.rps:.0%} | {d.p50_ms:.2f} ms | "
            f"{r.p50_ms:.2f} ms | {r.p50_ms - d.p50_ms:+.2f} ms | {d.p99_ms:.2f} ms | {r.p99_ms:.2f} ms |"
        )
    errors = sum(d.errors + r.errors + f.errors for _, _, d, r, f in rows)
    lines += ["", f"Errors (non-2xx, socket): {errors}.", ""]
    lines += [
        "Where the added time goes: the same router app with an in-process backend that answers the",
        "canned reply itself (`floor`: request handling only, no relaying), next to the relay:",
        "",
        "| request | c | floor req/s | floor p50 | floor p50 - direct p50 | relay p50 - floor p50 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, c, d, r, f in rows:
        name = "non-streaming" if kind == "json" else "16-token stream"
        lines.append(f"| {name} | {c} | {f.rps:,.0f} | {f.p50_ms:.2f} ms | {f.p50_ms - d.p50_ms:+.2f} ms | "
                     f"{r.p50_ms - f.p50_ms:+.2f} ms |")
    lines += ["", "Targets:", ""]
    for kind, c, d, r, _ in rows:
        name = "non-streaming" if kind == "json" else "16-token streams"
        if c == 1:
            added = r.p50_ms - d.p50_ms
            lines.append(f"- {name}, c=1: the router adds {added:.2f} ms at p50 (target < 1 ms): "
                         f"{'met' if added < 1 else 'missed'}.")
        else:
            share = r.rps / d.rps
            lines.append(f"- {name}, c=32: the router sustains {share:.0%} of the direct requests/s "
                         f"(target >= 20%): {'met' if share >= 0.2 else 'missed'}.")
    lines += [
        "",
        f"Inter-event gaps of a stream whose upstream sends one event every {PACED_GAP_S * 1e3:g} ms "
        f"({PACED_EVENTS} events; a Python client timestamps each event as its bytes arrive; "
        "\"clumped\": gaps under 2 ms, i.e. two events arriving together):",
        "",
        "| c | path | gaps | p1 | p50 | p99 | max | clumped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c, direct, routed in gap_rows:
        for name, g in (("direct", direct), ("router", routed)):
            lines.append(f"| {c} | {name} | {g['n']} | {g['p1']:.2f} ms | {g['p50']:.2f} ms | {g['p99']:.2f} ms | "
                         f"{g['max']:.2f} ms | {g['clumped']:.1%} |")
    return "\n".join(lines) + "\n"


def _wrk_version() -> str:
    out = subprocess.run(["wrk", "--version"], capture_output=True, text=True)
    m = re.search(r"wrk (\S+)", out.stdout + out.stderr)
    return m.group(1) if m else "?"


def write_docs(section: str, path: Path, notes: str) -> None:
    """Replace (or append) only our section of docs/benchmarks.md."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = section + notes
    start = text.find(HEADING + "\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section + (text[end + 1:] if end != -1 else "")
        text = re.sub(r"\n{3,}", "\n\n", text)
    path.write_text(text)


NOTES_MARK = "<!-- remote-notes -->"


def _existing_notes(path: Path) -> str:
    """Hand-written analysis after the generated part of our section survives a rerun."""
    if not path.exists():
        return ""
    text = path.read_text()
    start = text.find(HEADING + "\n")
    if start == -1:
        return ""
    end = text.find("\n## ", start + len(HEADING))
    ours = text[start:end if end != -1 else len(text)]
    i = ours.find(NOTES_MARK)
    return "\n" + ours[i:].rstrip("\n") + "\n" if i != -1 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    up = sub.add_parser("upstream", help="(internal) serve the canned upstream")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--stack", choices=["auto", "stdlib"], default="auto")
    fl = sub.add_parser("floor", help="(internal) serve the router app with a canned in-process backend")
    fl.add_argument("--port", type=int, required=True)
    sub.add_parser("clients", help="the remote backend's own HTTP client, httpx and aiohttp (if installed) "
                                   "in a minimal relay (non-streaming, c=1 and 32)")
    ab = sub.add_parser("ab", help="the router at a git revision against the working tree, in alternating "
                                   "wrk rounds (medians of requests/s and router CPU per request)")
    ab.add_argument("--base", required=True, help="git revision to compare against (e.g. HEAD~3)")
    ab.add_argument("--rounds", type=int, default=12)
    ab.add_argument("--round-seconds", type=float, default=3)
    ab.add_argument("--kind", choices=["json", "stream16"], default="json")
    ab.add_argument("-c", type=int, default=32, help="concurrency (default 32)")
    cr = sub.add_parser("client-relay", help="(internal) serve a minimal relay with one client")
    cr.add_argument("--port", type=int, required=True)
    cr.add_argument("--upstream", type=int, required=True)
    cr.add_argument("--client", choices=["own", "httpx", "aiohttp"], required=True)
    parser.add_argument("--duration", type=float, default=10, help="seconds per wrk cell (default 10)")
    parser.add_argument("--upstream-stack", choices=["auto", "stdlib"], default="auto",
                        help="the canned upstream's event loop and HTTP parser: uvicorn's choice (uvloop, "
                             "httptools; default) or asyncio and h11 (a slower upstream)")
    parser.add_argument("--no-docs", action="store_true", help="only print; leave docs/benchmarks.md alone")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if args.command == "upstream":
        serve_upstream(args.port, args.stack)
        return
    if args.command == "floor":
        serve_floor(args.port)
        return
    if args.command == "client-relay":
        serve_client_relay(args.port, args.upstream, args.client)
        return
    if args.command == "clients":
        compare_clients(args)
        return
    if args.command == "ab":
        compare_commits(args)
        return
    section = run(args)
    print()
    print(section)
    if not args.no_docs:
        write_docs(section, args.docs, _existing_notes(args.docs))
        print(f"written to {args.docs}")


if __name__ == "__main__":
    main()
