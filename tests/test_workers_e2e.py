"""Local models in worker processes, over HTTP with real clients: loading on demand under a
memory limit, crashes (kill -9), keep_alive, the load and unload endpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from server import GGUF, RouterProcess, llamacpp_config, torch_config
from sse_util import chat_text, parse_events
from workers_util import Sampler, metric, plugin_site, resident, statuses, wait_for, workers

MiB = 1 << 20
HI = [{"role": "user", "content": "Name three colours."}]


def chat(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": HI, "max_tokens": 8, **extra},
                      timeout=120)


def llama(name: str, extra: str = "") -> str:
    return llamacpp_config(name, n_ctx=512, extra=extra)


def test_three_models_rotate_under_a_limit_that_fits_two(tmp_path):
    # A llama.cpp worker of SmolLM2 takes about 205 MiB (estimated 265 before its first load): two fit.
    config = '[server]\nmemory_limit = "500MiB"\n' + "".join(llama(n, "preload = false") for n in "abc")
    router = RouterProcess(config, tmp_path)
    try:
        with Sampler(router.proc.pid) as sampler:
            answers = []
            for name in "abcbacab":
                answers.append(chat(router.url, name))
                assert sum(s["value"] == "loaded" for s in statuses(router.url).values()) <= 2
            # Two at once on two models: both run, neither is unloaded under the other.
            done = []
            threads = [threading.Thread(target=lambda n=n: done.append(chat(router.url, n))) for n in "ca"]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert [r.status_code for r in answers + done] == [200] * 10, [r.text for r in answers + done]
        assert all(r.json()["choices"][0]["message"]["content"] for r in answers + done)
        assert sampler.most_workers == 2
        assert 0 < sampler.most_memory <= 500 * MiB
        assert metric(router.url, "router:model_unloads_total", model="a", cause="room") >= 1
        assert sum(metric(router.url, "router:model_loads_total", model=n) for n in "abc") >= 5
        loaded = {n for n, s in statuses(router.url).items() if s["value"] == "loaded"}
        assert set(workers(router.proc.pid)) == loaded and len(loaded) == 2
    finally:
        router.stop()


def test_a_killed_worker_fails_its_own_requests_and_no_one_elses(tmp_path):
    router = RouterProcess(llama("a") + llama("b"), tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        long = {"messages": HI, "max_tokens": 300, "extra_body": {"ignore_eos": True}}
        stream_a = client.chat.completions.create(model="a", stream=True, **long)
        stream_b = client.chat.completions.create(model="b", stream=True, **long)
        first_a, first_b = next(iter(stream_a)), next(iter(stream_b))
        assert first_a.choices and first_b.choices
        # b is also asked for a whole answer, which it has not sent when its worker dies.
        unanswered = {}
        waiting = threading.Thread(target=lambda: unanswered.update(r=chat(router.url, "b", max_tokens=300,
                                                                            ignore_eos=True)))
        waiting.start()
        time.sleep(0.3)
        victim = workers(router.proc.pid)["b"]
        os.kill(victim.pid, signal.SIGKILL)
        # b's stream ends with an error event (the SDK raises it), its whole answer is a 503 ...
        with pytest.raises(openai.APIError) as e:
            for _ in stream_b:
                pass
        assert "was killed by SIGKILL" in str(e.value)
        waiting.join()
        r = unanswered["r"]
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert "worker process of model `b`" in r.json()["error"]["message"]
        # ... while a's stream goes on to its end, untouched.
        finishes = [c.choices[0].finish_reason for c in stream_a if c.choices]
        assert finishes[-1] == "length"
        # b loads again on its next request, in a new worker.
        again = chat(router.url, "b")
        assert again.status_code == 200, again.text
        assert workers(router.proc.pid)["b"].pid != victim.pid
        assert metric(router.url, "router:worker_restarts_total", model="b") == 1
        assert metric(router.url, "router:model_unloads_total", model="b", cause="crash") == 1
        assert metric(router.url, "router:model_unloads_total", model="a", cause="crash") == 0
    finally:
        router.stop()


def test_repeated_crashes_mark_the_model_failed_with_the_reason(tmp_path):
    router = RouterProcess(llama("a"), tmp_path)
    try:
        for _ in range(3):
            victim = workers(router.proc.pid)["a"]
            victim.kill()
            victim.wait(10)
            wait_for(lambda: statuses(router.url)["a"]["value"] != "loaded", what="the crash seen")
            if statuses(router.url)["a"]["value"] == "failed":
                break
            assert chat(router.url, "a").status_code == 200
        status = statuses(router.url)["a"]
        assert status["value"] == "failed" and "crashed 3 times" in status["reason"]
        assert "SIGKILL" in status["reason"]
        r = chat(router.url, "a")
        assert r.status_code == 503 and "crashed 3 times" in r.json()["error"]["message"]
        # The operator's load tries again at once.
        r = httpx.post(f"{router.url}/models/load", json={"model": "a"}, timeout=60)
        assert r.status_code == 200 and r.json()["status"]["value"] == "loaded"
        assert chat(router.url, "a").status_code == 200
    finally:
        router.stop()


def test_a_worker_killed_while_loading_is_a_crash_not_a_failed_model(tmp_path):
    # The torch engine takes seconds to load: time enough to kill its worker meanwhile.
    router = RouterProcess(torch_config("t", extra="preload = false"), tmp_path)
    try:
        out = {}
        waiting = threading.Thread(target=lambda: out.update(r=chat(router.url, "t")))
        waiting.start()
        victim = wait_for(lambda: workers(router.proc.pid).get("t"), 30, "a worker loading t")
        victim.kill()
        waiting.join()
        r = out["r"]
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "was killed by SIGKILL while loading" in r.json()["error"]["message"]
        assert statuses(router.url)["t"] == {"value": "unloaded"}  # not failed: it may load again
        assert chat(router.url, "t").status_code == 200
        assert metric(router.url, "router:worker_restarts_total", model="t") == 1
    finally:
        router.stop()


def test_keep_alive_unloads_an_idle_model_and_its_process_ends(tmp_path):
    router = RouterProcess(llama("a", 'keep_alive = "1s"') + llama("b"), tmp_path)
    try:
        assert chat(router.url, "a").status_code == 200
        pid = workers(router.proc.pid)["a"].pid
        wait_for(lambda: statuses(router.url)["a"] == {"value": "unloaded"}, 15, "a unloaded")
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert set(workers(router.proc.pid)) == {"b"}
        assert metric(router.url, "router:model_unloads_total", model="a", cause="idle") == 1
        assert statuses(router.url)["b"]["value"] == "loaded"
        assert chat(router.url, "a").status_code == 200  # and back on demand
    finally:
        router.stop()


def test_load_and_unload_endpoints(tmp_path):
    config = '[server]\napi_keys = ["full"]\n[[keys]]\nkey = "team"\nmodels = ["a"]\n' + llama("a")
    router = RouterProcess(config, tmp_path)
    full = {"authorization": "Bearer full"}
    try:
        url = router.url
        r = httpx.post(f"{url}/models/unload", json={"model": "a"}, headers={"authorization": "Bearer team"})
        assert r.status_code == 403
        r = httpx.post(f"{url}/models/unload", json={"model": "nope"}, headers=full)
        assert r.status_code == 404
        r = httpx.post(f"{url}/models/unload", json={"modle": "a"}, headers=full)
        assert r.status_code == 400 and "modle" in r.json()["error"]["message"]
        pid = workers(router.proc.pid)["a"].pid
        r = httpx.post(f"{url}/models/unload", json={"model": "a"}, headers=full, timeout=30)
        assert r.status_code == 200 and r.json()["id"] == "a" and r.json()["status"] == {"value": "unloaded"}
        assert r.json()["ready"] is False and not workers(router.proc.pid)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        r = httpx.post(f"{url}/models/load", json={"model": "a"}, headers=full, timeout=60)
        assert r.status_code == 200 and r.json()["status"]["value"] == "loaded"
        assert r.json()["status"]["memory_bytes"] > 50 * MiB
        # A model that is generating cannot be unloaded.
        body = {"model": "a", "messages": HI, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=full, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            r = httpx.post(f"{url}/models/unload", json={"model": "a"}, headers=full)
            assert r.status_code == 409 and "1 request(s)" in r.json()["error"]["message"]
            rest = "\n".join(lines).rstrip()
        assert rest.endswith("data: [DONE]") and '"finish_reason":"length"' in rest
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        router.stop()


def test_concurrent_first_requests_share_one_load(tmp_path):
    router = RouterProcess(llama("a", "preload = false"), tmp_path)
    try:
        assert statuses(router.url)["a"] == {"value": "unloaded"} and not workers(router.proc.pid)
        out: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: out.append(chat(router.url, "a"))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in out] == [200] * 6
        assert metric(router.url, "router:model_loads_total", model="a") == 1
        assert len(workers(router.proc.pid)) == 1
    finally:
        router.stop()


def test_a_stream_waiting_for_its_model_keeps_the_connection_alive(tmp_path):
    # The torch engine takes seconds to load: the stream starts before, with comment lines.
    router = RouterProcess(torch_config("t", extra="preload = false"), tmp_path)
    try:
        body = {"model": "t", "messages": HI, "max_tokens": 5, "stream": True}
        raw = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=300).content
        assert raw.startswith(b": loading model t\n\n")
        comments = raw.split(b"data: ", 1)[0]
        assert set(comments.split(b"\n\n")) <= {b": loading model t", b": loading", b""}
        events = parse_events(raw[len(comments):])
        assert chat_text(events) and events[-1]["choices"][0]["finish_reason"] == "length"
        # The SDK reads such a stream as any other.
        httpx.post(f"{router.url}/models/unload", json={"model": "t"}, timeout=60).raise_for_status()
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="t", messages=HI, max_tokens=5, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        router.stop()


def test_a_model_larger_than_the_limit_is_refused_at_start(tmp_path):
    config = tmp_path / "router.toml"
    config.write_text('[server]\nmemory_limit = "600MiB"\n' + llama("small-enough") + torch_config("big"))
    out = subprocess.run([sys.executable, "-m", "router.cli", "check-config", str(config)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "models[1].name: model `big` needs about" in out.stderr and "600 MiB" in out.stderr
    assert "small-enough" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "model `big` needs about" in out.stderr


@pytest.mark.slow
def test_the_routers_memory_stays_flat_over_100_loads_and_unloads(tmp_path):
    site = plugin_site(tmp_path)
    router = RouterProcess('[[models]]\nname = "echo"\nbackend = "echo"\n', tmp_path, env={"PYTHONPATH": str(site)})
    proc = psutil.Process(router.proc.pid)
    try:
        def cycle():
            r = httpx.post(f"{router.url}/models/unload", json={"model": "echo"}, timeout=30)
            assert r.status_code == 200 and r.json()["status"] == {"value": "unloaded"}, r.text
            r = httpx.post(f"{router.url}/models/load", json={"model": "echo"}, timeout=60)
            assert r.status_code == 200 and r.json()["status"]["value"] == "loaded", r.text
            assert chat(router.url, "echo").json()["choices"][0]["message"]["content"] == "Name thr"

        for _ in range(10):  # warm: first imports, caches, the allocator's pools
            cycle()
        before = proc.memory_info().rss
        for _ in range(90):
            cycle()
        grown = proc.memory_info().rss - before
        print(f"\nthe router's RSS: {before / MiB:.1f} MiB after 10 loads, {grown / MiB:+.2f} MiB after 90 more")
        assert grown < 8 * MiB, f"the router grew by {grown / MiB:.1f} MiB over 90 loads"
        assert metric(router.url, "router:model_loads_total", model="echo") == 101
        assert len(workers(router.proc.pid)) == 1 and resident(workers(router.proc.pid).values()) > 0
    finally:
        router.stop()
