"""A chat completion's SSE stream as Anthropic's named events.

``message_start`` (with a ``ping`` after it), then for each content block in turn
``content_block_start``, its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``) and
``content_block_stop``; at the end ``message_delta`` (``stop_reason`` and usage) and
``message_stop``. An error event from the chat stream becomes an ``error`` event, and the stream
ends there. SSE comment lines (a model still loading) pass through: every SSE client skips them.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import msgspec

from .errors import error_type
from .translate import message_id, stop_reason, usage

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def event(payload: dict[str, Any]) -> bytes:
    """One named event: its ``event:`` line is its data's ``type``."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encode(payload) + b"\n\n"


def error_event(error: dict[str, Any]) -> bytes:
    return event({"type": "error", "error": {"type": error_type(None, error.get("type")),
                                             "message": error.get("message", "")}})


class MessageEvents:
    """Anthropic's events from a chat stream's (``chat_events``). An explicit iterator, so that
    closing it closes the chat stream even before its first event (the engine frees the request
    at once; an unstarted generator's ``finally`` never runs)."""

    def __init__(self, chat_events: AsyncIterator[bytes]) -> None:
        self._chat = chat_events
        self._events = self._run()

    def __aiter__(self) -> "MessageEvents":
        return self

    async def __anext__(self) -> bytes:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            aclose = getattr(self._chat, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _run(self) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        started = ended = False
        finish: tuple[str, str | None] = ("end_turn", None)
        last_usage: dict[str, Any] | None = None
        async for item in self._chat:
            for comment, data in _events(item):
                if comment:  # a keep-alive while the model loads: on as it is
                    yield data
                    continue
                if ended:
                    continue  # nothing follows an error or the end
                if data == b"[DONE]":
                    if not started:
                        yield _start("msg_" + "0" * 24, "", None)
                    for out in blocks.close():
                        yield out
                    yield event({"type": "message_delta",
                                 "delta": {"stop_reason": finish[0], "stop_sequence": finish[1]},
                                 "usage": msgspec.to_builtins(usage(last_usage))})
                    yield event({"type": "message_stop"})
                    ended = True
                    continue
                chunk = _decode(data)
                if "error" in chunk:
                    yield error_event(chunk["error"])
                    ended = True
                    continue
                last_usage = chunk.get("usage") or last_usage
                if not started:
                    started = True
                    yield _start(message_id(chunk["id"]), chunk.get("model", ""), last_usage)
                    yield event({"type": "ping"})
                for choice in chunk.get("choices") or ():
                    for out in blocks.absorb(choice.get("delta") or {}):
                        yield out
                    if choice.get("finish_reason"):
                        finish = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
        if not ended:  # the chat stream stopped short of its end (it says why itself, normally)
            yield error_event({"type": "server_error", "message": "The stream ended before its answer did."})


def _start(mid: str, model: str, chat_usage: dict[str, Any] | None) -> bytes:
    u = msgspec.to_builtins(usage(chat_usage))
    u["output_tokens"] = 0
    return event({"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "content": [], "model": model,
        "stop_reason": None, "stop_sequence": None, "usage": u}})


def _events(item: bytes) -> list[tuple[bool, bytes]]:
    """Each SSE event in ``item``: (False, its data), or (True, the event) for a comment."""
    out: list[tuple[bool, bytes]] = []
    for raw in item.split(b"\n\n"):
        if not raw.strip():
            continue
        data = [line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:")]
        out.append((False, b"\n".join(data)) if data else (True, raw + b"\n\n"))
    return out


class _Blocks:
    """The content blocks opened so far: at most one open, in the order they came."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "thinking", "text", or "tool:<chat tool index>"

    def _switch(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open = kind
        out.append(event({"type": "content_block_start", "index": self.count, "content_block": block}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        self.count += 1
        return [event({"type": "content_block_stop", "index": self.count - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self.count, "delta": delta})

    def absorb(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            if self.open != "thinking":
                out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if delta.get("content"):
            if self.open != "text":
                out += self._switch("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            kind = f"tool:{call.get('index', 0)}"
            function = call.get("function") or {}
            if self.open != kind:
                out += self._switch(kind, {"type": "tool_use", "id": call.get("id") or f"toolu_{self.count}",
                                           "name": function.get("name") or "", "input": {}})
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out
