"""A plugin package installed with pip adds a backend and a request field, with no change here."""

from __future__ import annotations

import httpx
import pytest

from server import GGUF, RouterProcess
from sse_util import chat_text, parse_events
from workers_util import plugin_site


@pytest.fixture(scope="module")
def plugin_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    site = plugin_site(tmp)
    config = f"""
[[models]]
name = "echo"
backend = "echo"
context = 512

[[models]]
name = "smollm2"
backend = "llamacpp"
path = "{GGUF}"
n_ctx = 512
"""
    server = RouterProcess(config, tmp, env={"PYTHONPATH": str(site)})
    yield server
    server.stop()


def chat(url, body):
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_plugin_backend_serves_through_the_shared_pipeline(plugin_server):
    body = {"model": "echo", "messages": [{"role": "user", "content": "hé!"}]}
    r = chat(plugin_server.url, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["content"] == "hé!" and c["finish_reason"] == "stop"
    assert r.json()["usage"]["prompt_tokens"] == 4  # bytes of "hé!"


def test_plugin_field_reaches_its_engine(plugin_server):
    body = {"model": "echo", "messages": [{"role": "user", "content": "ab"}], "echo_times": 3, "stream": True}
    with httpx.stream("POST", f"{plugin_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = parse_events(r.read())
    assert chat_text(events) == "ababab"
    r = chat(plugin_server.url, {**body, "stream": False, "echo_times": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo_times"


def test_model_that_cannot_honour_the_field_says_so(plugin_server):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "ab"}], "echo_times": 2}
    r = chat(plugin_server.url, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "echo_times" and "smollm2" in err["message"] and "llamacpp" in err["message"]


def test_broken_plugin_is_logged_and_skipped(plugin_server):
    assert plugin_server.health()[0] == 200
    log = plugin_server.log.read_text()
    assert "broken" in log and "not installed" in log


def test_without_the_package_the_field_is_unknown(base_url):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "ab"}], "echo_times": 2}
    r = chat(base_url, body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: echo_times"
