"""The worker boundary's transport: our frames over a Unix socket pair against ZeroMQ.

Two processes, as the router and a worker: the "worker" sends ``Steps`` frames (router/workers/
wire.py) of ``--batch`` sequences' tokens each, the "router" decodes them. Measured: frames/s
streamed one way (a decode step's output for every running sequence, as fast as it can go), and
the round trip of one small frame (a request's ``Generate`` out, its first step back). Both
sides run uvloop where the router does. ZeroMQ needs ``pip install pyzmq`` (not a dependency).

    .venv/bin/python bench/worker_transport.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402

from router.engine import EngineStep  # noqa: E402
from router.workers.wire import Abort, FrameProtocol, Steps, ToRouter, ToWorker  # noqa: E402

_encode = msgspec.msgpack.Encoder().encode


def frame(batch: int, i: int) -> Steps:
    return Steps([(r, EngineStep([1000 + i % 7])) for r in range(batch)])


# --- our transport: asyncio over a socket pair -------------------------------------------------


def _socket_worker(sock: socket.socket, frames: int, batch: int, pings: int) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        got: asyncio.Queue = asyncio.Queue()
        protocol = FrameProtocol(ToWorker, got.put_nowait, lambda: None)
        await loop.create_connection(lambda: protocol, sock=sock)
        protocol.send(Steps([]))  # ready
        await got.get()  # go
        for i in range(frames):
            protocol.send(frame(batch, i))
            if i % 64 == 0:
                await asyncio.sleep(0)  # let the transport write, as a worker's loop does
        for _ in range(pings):
            await got.get()
            protocol.send(frame(1, 0))
        await got.get()

    uvloop.run(main())


async def _socket_router(frames: int, batch: int, pings: int) -> tuple[float, list[float]]:
    ours, theirs = socket.socketpair()
    proc = mp.get_context("spawn").Process(target=_socket_worker, args=(theirs, frames, batch, pings))
    proc.start()
    loop = asyncio.get_running_loop()
    got: asyncio.Queue = asyncio.Queue()
    count = [0]
    done = loop.create_future()

    ready = loop.create_future()

    def receive(message: object) -> None:
        if not ready.done():
            ready.set_result(None)
            return
        count[0] += 1
        if count[0] == frames:
            done.set_result(time.perf_counter())
        elif count[0] > frames:
            got.put_nowait(message)

    protocol = FrameProtocol(ToRouter, receive, lambda: None)
    await loop.create_connection(lambda: protocol, sock=ours)
    await ready  # timed from here: the worker has started
    start = time.perf_counter()
    protocol.send(Abort(0))
    rate = frames / (await done - start)
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        protocol.send(Abort(1))
        await got.get()
        rtts.append((time.perf_counter() - t) * 1e6)
    protocol.send(Abort(2))
    await asyncio.sleep(0.05)
    proc.join()
    return rate, rtts


# --- ZeroMQ: a PAIR socket over ipc://, as vLLM's engine core and API server talk ---------------


def _zmq_worker(address: str, frames: int, batch: int, pings: int) -> None:
    import uvloop
    import zmq
    import zmq.asyncio

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(address)
        decode = msgspec.msgpack.Decoder(ToWorker).decode
        await sock.send(_encode(Steps([])))  # ready
        decode(await sock.recv())
        for i in range(frames):
            await sock.send(_encode(frame(batch, i)), copy=False)
        for _ in range(pings):
            decode(await sock.recv())
            await sock.send(_encode(frame(1, 0)))
        decode(await sock.recv())
        sock.close()
        ctx.term()

    uvloop.run(main())


async def _zmq_router(frames: int, batch: int, pings: int, tmp: str) -> tuple[float, list[float]]:
    import zmq
    import zmq.asyncio

    address = f"ipc://{tmp}/bench-zmq.sock"
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    proc = mp.get_context("spawn").Process(target=_zmq_worker, args=(address, frames, batch, pings))
    proc.start()
    decode = msgspec.msgpack.Decoder(ToRouter).decode
    decode(await sock.recv())  # timed from here: the worker has started
    start = time.perf_counter()
    await sock.send(_encode(Abort(0)))
    for _ in range(frames):
        decode(await sock.recv(copy=False))
    rate = frames / (time.perf_counter() - start)
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        await sock.send(_encode(Abort(1)))
        decode(await sock.recv())
        rtts.append((time.perf_counter() - t) * 1e6)
    await sock.send(_encode(Abort(2)))
    proc.join()
    sock.close()
    ctx.term()
    return rate, rtts


def main() -> None:
    import tempfile

    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20000)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-transport-")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        results: dict[str, list[tuple[float, list[float]]]] = {"socket pair + asyncio": [], "ZeroMQ PAIR (ipc)": []}
        for _ in range(args.rounds):
            results["socket pair + asyncio"].append(uvloop.run(_socket_router(args.frames, batch, args.pings)))
            results["ZeroMQ PAIR (ipc)"].append(uvloop.run(_zmq_router(args.frames, batch, args.pings, tmp)))
        for name, runs in results.items():
            rate = statistics.median(r for r, _ in runs)
            rtts = [x for _, rtt in runs for x in rtt]
            p99 = statistics.quantiles(rtts, n=100)[98]
            rows.append((batch, name, rate, statistics.median(rtts), p99))
            print(f"  batch {batch:3} {name:22} {rate:9,.0f} frames/s  round trip p50 {statistics.median(rtts):6.1f} us "
                  f"p99 {p99:6.1f} us", flush=True)
    print("\n| sequences a frame | transport | frames/s one way | round trip p50 | p99 |\n| --- | --- | --- | --- | --- |")
    for batch, name, rate, p50, p99 in rows:
        print(f"| {batch} | {name} | {rate:,.0f} | {p50:.0f} µs | {p99:.0f} µs |")


if __name__ == "__main__":
    main()
