"""The app built in-process with exactly the plugins a test names (Litestar's TestClient)."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from router.app import create_app
from router.backend import Backend
from router.config import parse_config
from router.errors import BadRequest
from router.hookspecs import RequestField, hookimpl
from router.plugins import PluginConflict, load_plugins


class Boom(Backend):
    """Fails in every way a backend can."""

    async def chat(self, request, params):
        raise RuntimeError("secret internal detail /etc/passwd")

    async def complete(self, request, params):
        raise BadRequest("completions refused here", param="prompt")


class BoomPlugin:
    __name__ = "boom"

    @hookimpl
    def register_backends(self, register):
        register("boom", Boom)

    @hookimpl
    def request_fields(self):
        return [RequestField("boom_level", int, 0)]


CONFIG = b'[[models]]\nname = "b"\nbackend = "boom"\n'


@pytest.fixture
def client():
    plugins = load_plugins(entrypoints=False, extra=[BoomPlugin()])
    app = create_app(parse_config(CONFIG, plugins.backends), plugins)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


MSG = {"model": "b", "messages": [{"role": "user", "content": "x"}]}


def test_unhandled_error_is_500_envelope_without_traceback(client):
    r = client.post("/v1/chat/completions", json=MSG)
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "Internal server error.", "type": "server_error", "param": None, "code": None}}
    assert "passwd" not in r.text and "Traceback" not in r.text


def test_api_error_from_backend(client):
    r = client.post("/v1/completions", json={"model": "b", "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_only_named_plugins_declare_fields(client):
    # boom_level exists (BoomPlugin); top_k does not (the sampling plugin is not loaded here).
    assert client.post("/v1/completions", json={"model": "b", "prompt": "x", "boom_level": 1}).status_code == 400
    r = client.post("/v1/completions", json={"model": "b", "prompt": "x", "top_k": 1})
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: top_k"


def test_health_lists_models(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["models"] == {"b": {"state": "ready", "queued": 0}}


def test_two_plugins_registering_one_backend_fail_with_both_names():
    class Other:
        __name__ = "other"

        @hookimpl
        def register_backends(self, register):
            register("boom", Boom)

    with pytest.raises(PluginConflict) as e:
        load_plugins(entrypoints=False, extra=[BoomPlugin(), Other()])
    assert "boom" in str(e.value) and "other" in str(e.value)


def test_misspelled_hook_is_caught_at_startup():
    class Typo:
        __name__ = "typo"

        @hookimpl
        def register_backend(self, register):  # missing "s"
            pass

    with pytest.raises(Exception) as e:
        load_plugins(entrypoints=False, extra=[Typo()])
    assert "register_backend" in str(e.value)


def test_failed_model_reports_why_and_others_keep_serving():
    class Broken(Backend):
        async def start(self):
            raise FileNotFoundError("no GGUF file at /nowhere.gguf")

        async def chat(self, request, params):
            raise AssertionError

        async def complete(self, request, params):
            raise AssertionError

    class P:
        __name__ = "p"

        @hookimpl
        def register_backends(self, register):
            register("broken", Broken)
            register("boom", Boom)

    plugins = load_plugins(entrypoints=False, extra=[P()])
    cfg = parse_config(b'[[models]]\nname="bad"\nbackend="broken"\n[[models]]\nname="b"\nbackend="boom"\n', plugins.backends)
    with TestClient(create_app(cfg, plugins), raise_server_exceptions=False) as c:
        import time
        for _ in range(50):
            r = c.get("/health")
            if r.json()["models"]["bad"]["state"] == "failed":
                break
            time.sleep(0.02)
        # A failed model is each model's business (the issue on workers): the router takes
        # requests, /health says 200 and names the failure, as /v1/models does.
        assert r.status_code == 200
        assert "nowhere.gguf" in r.json()["models"]["bad"]["error"]
        assert r.json()["models"]["b"]["state"] == "ready"
        status = {m["id"]: m["status"] for m in c.get("/v1/models").json()["data"]}
        assert status["bad"]["value"] == "failed" and "nowhere.gguf" in status["bad"]["reason"]
        assert status["b"] == {"value": "loaded"}
        r = c.post("/v1/chat/completions", json={**MSG, "model": "bad"})
        assert r.status_code == 503 and "nowhere.gguf" in r.json()["error"]["message"]
        assert r.headers.get("retry-after")
        assert c.post("/v1/completions", json={"model": "b", "prompt": "x"}).status_code == 400


def test_relay_reports_once_however_the_stream_ends():
    import asyncio

    from router.responses import Relay

    async def events():
        yield b"a"
        yield b"b"

    async def main():
        seen = []
        r = Relay(events(), seen.append)
        assert [e async for e in r] == [b"a", b"b"]
        await r.aclose()
        closed_early = []
        await Relay(events(), closed_early.append).aclose()  # never iterated: still reported
        half = []
        r = Relay(events(), half.append)
        await r.__anext__()
        await r.aclose()
        return seen, closed_early, half

    assert asyncio.run(main()) == ([True], [False], [False])


def test_served_app_tunes_the_cyclic_gc_once_models_are_loaded():
    """``tune_gc=True`` (what `router serve` passes): after loading, everything loaded so far is
    frozen out of the collector and requests in flight no longer trigger passes. Run in a child
    process: it changes the interpreter's GC settings for good."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import gc, time
        from litestar.testing import TestClient
        from router.app import create_app
        from router.config import parse_config
        from router.plugins import load_plugins
        from tests.test_app import CONFIG, BoomPlugin
        plugins = load_plugins(entrypoints=False, extra=[BoomPlugin()])
        before = gc.get_threshold()[0], gc.get_freeze_count()
        with TestClient(create_app(parse_config(CONFIG, plugins.backends), plugins, tune_gc=True)) as c:
            for _ in range(100):
                if gc.get_freeze_count():
                    break
                time.sleep(0.05)
            assert c.get("/health").status_code == 200
            print(*before, gc.get_threshold()[0], gc.get_freeze_count())
    ''')
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    threshold_before, frozen_before, threshold, frozen = map(int, out.stdout.split())
    assert (threshold_before, frozen_before) == (700, 0)
    assert threshold >= 10_000 and frozen > 10_000


def test_event_stream_messages_and_closing():
    """What an SSE response sends: `[DONE]` carries the end of the body (one write); a source
    without it gets an empty final message; the source runs to its end after `[DONE]`; and it
    is closed however the response ends, a failing response start included."""
    import asyncio

    from router import sse
    from router.responses import Relay, event_stream

    async def never() -> dict:
        await asyncio.Event().wait()
        return {}

    async def run(chunks, fail_start=False):
        sent, ended = [], []

        async def events():
            for c in chunks:
                yield c
            ended.append("source ran to its end")

        async def send(message):
            if fail_start:
                raise OSError("client gone")
            sent.append((message.get("body"), message.get("more_body")))

        response = event_stream(Relay(events(), ended.append), {"x-request-id": "r1"})
        try:
            await response({}, never, send)
        except OSError:
            pass
        return sent, ended

    sent, ended = asyncio.run(run([b"data: 1\n\n", sse.DONE]))
    assert sent == [(None, None), (b"data: 1\n\n", True), (sse.DONE, False)]
    assert ended == ["source ran to its end", True]
    sent, ended = asyncio.run(run([b"data: 1\n\n", b"data: 2\n\n"]))
    assert sent[1:] == [(b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"", False)]
    assert ended == ["source ran to its end", True]
    sent, ended = asyncio.run(run([b"data: 1\n\n"], fail_start=True))
    assert sent == [] and ended == [False]  # never iterated, still closed and reported


def test_event_stream_client_leaving_mid_send_closes_the_source_without_draining_it():
    """A client that leaves while a send is blocked (a full socket) ends the response: its
    source is closed at once, not run to its end for nobody."""
    import asyncio

    from router.responses import Relay, event_stream

    async def main():
        produced, closed, done = [], [], []
        left = asyncio.Event()

        async def events():
            try:
                for i in range(1000):
                    produced.append(i)
                    yield b"data: %d\n\n" % i
                    await asyncio.sleep(0)
            finally:
                closed.append(len(produced))

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message.get("body") == b"data: 5\n\n":
                left.set()  # the client leaves while this send waits for the socket
                await asyncio.sleep(0.01)

        await event_stream(Relay(events(), done.append), {})({}, receive, send)
        return produced, closed, done

    produced, closed, done = asyncio.run(main())
    assert len(produced) <= 7 and closed == [len(produced)] and done == [False]
