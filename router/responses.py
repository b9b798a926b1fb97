"""Response helpers: JSON bodies, SSE streams that close their source, disconnect watching."""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from litestar import Response
from litestar.response.base import ASGIResponse

from . import sse
from .errors import APIError

T = TypeVar("T")

_SSE_TYPE = f"{sse.MEDIA_TYPE}; charset=utf-8".encode()


class _Encoded(ASGIResponse):
    """A 200 answer whose headers are encoded once, here: Litestar's own ``ASGIResponse`` builds
    them through ``MutableScopeHeaders`` (about a twentieth of a relayed request's time in the
    router). Sent as it is by handlers annotated to return an ``ASGIResponse``."""

    __slots__ = ("_encoded_headers",)

    def __init__(self, media_type: bytes, headers: dict[str, str], length: int | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.is_head_response = False
        encoded = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        encoded.append((b"content-type", media_type))
        if length is not None:
            encoded.append((b"content-length", b"%d" % length))
        self._encoded_headers = encoded

    def encode_headers(self) -> list[tuple[bytes, bytes]]:
        return self._encoded_headers


class _Reply(_Encoded):
    """A JSON body."""

    __slots__ = ()

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        super().__init__(b"application/json", headers, len(body))
        self.body = body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._encoded_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


class _EventStream(_Encoded):
    """Sends each event as it comes and closes the event iterator as soon as the response ends,
    disconnects included (a failing response start too), so the engine frees the request at once
    rather than whenever the generator is collected. A client that leaves cancels the sending
    through one watcher task (Litestar's own sender starts an anyio task group per response:
    about a tenth of a relayed stream's time in the router); ``watch``: the request's own
    :class:`DisconnectWatch`, if it has one already."""

    __slots__ = ("iterator", "watch")

    def __init__(self, iterator: AsyncIterator[bytes], headers: dict[str, str],
                 watch: "DisconnectWatch | None" = None) -> None:
        super().__init__(_SSE_TYPE, {**sse.HEADERS, **headers})
        self.iterator = iterator
        self.watch = watch

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        events = self.iterator
        watch = self.watch or DisconnectWatch(receive)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._encoded_headers})
            last = b""
            try:
                with watch:
                    async for chunk in events:
                        if chunk == sse.DONE:
                            last = chunk
                            break
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except ClientGone:
                return  # gone before the first event: `finally` closes the source
            if watch.gone:
                return  # the client left: `finally` closes the source now, whatever it had left
            # The last event and the end of the body leave in one write, outside the watch: once
            # the response is complete, the server reports the client as gone.
            await send({"type": "http.response.body", "body": last, "more_body": False})
            if last:
                # The client has its whole answer; the source ends by itself (a relay waits for
                # its upstream's end to reuse the connection, and counts the request complete).
                async for _ in events:
                    pass  # nothing may follow `[DONE]` on the wire
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


def json_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(content=body, status_code=status, media_type="application/json", headers=headers)


def json_reply(body: bytes, headers: dict[str, str]) -> ASGIResponse:
    """A 200 JSON answer as Litestar's low-level response, for handlers annotated to return one:
    Litestar then sends it as it is instead of converting a ``Response`` on every request."""
    return _Reply(body, headers)


def event_stream(events: AsyncIterator[bytes], headers: dict[str, str],
                 watch: "DisconnectWatch | None" = None) -> ASGIResponse:
    """An SSE answer as the low-level response (see :func:`json_reply`); ``watch``: the
    request's :class:`DisconnectWatch`, to go on watching with (else it gets its own)."""
    return _EventStream(events, headers, watch)


class ClientGone(APIError):
    status = 499
    type = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("Client disconnected.")


class DisconnectWatch:
    """``with watch:`` cancels the enclosed work if the client disconnects meanwhile; the
    cancellation ends at the block (``watch.gone`` says it happened). One watch may guard several
    blocks of one request (waiting in a queue, waiting for a backend, sending a stream): a block
    entered after the client left does not run, it raises :class:`ClientGone` (a cancellation
    requested then could only land at the block's first suspension, or after the block when the
    work never suspends; Python 3.11 cannot take such a request back).

    The work runs in the calling task and one small task, started by the first block, waits on
    ``receive``: cheaper than running the work in a task of its own and waiting on both
    (``asyncio.wait``). The watcher is never cancelled: the ASGI server answers its pending
    ``receive`` with ``http.disconnect`` once the response is complete (or the connection is
    gone), and the watcher then just stops. Cancelling it at the end of each block instead (an
    exception through three frames, a task step for nothing) cost about 30 us of CPU a request:
    8% of the relayed requests/s at concurrency 32. It ends normally: no exception, no reference
    cycle.

    Under uvicorn there is no watcher task at all: ``receive`` is a method of uvicorn's request
    cycle, whose ``disconnected`` flag the server sets when the connection is lost before the
    response completes. A block registers with its event loop's :class:`_DisconnectPoll`, which
    reads that flag every :data:`POLL_INTERVAL` seconds while any block is open. The watcher task
    (its creation, two task steps, an ``asyncio.Event`` wait per request) was about a tenth of the
    router's CPU time per relayed request; the poll costs a set insertion and removal. A client
    that leaves is noticed within the interval instead of at once. (A pipelining client's next
    request pauses uvicorn's reading; a disconnect is then noticed only when the response ends,
    as the work completes.)"""

    __slots__ = ("gone", "_receive", "_caller", "_watching", "_left", "_cycle", "_poll")

    def __init__(self, receive: Callable[[], Awaitable[Any]]) -> None:
        self.gone = False
        self._receive = receive
        self._caller: asyncio.Task[Any] | None = None  # set inside a block
        self._watching = False
        self._left = False  # receive said http.disconnect
        cycle = getattr(receive, "__self__", None)
        self._cycle = cycle if _pollable(type(cycle)) else None
        self._poll: _DisconnectPoll | None = None  # the one this watch's open block is in

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._left = True
        caller = self._caller
        if caller is not None:  # inside a block: the client left during the work
            self.gone = True
            caller.cancel()

    def _client_left(self) -> None:
        """The poll saw the connection lost (inside a block)."""
        self._left = True
        caller = self._caller
        if caller is not None:
            self.gone = True
            caller.cancel()

    def __enter__(self) -> "DisconnectWatch":
        caller = asyncio.current_task()
        assert caller is not None
        cycle = self._cycle
        if self._left or (cycle is not None and cycle.disconnected):  # gone before this block
            self._left = self.gone = True
            raise ClientGone()
        self._caller = caller
        if cycle is not None:
            self._poll = _DisconnectPoll.of(caller.get_loop())
            self._poll.add(self)
        elif not self._watching:
            self._watching = True
            # No reference kept: the server's pending receive keeps the watcher alive until it ends.
            caller.get_loop().create_task(self._watch())
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        caller, self._caller = self._caller, None  # outside a block a disconnect cancels nothing
        poll, self._poll = self._poll, None
        if poll is not None:
            poll.watches.discard(self)
        if self.gone and kind is not None and issubclass(kind, asyncio.CancelledError):
            assert caller is not None
            caller.uncancel()
            return True  # our cancellation, not anybody else's (shutdown): it ends here
        return False


POLL_INTERVAL = 0.02  # seconds between two looks at the open blocks' connections


@functools.lru_cache(maxsize=None)
def _pollable(cls: type) -> bool:
    """Whether ``receive`` methods of ``cls`` objects belong to uvicorn's HTTP request cycle,
    whose ``disconnected`` flag the poll can read."""
    return cls.__module__.startswith("uvicorn.protocols.http.") and cls.__name__ == "RequestResponseCycle"


class _DisconnectPoll:
    """One per event loop: the open :class:`DisconnectWatch` blocks under uvicorn, and a timer
    that runs only while there are any."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _DisconnectPoll]" = weakref.WeakKeyDictionary()
    _last: "tuple[asyncio.AbstractEventLoop | None, _DisconnectPoll | None]" = (None, None)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watches: set[DisconnectWatch] = set()
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_DisconnectPoll":
        last_loop, poll = cls._last
        if last_loop is loop:
            return poll  # type: ignore[return-value]
        poll = cls._by_loop.get(loop)
        if poll is None:
            poll = cls._by_loop[loop] = cls(loop)
        cls._last = (loop, poll)
        return poll

    def add(self, watch: DisconnectWatch) -> None:
        self.watches.add(watch)
        if self._timer is None:
            self._timer = self.loop.call_later(POLL_INTERVAL, self._look)

    def _look(self) -> None:
        self._timer = None
        left = [w for w in self.watches if w._cycle.disconnected]
        for watch in left:
            self.watches.discard(watch)
            watch._client_left()
        if self.watches:
            self._timer = self.loop.call_later(POLL_INTERVAL, self._look)


async def unless_disconnected(watch: DisconnectWatch, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (``watch``: the request's
    :class:`DisconnectWatch`); then cancel it (which frees its engine work or its place in a
    queue) and raise :class:`ClientGone`."""
    try:
        with watch:
            return await work
    except ClientGone:
        close = getattr(work, "close", None)
        if close is not None:
            close()  # gone before the block: the work never starts (and warns of nothing)
        raise
    raise ClientGone()


class Relay:
    """Relays ``events``; calls ``done(completed)`` exactly once when the stream ends, however
    it ends: exhausted, failed, or closed by the response (client gone) even before it started.
    (An async generator would skip its ``finally`` when closed before its first step.)"""

    def __init__(self, events: AsyncIterator[bytes], done: Callable[[bool], None]) -> None:
        self._events = events
        self._done: Callable[[bool], None] | None = done

    def __aiter__(self) -> "Relay":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            self._finish(True)
            raise
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        try:
            if aclose is not None:
                await aclose()
        finally:
            self._finish(False)

    def _finish(self, completed: bool) -> None:
        done, self._done = self._done, None
        if done is not None:
            done(completed)
