"""Operations and security over HTTP: keys, limits, admission, metrics, request ids, logs,
graceful shutdown."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from server import RouterProcess, llamacpp_config
from sse_util import parse_events

KEY, LIMITED = "sk-test-full-0123456789", "sk-test-limited-9876543210"
TEMPLATE = Path(__file__).parent / "data" / "strict_chatml.jinja"
MARKER = "zebra-umbrella-7731"  # a prompt word that must never reach the logs


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    config = f"""
[server]
api_keys = ["env:ROUTER_TEST_KEY"]
shutdown_timeout = 30

[server.limits]
max_n = 4
max_stop = 2

[[keys]]
key = "env:ROUTER_LIMITED_KEY"
models = ["smollm2"]
""" + llamacpp_config("smollm2", extra="max_concurrency = 1\nmax_queue = 2\nmax_tokens_limit = 64") + llamacpp_config(
        "smollm2-b", extra=f'chat_template = "{TEMPLATE}"')
    router = RouterProcess(config, tmp_path_factory.mktemp("ops"),
                           env={"ROUTER_TEST_KEY": KEY, "ROUTER_LIMITED_KEY": LIMITED}, wait_ready=False,
                           log_level="info")
    router.wait_health(200)
    yield router
    router.stop()


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def chat(ops, body, key=KEY, headers=None):
    headers = {**(auth(key) if key else {}), **(headers or {})}
    return httpx.post(f"{ops.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


MSG = [{"role": "user", "content": f"Say hi {MARKER}"}]


def test_keys_are_required_except_on_health_and_version(ops):
    for key in (None, "sk-wrong"):
        r = chat(ops, {"model": "smollm2", "messages": MSG, "max_tokens": 2}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert chat(ops, {"model": "smollm2", "messages": MSG, "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{ops.url}/health").status_code == 200
    assert httpx.get(f"{ops.url}/version").status_code == 200
    for path in ("/metrics", "/v1/models"):
        assert httpx.get(f"{ops.url}{path}").status_code == 401
        assert httpx.get(f"{ops.url}{path}", headers=auth()).status_code == 200
    r = httpx.post(f"{ops.url}/tokenize", json={"model": "smollm2", "prompt": "x"}, headers={"Authorization": "Basic abc"})
    assert r.status_code == 401


def test_a_limited_key_sees_only_its_models(ops):
    models = httpx.get(f"{ops.url}/v1/models", headers=auth(LIMITED)).json()["data"]
    assert [m["id"] for m in models] == ["smollm2"]
    r = chat(ops, {"model": "smollm2-b", "messages": MSG, "max_tokens": 2}, key=LIMITED)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `smollm2-b` does not exist."
    assert httpx.get(f"{ops.url}/v1/models/smollm2-b", headers=auth(LIMITED)).status_code == 404
    assert chat(ops, {"model": "smollm2-b", "messages": MSG, "max_tokens": 2}).status_code == 200


def test_limits(ops):
    r = chat(ops, {"model": "smollm2", "messages": MSG, "n": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = chat(ops, {"model": "smollm2", "messages": MSG, "stop": ["a", "b", "c"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(f"{ops.url}/v1/chat/completions", content=b"{" + b" " * (9 << 20) + b"}", headers=auth(), timeout=60)
    assert r.status_code == 413 and "error" in r.json()
    r = chat(ops, {"model": "smollm2", "messages": MSG, "max_tokens": 65})
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"]
    r = chat(ops, {"model": "smollm2", "messages": MSG, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 64  # no max_tokens: capped by max_tokens_limit


def test_a_template_that_raises_is_a_400_with_its_message(ops):
    r = chat(ops, {"model": "smollm2-b", "messages": [{"role": "user", "content": "boom"}]})
    assert r.status_code == 400 and "refuses to say boom" in r.json()["error"]["message"]


def test_admission_queue_full_is_an_immediate_429_and_gone_clients_leave_it(ops):
    long = {"model": "smollm2", "messages": MSG, "max_tokens": 64, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(timeout=120, headers=auth()) as client:
            async def stream():
                async with client.stream("POST", f"{ops.url}/v1/chat/completions", json=long) as r:
                    return r.status_code, parse_events(await r.aread())

            running = asyncio.create_task(stream())
            await asyncio.sleep(0.5)
            queued = [asyncio.create_task(stream()) for _ in range(2)]
            while ops.health()[1]["models"]["smollm2"]["queued"] < 2:
                await asyncio.sleep(0.02)
            r = await client.post(f"{ops.url}/v1/chat/completions", json={**long, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            # answered at once: the running and queued requests are all still going
            assert not running.done() and not any(q.done() for q in queued)
            queued[1].cancel()  # this client gives up while waiting
            await asyncio.gather(queued[1], return_exceptions=True)
            deadline = time.monotonic() + 5
            while ops.health()[1]["models"]["smollm2"]["queued"] != 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert ops.health()[1]["models"]["smollm2"]["queued"] == 1
            for status, events in await asyncio.gather(running, queued[0]):
                assert status == 200 and events[-1]["choices"][0]["finish_reason"] == "length"

    asyncio.run(main())


def test_request_ids_and_one_log_line_per_request_without_content(ops):
    r = chat(ops, {"model": "smollm2", "messages": MSG, "max_tokens": 3}, headers={"X-Request-Id": "trace-abc-123"})
    assert r.headers["x-request-id"] == "trace-abc-123"
    r2 = chat(ops, {"model": "nope", "messages": MSG})
    assert re.fullmatch(r"[0-9a-f]{32}", r2.headers["x-request-id"])
    time.sleep(0.3)
    log = ops.log.read_text()
    lines = [l for l in log.splitlines() if "[trace-abc-123]" in l]
    assert len(lines) == 1 and "model=smollm2 backend=llamacpp status=200" in lines[0]
    assert "completion_tokens=3" in lines[0] and "ttft_ms=" in lines[0] and "duration_ms=" in lines[0]
    assert MARKER not in log


def test_metrics_count_what_happened(ops):
    before = httpx.get(f"{ops.url}/metrics", headers=auth()).text

    def count(text, pattern):
        m = re.search(re.escape(pattern) + r" (\S+)", text)
        return float(m.group(1)) if m else 0.0

    labels = 'model="smollm2",backend="llamacpp"'
    for _ in range(3):
        chat(ops, {"model": "smollm2", "messages": MSG, "max_tokens": 4, "ignore_eos": True})
    after = httpx.get(f"{ops.url}/metrics", headers=auth()).text
    assert count(after, f'router:requests_total{{{labels},status="200"}}') - count(before, f'router:requests_total{{{labels},status="200"}}') == 3
    assert count(after, f"router:generation_tokens_total{{{labels}}}") - count(before, f"router:generation_tokens_total{{{labels}}}") == 12
    assert count(after, f'router:request_success_total{{{labels},finished_reason="length"}}') >= 3
    assert "router:time_to_first_token_seconds_bucket" in after and "router:inter_token_latency_seconds_count" in after
    assert re.search(rf"router:num_requests_running{{{re.escape(labels)}}} 0", after)
    e2e = f"router:e2e_request_latency_seconds_count{{{labels}}}"
    assert count(after, e2e) - count(before, e2e) == 3
    # Made-up model names count as one series, not one each.
    for name in ("made-up-1", "made-up-2"):
        assert chat(ops, {"model": name, "messages": MSG}).status_code == 404
    final = httpx.get(f"{ops.url}/metrics", headers=auth()).text
    assert "made-up" not in final
    unknown = 'router:requests_total{model="-",backend="-",status="404"}'
    assert count(final, unknown) - count(after, unknown) == 2


def test_sigterm_lets_running_streams_finish_then_exits_zero(tmp_path):
    router = RouterProcess(llamacpp_config("smollm2"), tmp_path)
    try:
        body = {"model": "smollm2", "messages": MSG, "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(l for l in lines if l.startswith("data: ") and '"content":"' in l and '"content":""' not in l)
            router.proc.send_signal(signal.SIGTERM)
            rest = [l for l in lines if l]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert router.proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{router.url}/health", timeout=2)
    finally:
        router.stop()
