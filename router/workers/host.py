"""The worker's side of the boundary: one engine, its requests, and their steps batched.

A :class:`~router.workers.wire.Generate` goes to the engine's ``submit`` (both built-in engines
have it: each step is delivered by a plain callback, with no task or iterator per request), or,
for an engine with ``generate`` alone, to a task of its own. Whatever arrives within one turn of
the event loop (an engine step delivers all of its sequences' tokens in one callback) leaves as
one :class:`~router.workers.wire.Steps` frame, sent at the end of that turn.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from functools import partial
from pathlib import Path
from typing import Any, Callable

import msgspec

from ..constraints import ConstraintPlan, ConstraintSpec, GrammarCompiler
from ..engine import Engine, EngineError, EngineRequest, EngineStep, UnknownAdapter
from ..errors import APIError
from .wire import Abort, Call, Failure, Generate, Reply, Steps, Stop

log = logging.getLogger("router.worker")

STATS_INTERVAL = 0.5
"""Seconds between two looks at the engine's stats; they travel only when they changed (the
router's /health and /metrics read them at most this stale)."""


def failure_of(rid: int, exc: BaseException) -> Failure:
    """How an exception crosses to the router (:func:`router.workers.client.error_of` turns it
    back into one)."""
    if isinstance(exc, UnknownAdapter):
        return Failure(rid, "unknown_adapter", exc.adapter)
    if isinstance(exc, APIError):
        return Failure(rid, "bad_request", exc.message, exc.param)
    if isinstance(exc, EngineError):
        return Failure(rid, "engine", str(exc))
    if isinstance(exc, ValueError):  # an adapter's own problems, named by the engine
        return Failure(rid, "value", str(exc))
    return Failure(rid, "engine", f"{type(exc).__name__}: {exc}")


class EngineHost:
    """Serves one loaded engine to the router over ``send``."""

    def __init__(self, engine: Engine, send: Callable[[Any], bool]) -> None:
        self.engine = engine
        self.grammars = GrammarCompiler(engine.tokenizer)
        self._send = send
        self._submit = getattr(engine, "submit", None)
        self._aborts: dict[int, Callable[[], None]] = {}  # requests submitted, not finished
        self._tasks: dict[int, asyncio.Task[None]] = {}  # requests being run by a task
        self._steps: list[tuple[int, EngineStep]] = []
        self._failures: list[Failure] = []
        self._flushing = False
        self._stats: dict[str, Any] | None = None
        self._loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        self._stats_task = self._loop.create_task(self._watch_stats())

    # --- messages from the router -------------------------------------------------------

    def receive(self, message: Any) -> None:
        if isinstance(message, Generate):
            if self._submit is not None and message.constraint is None:
                self._start(message.rid, message.request)
            else:
                task = self._loop.create_task(self._run(message.rid, message.request, message.constraint))
                self._tasks[message.rid] = task
        elif isinstance(message, Abort):
            abort = self._aborts.pop(message.rid, None)
            if abort is not None:
                abort()  # the engine frees the sequence's memory before its next step
            task = self._tasks.pop(message.rid, None)
            if task is not None:
                task.cancel()  # closes the engine's iterator: the same
        elif isinstance(message, Call):
            self._loop.create_task(self._call(message))
        elif isinstance(message, Stop):
            self.stopped.set()

    def _start(self, rid: int, request: EngineRequest) -> None:
        try:
            self._aborts[rid] = self._submit(request, partial(self._deliver, rid))  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - refused at once (an empty prompt, say)
            self._fail(rid, request, exc)

    def _deliver(self, rid: int, item: EngineStep | BaseException) -> None:
        if rid not in self._aborts:
            return  # aborted meanwhile: the router expects nothing more
        if isinstance(item, BaseException):
            del self._aborts[rid]
            self._failures.append(failure_of(rid, item))
        else:
            if item.finish_reason is not None:
                del self._aborts[rid]
            self._steps.append((rid, item))
        self._schedule_flush()

    def _fail(self, rid: int, request: EngineRequest, exc: Exception) -> None:
        if not isinstance(exc, (EngineError, APIError)):
            log.error("request %s failed", request.request_id, exc_info=exc)
        self._failures.append(failure_of(rid, exc))
        self._schedule_flush()

    async def _run(self, rid: int, request: EngineRequest, plan: ConstraintPlan | None) -> None:
        try:
            if plan is not None:
                request.constraint = await self._build(plan)
            if self._submit is not None:
                if rid in self._tasks:  # not aborted while its grammar was built
                    self._start(rid, request)
                return
            async with aclosing(self.engine.generate(request)) as steps:
                async for step in steps:
                    self._emit_step(rid, step)
                    if step.finish_reason is not None:
                        break
        except asyncio.CancelledError:
            return  # aborted by the router: it expects nothing more
        except Exception as exc:  # noqa: BLE001 - the request's failure, the worker serves on
            self._fail(rid, request, exc)
        finally:
            self._tasks.pop(rid, None)

    async def _build(self, plan: ConstraintPlan) -> Any:
        # The router had the grammar compiled (check_constraint) before sending: a cache hit,
        # but after an eviction or in a fresh worker a compile, which may take a while.
        return await asyncio.to_thread(plan.build, self.grammars)

    async def _call(self, call: Call) -> None:
        result = None
        try:
            if call.method == "embed":
                result = await self.engine.embed(*call.args)  # type: ignore[attr-defined]
            elif call.method == "check_constraint":
                spec = msgspec.convert(call.args[0], ConstraintSpec)
                await asyncio.to_thread(self.grammars.constraint, spec)
            elif call.method == "add_adapter":
                await self.engine.add_adapter(call.args[0], Path(call.args[1]))  # type: ignore[attr-defined]
            elif call.method == "remove_adapter":
                await self.engine.remove_adapter(call.args[0])  # type: ignore[attr-defined]
            else:
                raise EngineError(f"no command `{call.method}`")
        except Exception as exc:  # noqa: BLE001 - answered to the caller
            self._send(Reply(call.cid, failure_of(call.cid, exc)))
        else:
            self._send(Reply(call.cid, result=result))

    # --- to the router --------------------------------------------------------------------

    def _emit_step(self, rid: int, step: EngineStep) -> None:
        self._steps.append((rid, step))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flushing:
            self._flushing = True
            # After every task the engine's delivery woke in this turn of the loop.
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if not self._steps and not self._failures:
            return
        steps, self._steps = self._steps, []
        failures, self._failures = self._failures, []
        # Stats travel with the frame that ends a request (its client may read /metrics next: a
        # speculative decode's counters, say) and with the watcher's look, not every step's frame:
        # per token at c=1 they were the engine's stats() called, compared and encoded for nobody.
        ends = failures or any(step.finish_reason is not None for _, step in steps)
        self._send(Steps(steps, failures, self._changed_stats() if ends else None))

    def _changed_stats(self) -> dict[str, Any] | None:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - stats are a courtesy
            return None
        if stats == self._stats:
            return None
        self._stats = stats
        return stats

    async def _watch_stats(self) -> None:
        # Between requests too: the router's /metrics and /health read the last stats sent.
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            stats = self._changed_stats()
            if stats is not None:
                self._send(Steps([], [], stats))

    async def close(self) -> None:
        """Abort what still runs (the router has failed those requests already)."""
        aborts, self._aborts = self._aborts, {}
        for abort in aborts.values():
            abort()
        self._stats_task.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, self._stats_task, return_exceptions=True)
