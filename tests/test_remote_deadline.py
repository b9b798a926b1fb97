"""Deadline: the relay's per-request time limit (asyncio.timeout's behaviour, cheaper)."""

from __future__ import annotations

import asyncio
import time

import pytest

from backends.remote.deadline import Deadline


def test_block_within_the_limit_is_untouched() -> None:
    async def main() -> None:
        with Deadline(1) as d:
            await asyncio.sleep(0.01)
        assert not d.expired
        await asyncio.sleep(0.01)  # no cancellation left pending for the task
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    asyncio.run(main())


def test_block_past_the_limit_raises_timeout_error() -> None:
    async def main() -> None:
        seen = []

        async def work() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            with Deadline(0.02):
                await work()
        assert seen == ["cancelled"] and asyncio.get_running_loop().time() - t0 < 1
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await asyncio.sleep(0.01)  # the task goes on normally
    asyncio.run(main())


def test_other_cancellation_passes_through() -> None:
    async def main() -> None:
        async def request() -> None:
            with Deadline(10):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        task.cancel()  # the client left, say
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_outer_cancellation_at_the_same_time_is_not_swallowed() -> None:
    """The limit expires and somebody else cancels too: a cancellation, not a timeout."""
    async def main() -> None:
        async def request() -> None:
            with Deadline(0.01):
                asyncio.get_running_loop().call_later(0.015, task.cancel)
                time.sleep(0.05)  # both timers are due before the task runs again
                await asyncio.sleep(10)

        task = asyncio.ensure_future(request())
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
