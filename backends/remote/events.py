"""Splitting an upstream's Server-Sent Events byte stream into event payloads.

Upstreams frame events differently: ``\\n`` or ``\\r\\n`` line ends, a comment line now and
then (sse-starlette's ``: ping``), ``event:`` and ``id:`` fields, a ``data:`` split over several
lines. The common case, one ``data: {...}`` line per event, takes a fast path.
"""

from __future__ import annotations


class EventSplitter:
    """Feed it bytes as they arrive; it returns the ``data`` of every event they complete."""

    __slots__ = ("_buf", "_cr")

    def __init__(self) -> None:
        self._buf = b""
        self._cr = False  # the previous chunk ended in "\r": its "\n" may come next

    def feed(self, chunk: bytes) -> list[bytes]:
        # Membership tests take an int where they can: `b"x" in data` first tries its argument
        # as an integer and builds a TypeError before searching (ten times the cost of `10 in`).
        if self._cr or 13 in chunk:  # b"\r"
            chunk = self._normalize(chunk)
        buf = self._buf + chunk if self._buf else chunk
        blocks = buf.split(b"\n\n")
        self._buf = blocks.pop()
        out = []
        for block in blocks:
            if block.startswith(b"data: ") and 10 not in block:  # b"\n"
                out.append(block[6:])
            else:
                data = _data(block)
                if data is not None:
                    out.append(data)
        return out

    @property
    def pending(self) -> bytes:
        """Bytes of an event not finished yet."""
        return self._buf

    def _normalize(self, chunk: bytes) -> bytes:
        if self._cr:
            self._cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]  # "\r" + "\n" split across reads: already became "\n"
        if chunk.endswith(b"\r"):
            self._cr = True
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def _data(block: bytes) -> bytes | None:
    """The joined ``data`` lines of one event block; None for a comment-only or empty block."""
    lines = []
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if name == b"data":
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None
