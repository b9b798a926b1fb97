"""Which local models are loaded: on demand, within a memory limit, least recently used out first.

Every request for a local model holds a :class:`Lease` on it from the moment it names the model
until its response ends; a model with leases is never unloaded. A request for a model that is
not loaded starts its load (concurrent requests share one) and waits. To make room under
``[server] memory_limit`` the fleet unloads idle models, least recently used first, pinned ones
never; if none can go, the load waits for one to become idle. After :data:`DRAIN_AFTER` it
drains the busy model loaded the longest (new requests for it wait; it unloads once its running
ones end), so that with every model busy each still gets its turn. A load that finds no room
within ``load_timeout`` fails with a 503 naming the models in the way. ``keep_alive`` unloads a model that has been idle
that long. A worker that dies fails its own requests (:mod:`router.workers.client`); its model
loads again on the next request, after a backoff, and is marked failed after repeated crashes.

Memory is counted as the workers' resident memory, measured every second; a model not loaded
yet counts its estimate (:mod:`router.footprint`) or what it took the last time it was loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .backend import AdapterModel, Backend, LocalBackend
from .errors import APIError, Unavailable
from .footprint import Footprint, resident_bytes
from .units import format_size
from .workers.client import LoadError, describe_exit

if TYPE_CHECKING:
    from .config import ServerConfig
    from .metrics import RouterMetrics

log = logging.getLogger("router.fleet")

CRASH_WINDOW = 60.0
"""Seconds within which repeated crashes mark a model failed."""
CRASH_LIMIT = 3
FAILED_RETRY = 60.0
"""Seconds a failed model refuses requests before the next one tries to load it again."""
MEASURE_INTERVAL = 1.0
DRAIN_AFTER = 5.0
"""Seconds a load waits for an idle model to make room before it drains a busy one."""
UNLOAD_CAUSES = ("idle", "room", "admin", "crash")


class NoRoom(Unavailable):
    """The model could not be loaded within ``load_timeout``: the memory limit is taken by
    models that cannot be unloaded now."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="insufficient_memory", headers={"Retry-After": "10"})


class Busy(APIError):
    status = 409
    type = "invalid_request_error"


@dataclass(eq=False)
class ModelSlot:
    """One local model's place in the fleet."""

    backend: LocalBackend
    estimate: Footprint
    measured: int | None = None
    """The most resident memory its worker was seen to take, over every load so far."""
    resident: int = 0
    """Its worker's resident memory now (the estimate for a model in the router's process)."""
    users: int = 0
    """Requests that named it and have not ended: queued, waiting for the load, or running."""
    drain_waiters: int = 0
    """Those of its users waiting for it to finish draining (they run nothing there)."""
    draining: bool = False
    """A load waits for its room: no new request starts here; it unloads once its own end."""
    loaded_at: float = 0.0
    last_used: float = 0.0
    needs_room: bool = False
    """Its load waits for models to become idle (then a request's timeout names them)."""
    reserved: bool = False
    """Counted in the memory in use: loading (room was made for it), loaded or unloading."""
    loading: asyncio.Task[None] | None = None
    unloading: asyncio.Task[None] | None = None
    idle_timer: asyncio.TimerHandle | None = None
    crashes: deque[float] = field(default_factory=deque)
    failed_until: float = 0.0
    restarting: bool = False  # the next load follows a crash

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def expected(self) -> int:
        """What a load of it will take: the last measurement, else the estimate."""
        return self.measured if self.measured is not None else self.estimate.total

    @property
    def running(self) -> bool:
        """Requests hold it that run (or may run) on its engine."""
        return self.users > self.drain_waiters

    @property
    def in_use(self) -> int:
        """What it counts against the limit now."""
        if not self.reserved:
            return 0
        if self.backend.state == "loading":
            return max(self.expected, self.resident)
        return self.resident or self.expected

    def recent_crashes(self, now: float) -> int:
        while self.crashes and now - self.crashes[0] > CRASH_WINDOW:
            self.crashes.popleft()
        return len(self.crashes)


class Lease:
    """A request's hold on its model (none for a remote one): released exactly once."""

    __slots__ = ("_fleet", "_slot")

    def __init__(self, fleet: "Fleet | None", slot: ModelSlot | None) -> None:
        self._fleet = fleet
        self._slot = slot

    def release(self) -> None:
        fleet, self._fleet = self._fleet, None
        if fleet is not None:
            fleet._release(self._slot)  # type: ignore[arg-type]


NO_LEASE = Lease(None, None)


class Fleet:
    """The local models of one router and their loading (module docstring)."""

    def __init__(self, models: dict[str, Backend], server: "ServerConfig", metrics: "RouterMetrics | None" = None) -> None:
        self.limit: int | None = server.memory_limit  # type: ignore[assignment]
        self.load_timeout: float = server.load_timeout  # type: ignore[assignment]
        self.metrics = metrics
        self.slots: dict[str, ModelSlot] = {}
        for backend in models.values():
            if isinstance(backend, LocalBackend):
                try:
                    estimate = type(backend).estimate_memory(backend.config, backend.base_dir) or Footprint()
                except Exception:  # noqa: BLE001 - a file it cannot read: its load will say why
                    log.warning("model %s: no memory estimate", backend.name, exc_info=True)
                    estimate = Footprint()
                self.slots[backend.name] = ModelSlot(backend, estimate)
                backend.state = "unloaded"
        self._change = asyncio.Event()
        self._preloads: list[asyncio.Task[None]] = []
        self._watchers: set[asyncio.Task[Any]] = set()
        self._measuring: asyncio.Task[None] | None = None

    # --- requests -----------------------------------------------------------------------

    def slot_of(self, backend: Backend) -> ModelSlot | None:
        if isinstance(backend, AdapterModel):
            backend = backend.parent
        return self.slots.get(backend.name)

    def lease_now(self, backend: Backend) -> Lease | None:
        """A lease at once if the model is ready (a remote model's: nothing to hold), None if
        it must load first (then :meth:`lease`); 503 for a failed model still refusing."""
        slot = self.slot_of(backend)
        if slot is None:
            backend.check_ready()
            return NO_LEASE
        state = slot.backend.state
        if state == "ready" and not slot.draining:
            return self._hold(slot)
        if state == "failed" and time.monotonic() < slot.failed_until:
            raise self._failure(slot)
        return None

    async def lease(self, backend: Backend) -> Lease:
        """Hold ``backend``'s model, loading it first if need be (waiting at most
        ``load_timeout``): 503 if it cannot be loaded."""
        lease = self.lease_now(backend)
        if lease is not None:
            return lease
        slot = self.slot_of(backend)
        assert slot is not None
        lease = self._hold(slot)
        try:
            await asyncio.wait_for(self._ready(slot), self.load_timeout)
        except TimeoutError:
            lease.release()
            if slot.needs_room:
                raise NoRoom(self._in_the_way(slot, slot.expected)) from None
            raise Unavailable(f"Model `{slot.name}` did not load within load_timeout ({self.load_timeout:g} s).",
                              param="model", code="model_not_ready", headers={"Retry-After": "10"}) from None
        except BaseException:
            lease.release()
            raise
        return lease

    def _hold(self, slot: ModelSlot) -> Lease:
        slot.users += 1
        slot.last_used = time.monotonic()
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None
        return Lease(self, slot)

    def _release(self, slot: ModelSlot) -> None:
        slot.users -= 1
        slot.last_used = time.monotonic()
        if not slot.running:
            if not slot.users:
                self._idle(slot)
            self._changed()

    async def _ready(self, slot: ModelSlot) -> None:
        while True:
            state = slot.backend.state
            if state == "ready":
                if not slot.draining:
                    return
                slot.drain_waiters += 1  # once it has drained and unloaded, it loads again
                if not slot.running:
                    self._changed()
                try:
                    await self._change.wait()
                finally:
                    slot.drain_waiters -= 1
                continue
            if state == "failed" and time.monotonic() < slot.failed_until:
                raise self._failure(slot)
            if slot.unloading is not None:
                await asyncio.shield(slot.unloading)
                continue
            if slot.loading is None:
                slot.loading = self._task(self._load(slot, evict=True))
            await asyncio.shield(slot.loading)

    def _failure(self, slot: ModelSlot) -> Unavailable:
        retry = max(1, int(slot.failed_until - time.monotonic()) + 1)
        return Unavailable(f"Model `{slot.name}` failed: {slot.backend.error}.", param="model",
                           code="model_not_ready", headers={"Retry-After": str(retry)})

    # --- loading --------------------------------------------------------------------------

    async def _load(self, slot: ModelSlot, evict: bool) -> None:
        backend = slot.backend
        backend.state = "loading"
        try:
            await self._make_room(slot, evict)
            delay = self._backoff(slot)
            if delay:
                log.info("model %s: loading again in %.1f s (%d crash(es) in the last %.0f s)", slot.name, delay,
                         len(slot.crashes), CRASH_WINDOW)
                await asyncio.sleep(delay)
            log.info("model %s (%s) loading, about %s", slot.name, backend.config.backend, format_size(slot.expected))
            started = time.monotonic()
            await backend.start()
        except (NoRoom, asyncio.CancelledError):
            slot.reserved = False
            backend.state = "unloaded"
            raise
        except LoadError as exc:
            slot.reserved = False
            if exc.crashed and not self._crashed(slot, str(exc)):  # killed while loading: a crash
                raise Unavailable(f"Model `{slot.name}`: {exc}; try again.", param="model",
                                  code="model_unavailable", headers={"Retry-After": "1"}) from None
            if not exc.crashed:
                self._fail(slot, str(exc))
            raise self._failure(slot) from None
        except Exception as exc:  # noqa: BLE001 - the model's failure, shown to its requests
            slot.reserved = False
            self._fail(slot, f"{type(exc).__name__}: {exc}")
            raise self._failure(slot) from None
        finally:
            slot.loading = None
            self._changed()
        seconds = time.monotonic() - started
        engine = backend.engine
        slot.loaded_at = time.monotonic()
        if slot.restarting:
            slot.restarting = False
            self._count("worker_restarts", slot)
        self._count("model_loads", slot)
        if self.metrics is not None:
            self.metrics.load_seconds.observe((slot.name, backend.config.backend), seconds)
        self._measure(slot)
        pid = getattr(engine, "pid", None)
        log.info("model %s loaded in %.1f s%s, %s", slot.name, seconds, f" (worker pid {pid})" if pid else "",
                 format_size(slot.in_use))
        watcher = asyncio.create_task(self._watch(slot, engine))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        if slot.users == 0:
            self._idle(slot)
        await self._enforce_limit()

    def _backoff(self, slot: ModelSlot) -> float:
        crashes = slot.recent_crashes(time.monotonic())
        return min(0.5 * 2 ** (crashes - 1), 10.0) if crashes else 0.0

    async def _make_room(self, slot: ModelSlot, evict: bool) -> None:
        """Reserve ``slot``'s expected memory, unloading idle models (``evict``) or waiting
        for room, until ``load_timeout``; :class:`NoRoom` naming what is in the way."""
        need = slot.expected
        since = time.monotonic()
        deadline = since + self.load_timeout
        drained: ModelSlot | None = None
        try:
            while True:
                used = self.in_use(exclude=slot)
                if self.limit is None or used + need <= self.limit:
                    slot.reserved = True
                    return
                victim = self._victim(exclude=slot) if evict else None
                if victim is not None:
                    # The room its unload makes is this load's from now: another load (of the
                    # model unloading, say) must not take it while the worker exits.
                    slot.reserved = used - victim.in_use + need <= self.limit
                    await self._unload(victim, "room")
                    if slot.reserved and victim.reserved:
                        slot.reserved = False  # a request took it before its unload began
                    if slot.reserved:
                        return
                    continue
                now = time.monotonic()
                if deadline <= now or not evict:
                    if drained is not None:
                        drained.draining = False  # nobody needs its room now
                    raise NoRoom(self._in_the_way(slot, need))
                if drained is None and now - since >= DRAIN_AFTER:
                    drained = self._drain(slot, need)
                slot.needs_room = True
                wake = deadline if drained is not None else min(deadline, since + DRAIN_AFTER)
                try:
                    await asyncio.wait_for(self._change.wait(), max(wake - now, 0.01))
                except TimeoutError:
                    pass
        finally:
            slot.needs_room = False

    def _drain(self, slot: ModelSlot, need: int) -> ModelSlot | None:
        """Have the busy model loaded the longest take no new requests, so that it unloads
        once those it runs have ended and ``slot`` gets its turn: with every model busy, no
        model waits for its room forever (unless pinned ones hold it all)."""
        busy = [s for s in self.slots.values()
                if s is not slot and s.backend.state == "ready" and not s.backend.config.pin and s.reserved]
        if any(s.draining for s in busy):
            return None  # one at a time
        oldest = min(busy, key=lambda s: s.loaded_at, default=None)
        if oldest is not None:
            oldest.draining = True
            log.info("model %s draining: model %s has waited %.0f s for room (about %s)", oldest.name, slot.name,
                     DRAIN_AFTER, format_size(need))
        return oldest

    def _victim(self, exclude: ModelSlot | None = None) -> ModelSlot | None:
        """The idle, unpinned loaded model used longest ago."""
        idle = [s for s in self.slots.values()
                if s is not exclude and s.backend.state == "ready" and not s.running and not s.backend.config.pin
                and s.unloading is None and s.reserved]
        return min(idle, key=lambda s: s.last_used, default=None)

    def _in_the_way(self, slot: ModelSlot, need: int) -> str:
        held = []
        for s in self.slots.values():
            if s is slot or not s.in_use:
                continue
            why = ("pinned" if s.backend.config.pin else
                   f"{s.users} request(s)" if s.users else s.backend.state)
            held.append(f"`{s.name}` ({format_size(s.in_use)}, {why})")
        return (f"Model `{slot.name}` needs about {format_size(need)} and memory_limit ({format_size(self.limit or 0)}) "
                f"is taken by {', '.join(held) or 'nothing unloadable'}; try again when one of them is idle.")

    def in_use(self, exclude: ModelSlot | None = None) -> int:
        """The memory the models take, or will once loading (``exclude``'s not counted)."""
        return sum(s.in_use for s in self.slots.values() if s is not exclude)

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    # --- unloading ------------------------------------------------------------------------

    async def _unload(self, slot: ModelSlot, cause: str) -> None:
        if slot.unloading is None:
            if (cause == "idle" and slot.users) or (cause == "room" and slot.running) or slot.backend.state != "ready":
                return  # a request took it meanwhile
            # At once: a request arriving before the stop begins must wait for a new load.
            slot.backend.state = "unloading"
            slot.unloading = asyncio.create_task(self._stop(slot, cause))
        await asyncio.shield(slot.unloading)

    async def _stop(self, slot: ModelSlot, cause: str) -> None:
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None
        try:
            await slot.backend.stop()
        except Exception:  # noqa: BLE001 - it is gone either way
            log.exception("model %s did not stop cleanly", slot.name)
            slot.backend.detach()
        finally:
            slot.reserved = slot.draining = False
            slot.resident = 0
            slot.unloading = None
            self._changed()
        if cause:
            self._count("model_unloads", slot, cause)
            log.info("model %s unloaded (%s)", slot.name, cause)

    def _idle(self, slot: ModelSlot) -> None:
        keep_alive = slot.backend.config.keep_alive
        if keep_alive is None or slot.backend.state != "ready":
            return
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
        slot.idle_timer = asyncio.get_running_loop().call_later(keep_alive, self._expire, slot)

    def _expire(self, slot: ModelSlot) -> None:
        slot.idle_timer = None
        if slot.users == 0 and slot.backend.state == "ready":
            self._spawn(self._unload(slot, "idle"))

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    @staticmethod
    def _task(work: Any) -> asyncio.Task[Any]:
        """A load's task: its failure reaches the requests waiting, if any are left."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _enforce_limit(self) -> None:
        """Back under the limit (a model measured more than expected): idle models out."""
        while self.limit is not None and self.in_use() > self.limit:
            victim = self._victim()
            if victim is None:
                return
            await self._unload(victim, "room")

    # --- crashes --------------------------------------------------------------------------

    async def _watch(self, slot: ModelSlot, engine: Any) -> None:
        code = await engine.exited
        if engine.closing or slot.backend.__dict__.get("engine") is not engine:
            return  # unloaded as asked
        slot.reserved = slot.draining = False
        slot.resident = 0
        slot.backend.detach()
        self._count("model_unloads", slot, "crash")
        why = f"its worker (pid {engine.pid}) {describe_exit(code)}"
        if not self._crashed(slot, why):
            log.warning("model %s: %s; it loads again on the next request", slot.name, why)
        self._changed()

    def _crashed(self, slot: ModelSlot, why: str) -> bool:
        """Count a crash of ``slot``'s worker (``why``: how it ended); True if that makes the
        model failed (:data:`CRASH_LIMIT` within :data:`CRASH_WINDOW`), else it is unloaded and
        its next load waits a backoff."""
        now = time.monotonic()
        slot.crashes.append(now)
        slot.restarting = True
        if slot.recent_crashes(now) < CRASH_LIMIT:
            slot.backend.state = "unloaded"
            return False
        self._fail(slot, f"its worker crashed {len(slot.crashes)} times within {CRASH_WINDOW:.0f} s; the last time, {why}")
        return True

    def _fail(self, slot: ModelSlot, why: str) -> None:
        slot.backend.state = "failed"
        slot.backend.error = why
        slot.failed_until = time.monotonic() + FAILED_RETRY
        log.error("model %s failed: %s", slot.name, why)

    # --- memory ---------------------------------------------------------------------------

    def _measure(self, slot: ModelSlot) -> None:
        engine = slot.backend.__dict__.get("engine")
        pid = getattr(engine, "pid", None)
        if pid is None:  # in the router's process: only the estimate is known
            slot.resident = slot.expected
            return
        rss = resident_bytes(pid)
        if rss is None:
            return
        device = slot.backend.status().get("device_memory_bytes", 0) if slot.backend.state == "ready" else 0
        slot.resident = rss + int(device or 0)
        slot.measured = max(slot.measured or 0, slot.resident)

    async def _measure_forever(self) -> None:
        while True:
            await asyncio.sleep(MEASURE_INTERVAL)
            for slot in self.slots.values():
                if slot.backend.state in ("ready", "loading") and slot.reserved:
                    self._measure(slot)
            await self._enforce_limit()

    # --- admin ----------------------------------------------------------------------------

    async def load(self, backend: Backend) -> None:
        """``POST /models/load``: load it now (a failed model tries again at once)."""
        slot = self.slot_of(backend)
        if slot is None:
            backend.check_ready()
            return
        if slot.backend.state == "failed":
            slot.failed_until = 0.0
            slot.crashes.clear()
        (await self.lease(backend)).release()

    async def unload(self, backend: Backend) -> None:
        """``POST /models/unload``: 409 while requests hold it."""
        slot = self.slot_of(backend)
        if slot is None:
            raise APIError(f"Model `{backend.name}` is not a local model; there is nothing to unload.",
                           param="model")
        if slot.users:
            raise Busy(f"Model `{slot.name}` has {slot.users} request(s) running or waiting; unload it once they "
                       "end.", param="model", code="model_busy")
        if slot.loading is not None:
            raise Busy(f"Model `{slot.name}` is loading; unload it once it has loaded.", param="model",
                       code="model_busy")
        if slot.backend.state == "ready" or slot.unloading is not None:
            await self._unload(slot, "admin")

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Preload the models that ask for it, in order, each only if it fits beside those
        before it (the others load on their first request)."""
        self._measuring = asyncio.create_task(self._measure_forever())
        preload = [s for s in self.slots.values() if s.backend.config.preload]
        if preload:
            self._preloads.append(asyncio.create_task(self._preload(preload)))

    async def _preload(self, slots: list[ModelSlot]) -> None:
        started = []
        for slot in slots:
            if self.limit is not None and self.in_use() + slot.expected > self.limit:
                log.warning("model %s not preloaded: memory_limit (%s) is taken by the models before it; it loads "
                            "on its first request", slot.name, format_size(self.limit))
                continue
            slot.reserved = True  # held now: the next preload counts it
            slot.loading = self._task(self._load(slot, evict=False))
            started.append(slot.loading)
        await asyncio.gather(*started, return_exceptions=True)

    async def wait_ready(self) -> None:
        """Until the preloads have loaded (or failed)."""
        await asyncio.gather(*self._preloads, return_exceptions=True)

    @property
    def preloading(self) -> bool:
        return any(not t.done() for t in self._preloads)

    async def stop(self) -> None:
        for task in [*self._preloads, *(s.loading for s in self.slots.values() if s.loading is not None)]:
            task.cancel()
        if self._measuring is not None:
            self._measuring.cancel()
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*self._preloads, *self._watchers, return_exceptions=True)
        loaded = [s for s in self.slots.values() if s.backend.state == "ready" or s.unloading is not None]
        await asyncio.gather(*(self._unload(s, "") for s in loaded), return_exceptions=True)

    # --- what users see -------------------------------------------------------------------

    def status_of(self, backend: Backend) -> dict[str, Any]:
        """``/v1/models``' ``status`` (llama-server's router mode): ``loaded``, ``loading``,
        ``unloaded`` or ``failed`` with its ``reason``; a remote model is loaded while one of its
        deployments takes traffic."""
        slot = self.slot_of(backend)
        model = slot.backend if slot is not None else backend
        state = model.state
        if state == "ready":
            out: dict[str, Any] = {"value": "loaded"}
        elif state == "loading":
            out = {"value": "loading"}
        elif state == "failed" or (slot is None and model.error):  # a remote one: no deployment up
            out = {"value": "failed", "reason": model.error}
        else:
            out = {"value": "unloaded"}
        if slot is not None and slot.in_use:
            out["memory_bytes"] = slot.in_use
        return out

    def _count(self, metric: str, slot: ModelSlot, *extra: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, metric).inc((slot.name, slot.backend.config.backend, *extra))

    def gauge(self, name: str) -> list[tuple[tuple[str, ...], float]]:
        out = []
        for slot in self.slots.values():
            labels = (slot.name, slot.backend.config.backend)
            if name == "router:model_memory_bytes":
                out.append((labels, float(slot.in_use)))
            elif name == "router:model_loaded":
                out.append((labels, 1.0 if slot.backend.state == "ready" else 0.0))
        return out
