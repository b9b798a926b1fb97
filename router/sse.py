"""Server-Sent Events framing: every event is exactly ``data: <json>\\n\\n``."""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"

HEADERS = {
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
MEDIA_TYPE = "text/event-stream"


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
