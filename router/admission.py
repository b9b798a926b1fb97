"""Admission control per model: at most ``max_concurrency`` requests run, ``max_queue`` wait.

Waiting requests are served by ``priority`` (lower first), then arrival. Past the queue limit the
answer is 429 with ``Retry-After`` at once, without touching the engine. A waiting request whose
client has gone is cancelled and leaves the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from .errors import APIError


class TooBusy(APIError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"Model `{model}` has too many requests waiting; try again shortly.",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


class Ticket:
    """A running slot; released exactly once when the response is over."""

    __slots__ = ("_queue",)

    def __init__(self, queue: "AdmissionQueue | None") -> None:
        self._queue = queue

    def release(self) -> None:
        queue, self._queue = self._queue, None
        if queue is not None:
            queue._release()


class AdmissionQueue:
    def __init__(self, model: str, max_concurrency: int | None, max_queue: int | None) -> None:
        self.model = model
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.running = 0
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._heap if not f.done())

    def try_acquire(self) -> Ticket | None:
        """A slot now if one is free and nobody waits for it, without a trip through the event
        loop; ``None`` otherwise (then :meth:`acquire`)."""
        if self.max_concurrency is None or (self.running < self.max_concurrency and not self.waiting):
            self.running += 1
            return Ticket(self)
        return None

    async def acquire(self, priority: int = 0) -> Ticket:
        ticket = self.try_acquire()
        if ticket is not None:
            return ticket
        if self.max_queue is not None and self.waiting >= self.max_queue:
            raise TooBusy(self.model)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # the slot came just as we gave up: pass it on
            raise
        return Ticket(self)

    def _release(self) -> None:
        self.running -= 1
        while self._heap:
            *_, future = heapq.heappop(self._heap)
            if not future.done():
                self.running += 1
                future.set_result(None)
                return
