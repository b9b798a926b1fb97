"""Faults: clients that leave at every stage, on every backend; models that fail to load."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from server import GGUF, RouterProcess, llamacpp_config, torch_config

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse."}]


def idle(server, model, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.health()[1]["models"][model]
        if stats["running"] == 0 and stats["waiting"] == 0 and stats.get("kv_blocks_used", 0) == 0:
            return stats
        time.sleep(0.05)
    return server.health()[1]["models"][model]


def requests_total(server, model) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(v) for v in re.findall(rf'^router:requests_total{{model="{re.escape(model)}"[^}}]*}} (\S+)$', text, re.M))


def raw_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


STAGES = ["before_first_byte", "after_role_chunk", "mid_stream", "at_usage_chunk"]


@pytest.mark.parametrize("stage", STAGES)
def test_client_leaving_at_any_stage_frees_everything(server, model, stage):
    body = {"model": model, "messages": MESSAGES, "stream": True, "max_tokens": 40, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    before = requests_total(server, model)
    s = raw_request(server.port, body)
    if stage == "after_role_chunk":
        read_until(s, b'"role":"assistant"')
    elif stage == "mid_stream":
        got = b""
        while got.count(b"data: ") < 6:
            got += s.recv(65536)
    elif stage == "at_usage_chunk":
        read_until(s, b'"finish_reason":"length"')
    s.close()
    stats = idle(server, model)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats.get("kv_blocks_used", 0) == 0, stats
    # The request was counted exactly once (200 if it had finished, 499 if it was cut).
    deadline = time.monotonic() + 5
    while requests_total(server, model) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_total(server, model) == before + 1
    # and the model serves the next one normally
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_models_that_fail_to_load_say_why_and_others_keep_serving(tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    config = (llamacpp_config("good")
              + f'\n[[models]]\nname = "missing"\nbackend = "llamacpp"\npath = "{tmp_path / "nope.gguf"}"\n'
              + f'\n[[models]]\nname = "corrupt"\nbackend = "llamacpp"\npath = "{corrupt}"\n'
              + torch_config("corrupt-torch").replace(GGUF, str(corrupt)))
    router = RouterProcess(config, tmp_path, wait_ready=False)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            code, body = router.health()
            states = {n: m["state"] for n, m in body["models"].items()}
            if "loading" not in states.values():
                break
            time.sleep(0.2)
        # The router takes requests: /health is 200 and says which models failed, and why.
        assert code == 200 and states == {"good": "ready", "missing": "failed", "corrupt": "failed",
                                          "corrupt-torch": "failed"}
        assert "nope.gguf" in body["models"]["missing"]["error"]
        assert body["models"]["corrupt"]["error"] and body["models"]["corrupt-torch"]["error"]
        status = {m["id"]: m["status"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]}
        for name in ("missing", "corrupt", "corrupt-torch"):
            assert status[name]["value"] == "failed" and status[name]["reason"] == body["models"][name]["error"]
        r = httpx.post(f"{router.url}/v1/chat/completions", json={"model": "good", "messages": MESSAGES, "max_tokens": 3})
        assert r.status_code == 200
        r = httpx.post(f"{router.url}/v1/chat/completions", json={"model": "corrupt", "messages": MESSAGES})
        assert r.status_code == 503 and "failed" in r.json()["error"]["message"]
    finally:
        router.stop()
