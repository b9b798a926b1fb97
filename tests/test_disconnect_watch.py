"""DisconnectWatch / unless_disconnected: the work runs in the caller's task and is cancelled
only by the client leaving; any other cancellation passes through untouched."""

from __future__ import annotations

import asyncio

import pytest

from router.responses import ClientGone, DisconnectWatch, unless_disconnected


class Client:
    """An ASGI ``receive`` that reports ``http.disconnect`` once :meth:`leave` is called."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.left.set()


def test_work_finishes_and_the_watcher_ends_with_the_response_cancelling_nothing() -> None:
    """The watcher outlives the block until the server answers its receive (at the end of the
    response, as uvicorn does, or when the client goes): then it ends by itself and the request's
    task, long past the block, is not cancelled."""
    async def main() -> None:
        client = Client()
        before = len(asyncio.all_tasks())
        assert await unless_disconnected(DisconnectWatch(client.receive), asyncio.sleep(0.01, "done")) == "done"
        await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == before + 1  # still waiting on receive
        client.leave()  # the response is complete: receive says http.disconnect
        await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # not cancelled: this sleep ends normally
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        assert len(asyncio.all_tasks()) == before
    asyncio.run(main())


def test_client_leaving_after_the_block_cancels_nothing() -> None:
    async def main() -> None:
        client = Client()
        with DisconnectWatch(client.receive) as watch:
            await asyncio.sleep(0)
        client.leave()
        await asyncio.sleep(0.01)
        assert not watch.gone
    asyncio.run(main())


def test_client_leaving_cancels_the_work_and_raises_client_gone() -> None:
    async def main() -> None:
        client = Client()
        seen = []

        async def work() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        asyncio.get_running_loop().call_later(0.02, client.leave)
        with pytest.raises(ClientGone):
            await unless_disconnected(DisconnectWatch(client.receive), work())
        assert seen == ["cancelled"]
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # the cancellation ended with the block
        await asyncio.sleep(0)  # and no cancellation is still pending for this task
    asyncio.run(main())


def test_other_cancellation_passes_through() -> None:
    async def main() -> None:
        client = Client()

        async def request() -> None:
            with DisconnectWatch(client.receive):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        task.cancel()  # a shutdown, say: not the client
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_messages_other_than_disconnect_are_ignored() -> None:
    async def main() -> None:
        messages = [{"type": "http.request", "body": b"", "more_body": False}]
        left = asyncio.Event()

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        with DisconnectWatch(receive) as watch:
            await asyncio.sleep(0.02)
        assert not watch.gone
    asyncio.run(main())


def test_no_reference_cycles_left_per_request() -> None:
    """Each use must be freed by reference counting alone: a cycle per request (say, a cancelled
    watcher keeping its CancelledError, whose traceback holds the watch and so the task) makes
    the cyclic GC run often and scan the request's task and scope each time."""
    import gc

    async def main() -> int:
        async def request() -> None:
            client = Client()  # one receive per request, as a server gives
            watch = DisconnectWatch(client.receive)
            await unless_disconnected(watch, asyncio.sleep(0))
            with watch:  # the same watch again, as a stream's response does
                await asyncio.sleep(0)
            with DisconnectWatch(client.receive):
                await asyncio.sleep(0)
            client.leave()  # the response is complete
            await asyncio.sleep(0)  # the watchers see it and end

        for _ in range(3):  # warm-up: first-use caches are not per-request garbage
            await request()
        await asyncio.sleep(0)
        gc.collect()
        for _ in range(50):
            await request()
        await asyncio.sleep(0)
        return gc.collect()

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        found = asyncio.run(main())
    finally:
        if was_enabled:
            gc.enable()
    assert found < 10, f"{found} objects were only reclaimable by the cyclic GC after 100 uses"


def test_one_watch_guards_several_blocks_with_one_watcher() -> None:
    async def main() -> None:
        client = Client()
        watch = DisconnectWatch(client.receive)
        before = len(asyncio.all_tasks())
        assert await unless_disconnected(watch, asyncio.sleep(0, "queued")) == "queued"
        assert await unless_disconnected(watch, asyncio.sleep(0, "answered")) == "answered"
        with watch:
            await asyncio.sleep(0)
        assert len(asyncio.all_tasks()) == before + 1  # one watcher for all three blocks
        asyncio.get_running_loop().call_later(0.02, client.leave)
        with pytest.raises(ClientGone):
            await unless_disconnected(watch, asyncio.sleep(10))
        assert watch.gone and asyncio.current_task().cancelling() == 0
    asyncio.run(main())


def test_client_gone_between_blocks_the_next_one_does_not_run() -> None:
    """Also when the next block's work would finish without suspending: no cancellation may be
    left pending on the request's task to land after the block."""
    async def main() -> None:
        client = Client()
        watch = DisconnectWatch(client.receive)
        await unless_disconnected(watch, asyncio.sleep(0))
        client.leave()
        await asyncio.sleep(0.01)  # outside any block: nothing is cancelled
        ran = []

        async def instant() -> str:
            ran.append("work")
            return "never suspends"

        with pytest.raises(ClientGone):
            await unless_disconnected(watch, instant())
        assert watch.gone and ran == []
        await asyncio.sleep(0.01)  # no cancellation pending on this task
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
    asyncio.run(main())


# --- under uvicorn: the connection's flag, polled, instead of a watcher task -------------------


class RequestResponseCycle:
    """Stands in for uvicorn's request cycle: a ``disconnected`` flag the server sets."""

    __module__ = "uvicorn.protocols.http.fake_impl"

    def __init__(self) -> None:
        self.disconnected = False

    async def receive(self) -> dict:
        raise AssertionError("a polled watch never calls receive")


def _poll():
    from router.responses import _DisconnectPoll

    return _DisconnectPoll.of(asyncio.get_running_loop())


def test_polled_leaving_cancels_the_work_within_the_interval_without_a_task() -> None:
    from router.responses import POLL_INTERVAL

    async def main() -> None:
        cycle = RequestResponseCycle()
        watch = DisconnectWatch(cycle.receive)
        before = len(asyncio.all_tasks())
        assert await unless_disconnected(watch, asyncio.sleep(0, "queued")) == "queued"
        assert len(asyncio.all_tasks()) == before and not _poll().watches
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, setattr, cycle, "disconnected", True)
        started = loop.time()
        with pytest.raises(ClientGone):
            await unless_disconnected(watch, asyncio.sleep(10))
        assert loop.time() - started < 0.01 + POLL_INTERVAL + 0.2
        assert watch.gone and asyncio.current_task().cancelling() == 0
        assert not _poll().watches
        with pytest.raises(ClientGone):  # a later block does not run
            await unless_disconnected(watch, asyncio.sleep(0))
    asyncio.run(main())


def test_polled_leaving_after_the_block_or_before_it() -> None:
    async def main() -> None:
        cycle = RequestResponseCycle()
        with DisconnectWatch(cycle.receive) as watch:
            await asyncio.sleep(0)
        cycle.disconnected = True
        await asyncio.sleep(0.05)
        assert not watch.gone and asyncio.current_task().cancelling() == 0
        ran = []

        async def instant() -> None:
            ran.append("work")

        with pytest.raises(ClientGone):
            await unless_disconnected(DisconnectWatch(cycle.receive), instant())
        assert ran == []
    asyncio.run(main())


def test_polled_other_cancellation_passes_through_and_the_timer_stops() -> None:
    async def main() -> None:
        cycle = RequestResponseCycle()

        async def request() -> None:
            with DisconnectWatch(cycle.receive):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.05)
        assert len(_poll().watches) == 1 and _poll()._timer is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _poll().watches
        await asyncio.sleep(0.05)
        assert _poll()._timer is None  # nothing open: no more looks
    asyncio.run(main())


def test_under_a_real_uvicorn_server_the_watch_polls_and_sees_the_client_leave() -> None:
    import socket

    import uvicorn

    seen: dict = {}

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await receive()  # the (empty) body
        watch = DisconnectWatch(receive)
        seen["polled"] = watch._cycle is not None
        tasks = len(asyncio.all_tasks())

        async def work() -> None:
            await asyncio.sleep(0.05)
            seen["tasks_added"] = len(asyncio.all_tasks()) - tasks  # a watcher task would count
            await asyncio.sleep(10)

        try:
            await unless_disconnected(watch, work())
        except ClientGone:
            seen["gone"] = asyncio.get_running_loop().time()

    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        left = asyncio.get_running_loop().time()
        writer.close()
        for _ in range(100):
            if "gone" in seen:
                break
            await asyncio.sleep(0.01)
        server.should_exit = True
        await serving
        assert seen["polled"] and seen["tasks_added"] == 0
        assert "gone" in seen and seen["gone"] - left < 0.5

    asyncio.run(main())
