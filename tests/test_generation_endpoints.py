"""The generation endpoints are plain ASGI handlers inside Litestar's routing: what Litestar did
for them before (methods, body size limit, request ids, API keys, error envelopes) they must
still do, and the raw connection helpers must read bodies and headers right."""

from __future__ import annotations

import asyncio

import pytest
from litestar.exceptions import HTTPException
from litestar.testing import TestClient

from router.app import create_app
from router.backend import Backend
from router.config import parse_config
from router.connection import header, read_body
from router.hookspecs import hookimpl
from router.plugins import load_plugins
from router.responses import ClientGone

# --- read_body / header ---------------------------------------------------------------------


def _receiver(messages):
    queue = list(messages)
    taken = []

    async def receive():
        message = queue.pop(0)
        taken.append(message)
        return message

    return receive, taken


def _scope(**headers: str) -> dict:
    return {"headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def _read(scope, messages, limit=100):
    receive, taken = _receiver(messages)
    return asyncio.run(read_body(scope, receive, limit)), taken


def test_read_body_one_message():
    body, taken = _read(_scope(), [{"type": "http.request", "body": b"abc", "more_body": False}])
    assert body == b"abc" and len(taken) == 1


def test_read_body_joins_chunks_until_more_body_is_false():
    chunks = [{"type": "http.request", "body": b"ab", "more_body": True},
              {"type": "http.request", "body": b"", "more_body": True},
              {"type": "http.request", "body": b"cd"}]
    assert _read(_scope(), chunks)[0] == b"abcd"


def test_read_body_empty_and_exactly_at_the_limit():
    assert _read(_scope(), [{"type": "http.request"}])[0] == b""
    assert _read(_scope(content_length="100"), [{"type": "http.request", "body": b"x" * 100}])[0] == b"x" * 100


def test_read_body_announced_too_long_is_413_before_reading():
    receive, taken = _receiver([{"type": "http.request", "body": b"x"}])
    with pytest.raises(HTTPException) as info:
        asyncio.run(read_body(_scope(content_length="101"), receive, 100))
    assert info.value.status_code == 413 and taken == []


@pytest.mark.parametrize("messages", [
    [{"type": "http.request", "body": b"x" * 101}],
    [{"type": "http.request", "body": b"x" * 60, "more_body": True},
     {"type": "http.request", "body": b"x" * 60, "more_body": True},
     {"type": "http.request", "body": b"never read"}],
])
def test_read_body_sent_too_long_is_413_without_reading_on(messages):
    receive, taken = _receiver(messages)
    with pytest.raises(HTTPException) as info:  # the announced length is not trusted
        asyncio.run(read_body(_scope(content_length="5"), receive, 100))
    assert info.value.status_code == 413 and len(taken) == min(2, len(messages))


def test_read_body_client_gone_midway():
    with pytest.raises(ClientGone):
        _read(_scope(), [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}])


def test_header_lookup():
    scope = _scope(x_request_id="r1", authorization="Bearer k")
    assert header(scope, b"x-request-id") == "r1" and header(scope, b"authorization") == "Bearer k"
    assert header(scope, b"content-length") is None
    scope["headers"].append((b"x-request-id", b"r2"))
    assert header(scope, b"x-request-id") == "r1"  # the first one, as Litestar's Headers.get


# --- over HTTP ------------------------------------------------------------------------------


class Echo(Backend):
    """Answers with the model name and the request's max_tokens; streams two events."""

    async def chat(self, request, params):
        if params.stream:
            async def events():
                yield b'data: {"n":1}\n\n'
                yield b"data: [DONE]\n\n"
            return events()
        return b'{"model":"%s","max_tokens":%d}' % (request.model.encode(), request.max_tokens or 0)

    async def complete(self, request, params):
        return b'{"prompt":true}'


class EchoPlugin:
    __name__ = "echo"

    @hookimpl
    def register_backends(self, register):
        register("echo", Echo)


def _client(config: bytes) -> TestClient:
    plugins = load_plugins(entrypoints=False, extra=[EchoPlugin()])
    return TestClient(create_app(parse_config(config, plugins.backends), plugins), raise_server_exceptions=False)


OPEN = b'[server]\nmax_body_bytes = 2048\n[[models]]\nname = "e"\nbackend = "echo"\n'
KEYS = (b'[server]\napi_keys = ["all-models"]\n[[keys]]\nkey = "only-f"\nmodels = ["f"]\n'
        b'[[models]]\nname = "e"\nbackend = "echo"\n[[models]]\nname = "f"\nbackend = "echo"\n')
MSG = {"model": "e", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def client():
    with _client(OPEN) as c:
        yield c


def test_answers_and_streams(client):
    r = client.post("/v1/chat/completions", json=MSG)
    assert r.status_code == 200 and r.json() == {"model": "e", "max_tokens": 3}
    assert r.headers["content-type"] == "application/json" and len(r.headers["x-request-id"]) == 32
    r = client.post("/v1/chat/completions", json={**MSG, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b'data: {"n":1}\n\ndata: [DONE]\n\n'
    r = client.post("/v1/completions", json={"model": "e", "prompt": "x"})
    assert r.status_code == 200 and r.json() == {"prompt": True}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_other_methods(client, path):
    for method in ("GET", "PUT", "DELETE", "HEAD"):
        r = client.request(method, path)
        assert r.status_code == 405 and r.headers["allow"] == "POST, OPTIONS"
        if method != "HEAD":
            assert r.json()["error"] == {"message": f"Method {method} is not allowed for {path}",
                                         "type": "invalid_request_error", "param": None, "code": None}
    r = client.options(path)
    assert r.status_code == 204 and r.headers["allow"] == "OPTIONS, POST" and r.content == b""


def test_body_over_the_limit_is_413(client):
    big = b'{"model":"e","messages":[],"pad":"' + b"x" * 3000 + b'"}'
    r = client.post("/v1/chat/completions", content=big, headers={"x-request-id": "big-1"})
    assert r.status_code == 413 and r.json()["error"]["message"] == "The request body is too large."
    assert r.headers["x-request-id"] == "big-1"

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(4):
            yield b"x" * 1000

    r = client.post("/v1/completions", content=chunked())
    assert r.status_code == 413 and "too large" in r.json()["error"]["message"]


def test_request_id_honoured_on_answers_and_errors(client):
    r = client.post("/v1/chat/completions", json=MSG, headers={"X-Request-Id": "client-7"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-7"
    r = client.post("/v1/chat/completions", json={**MSG, "max_tokens": "many"}, headers={"X-Request-Id": "client-8"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.headers["x-request-id"] == "client-8"
    r = client.post("/v1/chat/completions", json={**MSG, "model": "nope"}, headers={"X-Request-Id": "bad id"})
    assert r.status_code == 404 and r.headers["x-request-id"] not in ("bad id", "")


def test_api_keys_on_generation_endpoints():
    with _client(KEYS) as c:
        for path, body in (("/v1/chat/completions", MSG), ("/v1/completions", {"model": "e", "prompt": "x"})):
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]
            r = c.post(path, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
            assert c.post(path, json=body, headers={"Authorization": "Bearer all-models"}).status_code == 200
            r = c.post(path, json=body, headers={"Authorization": "Bearer only-f"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = c.post(path, json={**body, "model": "f"}, headers={"Authorization": "Bearer only-f"})
            assert r.status_code == 200


# --- the fast lane --------------------------------------------------------------------------


@pytest.fixture
def lane_calls(monkeypatch):
    """Count the requests the app's fast lane answers (Litestar's route calls the same function
    through router.routes, not through router.app)."""
    import router.app as app_module

    calls = []
    real = app_module.generation_response

    async def counted(scope, receive, endpoint):
        calls.append(endpoint)
        return await real(scope, receive, endpoint)

    monkeypatch.setattr(app_module, "generation_response", counted)
    return calls


CASES = [
    ("/v1/chat/completions", MSG, None),  # 200
    ("/v1/chat/completions", {**MSG, "stream": True}, None),  # 200, a stream
    ("/v1/completions", {"model": "e", "prompt": "x"}, None),  # 200
    ("/v1/chat/completions", {**MSG, "max_tokens": "many"}, None),  # 400 from decoding
    ("/v1/chat/completions", {**MSG, "model": "nope"}, None),  # 404 from the model lookup
    ("/v1/completions", None, b"{not json"),  # 400, invalid JSON
    ("/v1/chat/completions", None, b'{"pad":"' + b"x" * 3000 + b'"}'),  # 413 (HTTPException)
]


@pytest.mark.parametrize("path,body,raw", CASES)
def test_the_lane_answers_like_litestars_route(client, lane_calls, path, body, raw):
    # The same request through the lane (the exact path) and through Litestar's router (the
    # path with a trailing slash, which Litestar normalizes and the lane does not take).
    kwargs = {"json": body} if raw is None else {"content": raw}
    headers = {"x-request-id": "same-id"}
    fast = client.post(path, headers=headers, **kwargs)
    assert lane_calls == [{"/v1/chat/completions": "chat", "/v1/completions": "completions"}[path]]
    slow = client.post(path + "/", headers=headers, **kwargs)
    assert len(lane_calls) == 1
    assert (fast.status_code, fast.content) == (slow.status_code, slow.content)
    for name in ("content-type", "x-request-id", "allow"):
        assert fast.headers.get(name) == slow.headers.get(name)


def test_the_lane_leaves_other_methods_and_paths_to_litestar(client, lane_calls):
    assert client.get("/v1/chat/completions").status_code == 405
    assert client.options("/v1/completions").status_code == 204
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completion", json=MSG).status_code == 404
    assert lane_calls == []


def test_the_lane_answers_an_unexpected_error_with_the_500_envelope(lane_calls):
    class Broken(Echo):
        async def chat(self, request, params):
            raise RuntimeError("secret detail /etc/shadow")

    class BrokenPlugin:
        __name__ = "broken"

        @hookimpl
        def register_backends(self, register):
            register("echo", Broken)

    plugins = load_plugins(entrypoints=False, extra=[BrokenPlugin()])
    with TestClient(create_app(parse_config(OPEN, plugins.backends), plugins), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json=MSG)
    assert lane_calls == ["chat"]
    assert r.status_code == 500 and "shadow" not in r.text
    assert r.json()["error"] == {"message": "Internal server error.", "type": "server_error", "param": None, "code": None}
