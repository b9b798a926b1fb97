"""The remote backend's HTTP/1.1 client against scripted servers on loopback: framing (length,
chunked, close-delimited) however the bytes are split, keep-alive reuse, stale connections,
malformed answers, back-pressure and cancellation."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Awaitable, Callable

import pytest

from backends.remote.http import HIGH_WATER, ConnectError, ConnectTimeout, Disconnected, Pool, ReadTimeout, target

TLS = Path(__file__).parent / "data" / "tls"  # a self-signed certificate for 127.0.0.1, test use only
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One request: its request line, headers (lower-case names) and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return lines[0].encode(), headers, body


class Server:
    """A loopback TCP server running ``handler`` for each connection; counts connections.
    With ``tls``, it speaks https with the test certificate in ``tests/data/tls``."""

    def __init__(self, handler: Handler, tls: bool = False) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None
        self.tls = tls

    async def __aenter__(self) -> "Server":
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        context = None
        if self.tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(TLS / "localhost.crt", TLS / "localhost.key")
        self.server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}/v1"


def keep_answering(response: bytes, *, split: int = 0, delay: float = 0.0) -> Handler:
    """Answer every request on the connection with ``response``, written ``split`` bytes at a
    time (0: at once) with ``delay`` seconds between pieces."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            step = split or len(response)
            for i in range(0, len(response), step):
                writer.write(response[i:i + step])
                await writer.drain()
                if delay:
                    await asyncio.sleep(delay)
    return handler


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\": \"b\"}\n"
CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"f\r\ndata: {\"x\":1}\n\n\r\n"
           b"6;ext=1\r\ndata: \r\n"
           b"8\r\n[DONE]\n\n\r\n"
           b"0\r\nX-Trailer: t\r\n\r\n")


@pytest.mark.parametrize("split", [0, 1, 2, 3, 7, 16])
@pytest.mark.parametrize("response, body", [
    (LENGTH, b'{"a": "b"}\n'),
    (CHUNKED, b'data: {"x":1}\n\ndata: [DONE]\n\n'),
])
def test_bodies_whatever_the_split(response: bytes, body: bytes, split: int) -> None:
    async def main() -> None:
        async with Server(keep_answering(response, split=split)) as server:
            pool = Pool(server.url)
            for _ in range(3):  # the same connection each time
                r = await pool.request("POST", pool.base_path + "/chat/completions", body=b"{}")
                assert r.status == 200
                assert await r.read() == body
                r.release()
            assert server.connections == 1 and pool.connections == 1
            await pool.close()
    run(main())


def test_request_bytes_host_and_headers() -> None:
    seen: list[tuple[bytes, dict[str, str], bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(LENGTH)
        await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            pool = Pool(server.url)
            r = await pool.request("POST", "/v1/chat/completions", body=b'{"k": 1}',
                                   headers={"content-type": "application/json", "authorization": "Bearer k"})
            await r.read()
            r.release()
            port = server.url.split(":")[2].split("/")[0]
            line, headers, body = seen[0]
            assert line == b"POST /v1/chat/completions HTTP/1.1"
            assert headers["host"] == f"127.0.0.1:{port}" and headers["authorization"] == "Bearer k"
            assert headers["content-length"] == "8" and body == b'{"k": 1}'
            await pool.close()
    run(main())


def test_interim_1xx_is_skipped_and_headers_are_lower_case() -> None:
    response = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 429 Too Many\r\nRetry-After: 7\r\nContent-Length: 2\r\n\r\nno"

    async def main() -> None:
        async with Server(keep_answering(response, split=5)) as server:
            pool = Pool(server.url)
            r = await pool.request("POST", "/x", body=b"{}")
            assert r.status == 429 and r.headers["retry-after"] == "7"
            assert await r.read() == b"no"
            r.release()
            await pool.close()
    run(main())


def test_close_delimited_body_and_connection_close_are_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"end")

    async def main() -> None:
        async with Server(handler) as server:
            pool = Pool(server.url)
            for _ in range(2):
                r = await pool.request("GET", "/health")
                assert await r.read() == b"until the end"
                r.release()
            assert server.connections == 2 and pool.connections == 0
            await pool.close()
    run(main())


def test_stream_pieces_arrive_as_they_are_sent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            event = f"data: {i}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def main() -> None:
        async with Server(handler) as server:
            pool = Pool(server.url)
            r = await pool.request("POST", "/s", body=b"{}")
            pieces = []
            while piece := await r.readany():
                pieces.append(piece)
            assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            assert r.at_eof()
            r.release()
            assert pool.connections == 1
            await pool.close()
    run(main())


def test_stale_keep_alive_connection_is_replaced() -> None:
    """The server closes each connection after one answer without saying so: the next request
    on the pooled connection gets no byte back and is sent once more on a new one."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(LENGTH)
        await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            pool = Pool(server.url)
            for _ in range(3):
                r = await pool.request("POST", "/x", body=b"{}")
                assert await r.read() == b'{"a": "b"}\n'
                r.release()
            assert server.connections == 3
            await pool.close()
    run(main())


@pytest.mark.parametrize("response, why", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "broke off the response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", "broke off the response"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n", "malformed chunk"),
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP response"),
    (b"HTTP/1.1 200 OK\r\nbroken header line\r\n\r\n", "malformed response header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", "malformed Content-Length"),
    (b"", "closed the connection"),
])
def test_broken_answers_raise_disconnected(response: bytes, why: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response)
        await writer.drain()

    async def main() -> None:
        async with Server(handler) as server:
            pool = Pool(server.url)
            with pytest.raises(Disconnected, match=why):
                r = await pool.request("POST", "/x", body=b"{}")
                try:
                    await r.read()
                finally:
                    r.close()
            assert pool.connections == 0
            await pool.close()
    run(main())


def test_connect_errors() -> None:
    async def main() -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with pytest.raises(ConnectError, match="cannot connect: connection refused"):
            await Pool(f"http://127.0.0.1:{port}").request("GET", "/")
        # A listener whose backlog is full never completes the handshake: the connect times out.
        with socket.socket() as full:
            full.bind(("127.0.0.1", 0))
            full.listen(0)
            fillers = []
            for _ in range(3):
                f = socket.socket()
                f.setblocking(False)
                f.connect_ex(full.getsockname())
                fillers.append(f)
            pool = Pool(f"http://127.0.0.1:{full.getsockname()[1]}")
            try:
                with pytest.raises(ConnectTimeout, match="within 0.2s"):
                    for _ in range(8):  # the kernel may accept a few more than the backlog
                        r = await pool.request("GET", "/", connect_timeout=0.2)
                        r.close()
            finally:
                for f in fillers:
                    f.close()
    run(main())


def test_back_pressure_pauses_reading_and_all_bytes_arrive() -> None:
    big = bytes(range(256)) * 8192  # 2 MiB, far over the high-water mark

    async def main() -> None:
        response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big
        async with Server(keep_answering(response)) as server:
            pool = Pool(server.url)
            r = await pool.request("GET", "/big")
            await asyncio.sleep(0.2)  # let the connection fill up to the mark and pause
            assert r._conn._paused  # type: ignore[attr-defined]
            got = await r.read()
            assert got == big
            r.release()
            await pool.close()
    run(main())


def test_cancelled_request_drops_its_connection_and_slot() -> None:
    """A caller cancelled while waiting (client gone) closes the connection at once, so the
    server sees it leave; the connection limit's slot is given back."""
    async def main() -> None:
        gone = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            if not await reader.read(1):
                gone.set()

        async with Server(handler) as server:
            pool = Pool(server.url, limit=1)
            task = asyncio.ensure_future(pool.request("POST", "/slow", body=b"{}"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(gone.wait(), 2)
            assert pool.connections == 0
            assert pool._slots is not None and not pool._slots.locked()  # type: ignore[attr-defined]
            await pool.close()
    run(main())


def test_limit_queues_requests_beyond_it() -> None:
    async def main() -> None:
        async with Server(keep_answering(LENGTH, delay=0.01)) as server:
            pool = Pool(server.url, limit=2)

            async def one() -> bytes:
                r = await pool.request("POST", "/x", body=b"{}")
                try:
                    return await r.read()
                finally:
                    r.release()

            assert set(await asyncio.gather(*(one() for _ in range(10)))) == {b'{"a": "b"}\n'}
            assert server.connections <= 2
            await pool.close()
    run(main())


def test_base_path_authority_and_target() -> None:
    pool = Pool("https://api.example.com/v1/")
    assert (pool.host, pool.port, pool.authority, pool.base_path) == ("api.example.com", 443, "api.example.com", "/v1")
    assert Pool("http://[::1]:8080").authority == "[::1]:8080"
    assert target("http://h:1/health") == "/health" and target("http://h:1") == "/"
    assert target("http://h:1/v1/models?x=1") == "/v1/models?x=1"
    with pytest.raises(ValueError, match="scheme"):
        Pool("ftp://h/")


def test_idle_limit_fails_a_silent_stream_but_not_a_slow_steady_one() -> None:
    def handler(gaps: list[float]) -> Handler:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for gap in gaps:
                await asyncio.sleep(gap)
                writer.write(b"2\r\nok\r\n")
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        return serve

    async def read_all(gaps: list[float]) -> bytes:
        async with Server(handler(gaps)) as server:
            pool = Pool(server.url)
            r = await pool.request("POST", "/s", body=b"{}")
            r.watch_idle(0.15)
            try:
                return await r.read()
            finally:
                r.close()
                await pool.close()

    # Eight pieces 0.1 s apart: 0.8 s in all, never 0.15 s of silence.
    assert asyncio.run(read_all([0.1] * 8)) == b"ok" * 8
    with pytest.raises(ReadTimeout, match="sent nothing for 0.15s"):
        asyncio.run(read_all([0.05, 0.4]))


def test_idle_limit_does_not_blame_the_server_for_a_slow_reader() -> None:
    big = b"x" * (HIGH_WATER * 4)

    async def main() -> None:
        response = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big
        async with Server(keep_answering(response)) as server:
            pool = Pool(server.url)
            r = await pool.request("GET", "/big")
            r.watch_idle(0.1)
            await asyncio.sleep(0.35)  # the reader dawdles; the connection is paused meanwhile
            assert await r.read() == big
            r.release()
            await pool.close()
    asyncio.run(main())


def test_https_verifies_the_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """https goes through the standard ssl module with verification on: an unknown certificate
    is refused; trusted (here through SSL_CERT_FILE, as an operator would for a private CA),
    the request goes through and the connection is kept alive."""
    async def main() -> None:
        async with Server(keep_answering(LENGTH), tls=True) as server:
            pool = Pool(server.url)
            with pytest.raises(ConnectError, match="TLS handshake failed"):
                await pool.request("POST", "/v1/chat/completions", body=b"{}")
            monkeypatch.setenv("SSL_CERT_FILE", str(TLS / "localhost.crt"))
            pool = Pool(server.url)
            for _ in range(2):
                r = await pool.request("POST", "/v1/chat/completions", body=b"{}")
                assert r.status == 200 and await r.read() == b'{"a": "b"}\n'
                r.release()
            assert server.connections == 1  # the refused handshake never got this far; then one, kept alive
            await pool.close()
    asyncio.run(main())


# --- the chunked-body parser, driven directly -----------------------------------------------

MANY_CHUNKS = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in [b"data: {\"n\":%d}\n\n" % i for i in range(12)])
               + b"A;name=value\r\n0123456789\r\n"  # an extension, upper-case hex
               + b"1 \r\nx\r\n"  # whitespace after the size
               + b"0\r\nX-Trailer: t\r\n\r\n")
MANY_BODY = b"".join(b"data: {\"n\":%d}\n\n" % i for i in range(12)) + b"0123456789x"


def _parsed(pieces: list[bytes]) -> tuple[bytes, bool, int]:
    """Feed ``pieces`` to a connection as separate reads: (body, complete, bytes left unparsed)."""
    from backends.remote.http import Response, _Connection

    class Transport:
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...
        def abort(self) -> None: ...
        def close(self) -> None: ...

    loop = asyncio.new_event_loop()
    try:
        conn = _Connection(loop)
        conn.transport = Transport()  # type: ignore[assignment]
        resp = Response(conn, None)  # type: ignore[arg-type]
        conn.response = resp
        for piece in pieces:
            conn.data_received(piece)
        if resp._error is not None:
            raise resp._error
        return b"".join(resp._pieces), resp._complete, len(conn._buf)
    finally:
        loop.close()


def test_chunked_parser_every_split_point() -> None:
    for cut in range(1, len(MANY_CHUNKS)):
        assert _parsed([MANY_CHUNKS[:cut], MANY_CHUNKS[cut:]]) == (MANY_BODY, True, 0), cut
    assert _parsed([MANY_CHUNKS[i:i + 1] for i in range(len(MANY_CHUNKS))]) == (MANY_BODY, True, 0)
    assert _parsed([MANY_CHUNKS]) == (MANY_BODY, True, 0)


def test_chunked_parser_keeps_a_partial_chunk_for_later() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert _parsed([head + b"5\r\nhel"]) == (b"hel", False, 0)
    assert _parsed([head + b"5\r\nhello\r"]) == (b"hello", False, 1)  # the CR waits for its LF
    assert _parsed([head + b"5\r\nhello\r\n1"]) == (b"hello", False, 1)  # a size line not finished


@pytest.mark.parametrize("size_line", [b"-5", b"+5", b"5_0", b"0x5", b"", b"g", b" ", b";ext"])
def test_chunked_parser_rejects_malformed_sizes(size_line: bytes) -> None:
    with pytest.raises(Disconnected, match="malformed chunk"):
        _parsed([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\nhello\r\n0\r\n\r\n"])


@pytest.mark.parametrize("after", [b"XY", b"\rX", b"\n\r"])
def test_chunked_parser_rejects_data_not_followed_by_crlf(after: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(Disconnected, match="malformed chunk"):
        _parsed([head + b"5\r\nhello" + after + b"0\r\n\r\n"])
    with pytest.raises(Disconnected, match="malformed chunk"):  # the same, the chunk split across reads
        _parsed([head + b"5\r\nhel", b"lo" + after + b"0\r\n\r\n"])
