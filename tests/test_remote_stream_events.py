"""RelayStream's per-event rewrite: the byte-level fast path for plain events must give what
decoding and re-encoding gives (same JSON, same usage and text reported), and hand every event
it is not sure about to the general path."""

from __future__ import annotations

import json

import msgspec
import pytest

from backends.remote.stream import RelayStream


class Record:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.reasons: list[str] = []
        self.usages: list[tuple[int, int, int]] = []

    def event(self, text: str = "") -> None:
        self.texts.append(text)

    def finished(self, reason: str | None) -> None:
        if reason:
            self.reasons.append(reason)

    def usage(self, prompt: int, completion: int, cached: int = 0) -> None:
        self.usages.append((prompt, completion, cached))


class Deployment:
    name = "up"

    def record_usage(self, usage: object) -> None:
        pass


class Relay:
    def succeeded(self, d: object) -> None:
        pass

    def failed(self, d: object, why: str) -> None:
        pass


class Resp:
    def close(self) -> None:
        pass


def stream(model: str = "client-name", include_usage: bool = False, continuous: bool = False) -> tuple[RelayStream, Record]:
    record = Record()
    s = RelayStream(Relay(), Deployment(), Resp(), None, [], model, include_usage, continuous, record)  # type: ignore[arg-type]
    s._closed = True  # nothing to release in these tests
    return s, record


def chunk(**fields: object) -> dict:
    base: dict = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "upstream/m"}
    base.update(fields)
    return base


def delta(content: object = None, finish: object = None, **more: object) -> dict:
    d = {"content": content} if content is not None else {}
    d.update(more)
    return {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}


EVENTS = [
    chunk(choices=[delta("Hello")]),
    chunk(choices=[delta(" wörld ✓ \"quoted\" \\ back")]),
    chunk(choices=[delta("", role="assistant")]),
    chunk(choices=[delta(None, "stop")]),
    chunk(choices=[delta("a"), {"index": 1, "delta": {"content": "b"}, "finish_reason": None}]),
    chunk(choices=[{"index": 0, "text": "completion text", "logprobs": None, "finish_reason": None}], object="text_completion"),
    chunk(choices=[delta(None, None, tool_calls=[{"index": 0, "function": {"arguments": "{\"model\": 1}"}}])]),
    chunk(choices=[delta("x")], system_fingerprint="fp", extra_vendor={"nested": [1, 2, {"k": None}]}),
    chunk(choices=[delta("mentions \"model\": in text")]),
    chunk(choices=[delta("u")], usage=None),
    chunk(choices=[delta("v")], usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}),
    chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}),
    chunk(choices=[delta("w")], meta={"model": "upstream/m"}),
    chunk(choices=[delta(None, reasoning="Let me think")]),  # a thinking model (vLLM's field)
    chunk(choices=[delta(None, reasoning_content="Hmm")]),  # (its older name)
    chunk(choices=[delta([{"type": "text", "text": "list content"}])]),
    {"id": "x", "object": "chat.completion.chunk", "choices": [delta("no model field")]},
]

SERIALIZERS = {
    "compact": lambda obj: json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode(),
    "spaced": lambda obj: json.dumps(obj).encode(),  # Python's default: ": ", ASCII escapes
    "msgspec": msgspec.json.encode,
}


@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("include_usage,continuous", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("event", EVENTS, ids=range(len(EVENTS)))
def test_fast_path_matches_the_general_path(event: dict, serializer: str, include_usage: bool, continuous: bool) -> None:
    payload = SERIALIZERS[serializer](event)
    fast, fast_record = stream(include_usage=include_usage, continuous=continuous)
    slow, slow_record = stream(include_usage=include_usage, continuous=continuous)
    out = fast._relay_event(payload)
    expected = slow._relay_any(payload)
    if expected is None:
        assert out is None
    else:
        assert out is not None and out.startswith(b"data: ") and out.endswith(b"\n\n")
        assert b"\n" not in out[6:-2]  # one SSE line
        assert json.loads(out[6:-2]) == json.loads(expected[6:-2])
    assert (fast_record.texts, fast_record.reasons, fast_record.usages) == \
        (slow_record.texts, slow_record.reasons, slow_record.usages)


def test_plain_events_take_the_fast_path_and_others_do_not() -> None:
    s, _ = stream()
    compact = SERIALIZERS["compact"]
    assert s._relay_plain(compact(chunk(choices=[delta("Hello")]))) is not None
    assert s._relay_plain(SERIALIZERS["spaced"](chunk(choices=[delta("Hello")]))) is not None
    for not_plain in (
        chunk(choices=[delta("v")], usage=None),  # usage present: the general path drops or keeps it
        chunk(choices=[delta("w")], meta={"model": "upstream/m"}),  # two "model" keys
        {"error": {"message": "boom"}, "model": "upstream/m"},
        {"object": "error", "message": "boom", "model": "upstream/m"},
        chunk(choices=[delta([{"type": "text"}])]),  # a shape the fast decoder does not read
        {"id": "x", "choices": [delta("no model field")]},
    ):
        assert s._relay_plain(compact(not_plain)) is None, not_plain
    assert s._relay_plain(b"[DONE]") is None
    assert s._relay_plain(b'{"model": "m",\n"choices": []}') is None  # several data lines
    assert s._relay_plain(b'{"model":"caf\\u00e9","choices":[]}') is None  # escaped differently


def test_model_is_rewritten_in_place_and_the_rest_is_kept_byte_for_byte() -> None:
    s, record = stream(model="my-model")
    payload = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"upstream/m","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}],"x":1.50}'
    assert s._relay_event(payload) == b"data: " + payload.replace(b'"upstream/m"', b'"my-model"') + b"\n\n"
    assert record.texts == ["Hi"]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_a_thinking_models_reasoning_counts_as_its_first_text(field) -> None:
    # A reasoning upstream streams reasoning deltas for a while before any content: its time to
    # first token is the first of those, on the fast path and the general one.
    for path in ("_relay_plain", "_relay_any"):
        s, record = stream()
        out = getattr(s, path)(SERIALIZERS["compact"](chunk(choices=[delta(None, **{field: "Let me think"})])))
        assert out is not None and field.encode() in out
        assert record.texts == ["Let me think"]
