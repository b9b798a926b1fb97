"""Strict parsing of raw Server-Sent Events bytes as the contract frames them."""

from __future__ import annotations

import json


def parse_events(raw: bytes) -> list:
    """Every event is exactly ``data: <json>\\n\\n``; the last is ``data: [DONE]``."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: "), frame
        assert b"\n" not in frame and b"\r" not in frame, frame
        payload = frame[len(b"data: "):]
        out.append(payload if payload == b"[DONE]" else json.loads(payload))
    assert out.count(b"[DONE]") == 1 and out[-1] == b"[DONE]"
    return out[:-1]


def chat_text(events: list, index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for e in events for c in e.get("choices", []) if c["index"] == index
    )


def sdk_stream(stream) -> tuple[str, object, int]:
    """An openai SDK chat stream read to its end: the content, the usage chunk's usage (None
    without one) and how many choice chunks carried it."""
    text, usage, chunks = "", None, 0
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            chunks += 1
            text += choice.delta.content or ""
    return text, usage, chunks
