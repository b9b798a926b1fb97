"""A small HTTP/1.1 client for upstreams: keep-alive connections over asyncio protocols.

The relay sends one kind of request (a JSON POST, or a GET for health) to servers it knows, and
reads back either a whole body or an event stream piece by piece. A general client pays for what
the relay never uses: in front of a canned upstream on the 2-core development machine, aiohttp
took about 0.4 ms more per request than this at concurrency 1, more than the rest of the relay's
own work (docs/benchmarks.md, "The HTTP client").

What it does: ``http`` and ``https``; one request at a time per connection, idle connections
kept per deployment and reused (a connection that went stale while idle is replaced, and a
request that got no byte back on a reused connection is sent once more on a new one, as urllib3
and httpx do); bodies framed by ``Content-Length``, chunked transfer coding, or the end of the
connection; 1xx answers skipped. Not supported because the relay never needs them: redirects
(``allow_redirects`` was off), content codings (no ``Accept-Encoding`` is sent), proxies,
HTTP/2, pipelining.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024
"""Bytes a response head (status line and headers) may take."""
HIGH_WATER = 256 * 1024
"""Unread body bytes buffered before the connection stops reading from the socket."""


class HTTPError(Exception):
    """A transport failure, with a short client-safe reason (``str(exc)``)."""


class ConnectError(HTTPError):
    """The connection could not be opened."""


class ConnectTimeout(ConnectError):
    """The connection was not open within the connect timeout."""


class Disconnected(HTTPError):
    """The server closed the connection (or broke the protocol) before the response ended."""


class ReadTimeout(HTTPError):
    """The server sent nothing for longer than the response's idle limit (:meth:`Response.watch_idle`)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses responses into a queue of body pieces."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.response: Response | None = None
        self.got_bytes = False  # since the current request was sent
        self._buf = bytearray()
        self._paused = False

    # --- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # unsolicited bytes on an idle connection: never reuse it
            self.lost = True
            if self.transport is not None:
                self.transport.close()
            return
        self.got_bytes = True
        self._buf += data
        try:
            self.response._parse(self._buf)
        except HTTPError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.response is not None and not self.response._complete:
            self.response._ended_by_close()

    # --- used by the response ----------------------------------------------------------------

    def _fail(self, exc: HTTPError) -> None:
        self.lost = True
        if self.response is not None:
            self.response._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()


class Response:
    """One response: ``status`` and ``headers`` (lower-case names) are there when
    :meth:`Pool.request` returns; the body is read with :meth:`read` or :meth:`readany`.
    Finish with :meth:`release` (the connection may be reused) or :meth:`close`."""

    __slots__ = (
        "status", "headers", "_conn", "_pool", "_head_done", "_head_waiter", "_mode", "_remaining",
        "_pieces", "_buffered", "_waiter", "_complete", "_error", "_keep_alive",
        "_finished", "_idle_s", "_last_data", "_idle_timer",
    )

    def __init__(self, conn: _Connection, pool: Pool) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._pool = pool
        self._head_done = False
        self._head_waiter: asyncio.Future[None] = conn.loop.create_future()
        self._mode = ""  # "length", "chunked" or "close"
        self._remaining = 0  # body bytes left ("length"), or of the current chunk ("chunked")
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: HTTPError | None = None
        self._keep_alive = True
        self._finished = False
        self._idle_s = 0.0
        self._last_data = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    def at_eof(self) -> bool:
        """The whole body has arrived and been read."""
        return self._complete and not self._pieces

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while piece := await self.readany():
            parts.append(piece)
        return b"".join(parts)

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none has); ``b""`` at the end."""
        while True:
            if self._pieces:
                piece = self._pieces.popleft() if len(self._pieces) == 1 else b"".join(self._drain())
                self._buffered -= len(piece)
                if self._buffered < HIGH_WATER:
                    self._conn.resume()
                return piece
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _drain(self) -> list[bytes]:
        pieces = list(self._pieces)
        self._pieces.clear()
        return pieces

    def watch_idle(self, seconds: float) -> None:
        """From now on, fail the response with :class:`ReadTimeout` when the server sends nothing
        for ``seconds`` (while the reader keeps up: a connection paused for back-pressure is not
        idle). One timer per response that re-arms itself when it finds data arrived meanwhile,
        rather than a timeout around every read: an event stream reads once per event."""
        loop = self._conn.loop
        self._idle_s = seconds
        self._last_data = loop.time()
        self._idle_timer = loop.call_at(self._last_data + seconds, self._check_idle)

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._finished or self._complete or self._error is not None:
            return
        loop = self._conn.loop
        due = self._last_data + self._idle_s
        if self._conn._paused or self._pieces:  # the reader is behind, not the server
            due = loop.time() + self._idle_s
            self._last_data = loop.time()
        if loop.time() < due:
            self._idle_timer = loop.call_at(due, self._check_idle)
            return
        self._conn._fail(ReadTimeout(f"sent nothing for {self._idle_s:g}s"))

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the body ended cleanly."""
        self._finish(reuse=self._complete and self._error is None and self._keep_alive)

    def close(self) -> None:
        """Drop the connection (the server stops sending, a client that left costs nothing more)."""
        self._finish(reuse=False)

    def _finish(self, reuse: bool) -> None:
        if self._finished:
            return
        self._finished = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._conn.response = None
        if reuse and not self._conn.lost:
            self._pool._put(self._conn)
        else:
            self._pool._discard(self._conn)

    # --- parsing (called by the connection) --------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: HTTPError) -> None:
        if self._complete:
            return
        self._error = exc
        if not self._head_waiter.done():
            self._head_waiter.set_exception(exc)
            self._head_waiter.exception()  # retrieved here: the caller may be gone already
        self._wake()

    def _ended_by_close(self) -> None:
        if self._head_done and self._mode == "close":
            self._complete = True
            self._wake()
            return
        self._fail(Disconnected("broke off the response" if self._conn.got_bytes else "closed the connection"))

    def _body(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self._buffered += len(data)
            if self._buffered >= HIGH_WATER:
                self._conn.pause()

    def _parse(self, buf: bytearray) -> None:
        if self._idle_timer is not None:
            self._last_data = self._conn.loop.time()
        if self._complete:  # bytes after the end: the connection cannot be trusted again
            self._keep_alive = False
            buf.clear()
            return
        while buf:
            if not self._head_done:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise Disconnected("sent a response head over 64 KiB")
                    return
                head = bytes(buf[:end])
                del buf[:end + 4]
                if self._head(head):
                    self._head_done = True
                    if not self._head_waiter.done():
                        self._head_waiter.set_result(None)
                    if self._complete:
                        break
                continue
            if self._mode == "length":
                take = bytes(buf[:self._remaining])
                del buf[:len(take)]
                self._remaining -= len(take)
                self._body(take)
                if self._remaining == 0:
                    self._complete = True
                    break
            elif self._mode == "chunked":
                self._chunked(buf)
                break
            else:  # until the connection closes
                self._body(bytes(buf))
                buf.clear()
        if self._complete:
            if buf:  # more than one response's worth: the connection cannot be trusted again
                self._keep_alive = False
                buf.clear()
            self._wake()
        elif self._pieces:
            self._wake()

    def _head(self, head: bytes) -> bool:
        """Take a status line and headers; False for an interim (1xx) response."""
        try:
            lines = head.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            status = int(rest[:3])
        except (UnicodeDecodeError, ValueError):
            raise Disconnected("sent something that is not an HTTP response") from None
        if not version.startswith("HTTP/1.") or not 100 <= status <= 599:
            raise Disconnected("sent something that is not an HTTP response")
        if status < 200:
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise Disconnected("sent a malformed response header")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self._keep_alive = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
            self._remaining = -1  # expecting a chunk-size line
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise Disconnected("sent a malformed Content-Length") from None
            self._mode = "length"
            self._complete = self._remaining == 0
        elif status in (204, 304):
            self._mode, self._complete = "length", True
        else:
            self._mode, self._keep_alive = "close", False
        return True

    def _chunked(self, buf: bytearray) -> None:
        """Consume what it can of a chunked body, up to its end. An upstream's burst of events is
        one read of many chunks: the buffer is copied once, walked by offset, the chunks' data
        handed on as one piece and the consumed part cut once."""
        data = bytes(buf)
        pos, n = 0, len(data)
        pieces: list[bytes] = []
        try:
            while pos < n:
                remaining = self._remaining
                if remaining == -1:  # the size line
                    end = data.find(b"\r\n", pos)
                    if end < 0:
                        if n - pos > 1024:
                            raise Disconnected("sent a malformed chunk")
                        return
                    size = _chunk_size(data[pos:end])
                    pos = end + 2
                    if size == 0:
                        self._remaining = -2
                        continue
                    stop = pos + size
                    if stop + 2 <= n:  # the usual case: the whole chunk and its CRLF are here
                        if data[stop] != 13 or data[stop + 1] != 10:
                            raise Disconnected("sent a malformed chunk")
                        pieces.append(data[pos:stop])
                        pos = stop + 2
                        continue
                    self._remaining = size
                elif remaining == -2:  # trailers after the last chunk, up to an empty line
                    end = data.find(b"\r\n", pos)
                    if end < 0:
                        return
                    empty = end == pos
                    pos = end + 2
                    if empty:
                        self._complete = True
                        return
                elif remaining == -3:  # the CRLF after a chunk's data
                    if n - pos < 2:
                        return
                    if data[pos] != 13 or data[pos + 1] != 10:
                        raise Disconnected("sent a malformed chunk")
                    pos += 2
                    self._remaining = -1
                else:
                    take = min(remaining, n - pos)
                    pieces.append(data[pos:pos + take])
                    pos += take
                    self._remaining = remaining - take if take < remaining else -3
        finally:
            del buf[:pos]
            if pieces:
                self._body(pieces[0] if len(pieces) == 1 else b"".join(pieces))


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size (hex digits, maybe a ``;extension``)."""
    if 59 in line:  # b";"
        line = line.split(b";", 1)[0]
    digits = line.strip()
    if not digits or digits.strip(b"0123456789abcdefABCDEF"):
        raise Disconnected("sent a malformed chunk")
    return int(digits, 16)


class Pool:
    """The connections to one server (``base_url``: scheme, host and port; paths are per
    request). ``limit`` bounds open connections (``None``: no bound; the upstream queues)."""

    def __init__(self, base_url: str, *, limit: int | None = None, keepalive: float = 30.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme `{parts.scheme}`")
        self.host = parts.hostname or "localhost"
        self.base_path = parts.path.rstrip("/")
        """The URL's path, which every request path extends: ``/v1``."""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        default = 443 if self.ssl else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = host if self.port == default else f"{host}:{self.port}"
        self.keepalive = keepalive
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._slots = asyncio.Semaphore(limit) if limit else None
        self._closed = False

    async def request(self, method: str, path: str, *, body: bytes = b"",
                      headers: dict[str, str] | None = None, connect_timeout: float | None = None) -> Response:
        """Send a request; return once the response head has arrived."""
        if self._closed:
            raise ConnectError("the client is closed")
        head = [f"{method} {path} HTTP/1.1\r\nHost: {self.authority}\r\n"]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n")
        if body or method == "POST":
            head.append(f"Content-Length: {len(body)}\r\n")
        head.append("\r\n")
        payload = "".join(head).encode("latin-1") + body
        if self._slots is not None:
            await self._slots.acquire()
        try:
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await self._send(conn, payload)
                except Disconnected:
                    if conn.got_bytes:
                        raise
                    # A keep-alive connection the server had closed: it never saw the request.
            return await self._send(await self._connect(connect_timeout), payload)
        except BaseException:
            self._release_slot()
            raise

    async def _send(self, conn: _Connection, payload: bytes) -> Response:
        """Write the request; the response owns the connection (and its slot) once its head
        has arrived. Until then a failure or a cancellation drops the connection."""
        response = Response(conn, self)
        conn.response = response
        conn.got_bytes = False
        assert conn.transport is not None
        conn.transport.write(payload)
        try:
            await response._head_waiter
        except BaseException:
            response._finished = True
            conn.response = None
            self._drop(conn)
            raise
        return response

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive:
                return conn
            self._drop(conn)
        return None

    async def _connect(self, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            raise ConnectTimeout(f"cannot connect within {timeout:g}s") from None
        except ssl.SSLError as exc:
            raise ConnectError(f"TLS handshake failed: {exc.reason or exc}") from None
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConnectError(f"cannot connect: {why.lower()}") from None
        self._open.add(conn)
        return conn

    def _put(self, conn: _Connection) -> None:
        self._release_slot()
        if self._closed or conn.lost:
            self._drop(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _discard(self, conn: _Connection) -> None:
        self._release_slot()
        self._drop(conn)

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def _drop(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.lost = True
        if conn.transport is not None:
            conn.transport.abort()

    @property
    def connections(self) -> int:
        """Open connections, idle or busy."""
        return len(self._open)

    async def close(self) -> None:
        """Close every connection (responses still being read fail with :class:`Disconnected`)."""
        self._closed = True
        for conn in list(self._open):
            if conn.response is not None:
                conn.response._fail(Disconnected("the client is closed"))
            self._drop(conn)
        self._idle.clear()


def target(url: str) -> str:
    """The request target (path and query) of an absolute URL."""
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def describe(exc: BaseException) -> str:
    """A short, client-safe account of a transport failure."""
    if isinstance(exc, HTTPError):
        return str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
