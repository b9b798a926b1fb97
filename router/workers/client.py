"""The router's side of the boundary: a model's engine as the serving pipeline sees it.

:class:`WorkerEngine` is an :class:`~router.engine.Engine` whose engine runs in a worker process
(:mod:`router.workers.process`); :class:`InlineEngine` one whose engine runs here (``worker =
false``). Both take a request's constraint as a :class:`~router.constraints.ConstraintPlan` and
have the engine's side build its matcher, so the pipeline is the same either way.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from ..constraints import ConstraintPlan, ConstraintSpec, GrammarCompiler
from ..engine import Engine, EngineError, EngineRequest, EngineStep, StepQueue, Tokenizer, UnknownAdapter
from ..errors import BadRequest
from .wire import Abort, Call, Failure, FrameProtocol, Generate, Load, LoadFailed, Ready, Reply, Steps, Stop, ToRouter

if TYPE_CHECKING:
    from ..backend import LocalBackend

log = logging.getLogger("router.workers")

STOP_TIMEOUT = 10.0
"""Seconds a worker gets to stop its engine and exit before it is killed."""


class WorkerLost(EngineError):
    """The model's worker process ended under the request (a crash, a kill, out of memory):
    a 503 before a response's first byte, an error event after it."""


class LoadError(Exception):
    """The engine did not load; the message says why (the worker's own exception). ``crashed``:
    the worker process ended while loading (a crash, not the engine's refusal)."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed


def error_of(failure: Failure) -> Exception:
    """The exception a :class:`~router.workers.wire.Failure` stands for."""
    if failure.kind == "unknown_adapter":
        return UnknownAdapter(failure.message)
    if failure.kind == "bad_request":
        return BadRequest(failure.message, param=failure.param)
    if failure.kind == "value":
        return ValueError(failure.message)
    return EngineError(failure.message)


def describe_exit(code: int | None) -> str:
    """How a process ended, to follow its name: ``was killed by SIGKILL``."""
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


_TOKENIZERS: dict[str, tuple[bytes, Tokenizer]] = {}
"""Each model's tokenizer from its last load, by the digest of its pickle: a reload of the same
model keeps the tokenizer (and what it cached) it had."""


def _tokenizer(model: str, data: bytes) -> Tokenizer:
    digest = hashlib.blake2b(data, digest_size=16).digest()
    known = _TOKENIZERS.get(model)
    if known is not None and known[0] == digest:
        return known[1]
    tok = pickle.loads(data)
    _TOKENIZERS[model] = (digest, tok)
    return tok


def _backend_path(backend: "LocalBackend") -> str:
    cls = type(backend)
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise LoadError(f"backend class {cls.__qualname__} of module {cls.__module__} cannot be imported by a "
                        "worker process (it is not defined at the top of a module); set worker = false")
    return f"{cls.__module__}:{cls.__qualname__}"


class WorkerEngine:
    """A model's engine in a worker process of its own. ``exited`` resolves with the process's
    exit status (negative: the signal that ended it) however it ends; ``closing`` says whether
    the router asked it to."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Ready | LoadFailed] = self._loop.create_future()
        self.exited: asyncio.Future[int | None] = self._loop.create_future()
        self.closing = False
        self.pid: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._protocol = FrameProtocol(ToRouter, self._receive, self._lost)
        self._requests: dict[int, StepQueue] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._stats: dict[str, Any] = {"running": 0, "waiting": 0}
        self._death: str | None = None  # why requests can no longer run
        # Engine's attributes, from Ready.
        self.tokenizer: Tokenizer
        self.chat_template: str | None = None
        self.max_model_len = 0
        self.capabilities: frozenset[str] = frozenset()

    @classmethod
    async def spawn(cls, backend: "LocalBackend") -> "WorkerEngine":
        """Start the worker, have it load ``backend``'s engine, and wait until it is ready;
        :class:`LoadError` with the engine's own message if it does not load. It logs at the
        router's level, on the router's stderr."""
        self = cls(backend.name)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        load = Load(_backend_path(backend), msgspec.to_builtins(backend.config), str(backend.base_dir), level)
        ours, theirs = socket.socketpair()
        try:
            # The same import path as ours: a backend class the router found, the worker finds.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.workers", "--model", backend.name, "--fd", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                # Its own session: a terminal's Ctrl-C reaches the router, which stops its workers.
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.pid = self._proc.pid
        self._loop.create_task(self._reap())
        try:
            await self._loop.create_connection(lambda: self._protocol, sock=ours)
            self._protocol.send(load)
            answer = await self._ready
        except BaseException:
            self.kill()
            raise
        if isinstance(answer, LoadFailed):
            await self.exited
            raise LoadError(answer.error)
        try:
            # Off the event loop: a vocabulary can take a second to read (llama.cpp's, piece by piece).
            self.tokenizer = await asyncio.to_thread(_tokenizer, backend.name, answer.tokenizer)
        except BaseException as exc:
            await self.close()
            if isinstance(exc, Exception):
                raise LoadError(f"its engine's tokenizer does not unpickle in the router: {type(exc).__name__}: "
                                f"{exc}") from None
            raise
        self.chat_template = answer.chat_template
        self.max_model_len = answer.max_model_len
        self.capabilities = frozenset(answer.capabilities)
        return self

    # --- process ------------------------------------------------------------------------

    async def _reap(self) -> None:
        assert self._proc is not None
        code = await self._proc.wait()
        self._die(describe_exit(code))
        if not self.exited.done():
            self.exited.set_result(code)

    def _lost(self) -> None:
        # The socket closed: the process is ending, and _reap says how in a moment. One that
        # lingers on without its connection serves nobody: it is killed (then reaped as a crash).
        self._loop.call_later(2.0, self.kill)

    def _die(self, how: str) -> None:
        """The process ended (``how``: :func:`describe_exit`'s words): fail the load, or every
        request and command in flight, whose engine is gone."""
        if not self._ready.done():
            self._ready.set_exception(LoadError(f"its worker process {how} while loading", crashed=True))
        if self._death is None:
            self._death = (f"model `{self.model}` was unloaded" if self.closing
                           else f"the worker process of model `{self.model}` {how}")
        requests, self._requests = self._requests, {}
        for steps in requests.values():
            steps.put(WorkerLost(self._death))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(WorkerLost(self._death))

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def close(self) -> None:
        """Unload: the engine stops and the process exits (killed if it takes too long)."""
        self.closing = True
        self._protocol.send(Stop())
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), STOP_TIMEOUT)
        except TimeoutError:
            log.warning("model %s: its worker (pid %s) did not exit in %.0f s; killed", self.model, self.pid,
                        STOP_TIMEOUT)
            self.kill()
            await self.exited
        if self._protocol.transport is not None:
            self._protocol.transport.close()

    # --- messages ---------------------------------------------------------------------------

    def _receive(self, message: Any) -> None:
        if isinstance(message, Steps):
            requests = self._requests
            for rid, step in message.steps:
                steps = requests.get(rid)
                if steps is not None:
                    steps.put(step)
            for failure in message.failures:
                steps = requests.get(failure.rid)
                if steps is not None:
                    steps.put(error_of(failure))
            if message.stats is not None:
                self._stats = message.stats
        elif isinstance(message, Reply):
            future = self._calls.pop(message.cid, None)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.result)
                else:
                    future.set_exception(error_of(message.error))
        elif isinstance(message, (Ready, LoadFailed)) and not self._ready.done():
            self._ready.set_result(message)

    async def _call(self, method: str, *args: Any) -> Any:
        if self._death is not None:
            raise WorkerLost(self._death)
        cid = next(self._ids)
        future = self._calls[cid] = self._loop.create_future()
        self._protocol.send(Call(cid, method, list(args)))
        try:
            return await future
        finally:
            self._calls.pop(cid, None)

    # --- the Engine protocol ----------------------------------------------------------------

    async def start(self) -> None:
        """Started by :meth:`spawn`."""

    async def stop(self) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        """The engine's stats as the worker last sent them (at most half a second old)."""
        return dict(self._stats)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        if self._death is not None:
            raise WorkerLost(self._death)
        plan = request.constraint
        if plan is not None:
            if not isinstance(plan, ConstraintPlan):
                raise EngineError("a constraint reaches a worker as a ConstraintPlan")
            request = replace(request, constraint=None)
        rid = next(self._ids)
        steps = self._requests[rid] = StepQueue()
        self._protocol.send(Generate(rid, request, plan))
        try:
            async for step in steps:
                yield step
        finally:
            if self._requests.pop(rid, None) is not None and not steps.finished:
                self._protocol.send(Abort(rid))  # client gone or a stop string: free it there now

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        """Compile ``spec``'s grammar where the engine runs (cached there): a 400 naming its
        field if it does not compile."""
        await self._call("check_constraint", spec)

    async def add_adapter(self, name: str, path: Path) -> None:
        await self._call("add_adapter", name, str(path))

    async def remove_adapter(self, name: str) -> None:
        await self._call("remove_adapter", name)

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[bytes]:
        """An embedding model's vectors for ``inputs`` (float32 little-endian, one per input),
        cut to ``dimensions`` where the model allows it."""
        return await self._call("embed", inputs, dimensions)


class InlineEngine:
    """A model's engine in the router's own process (``worker = false``)."""

    pid: int | None = None
    closing = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = engine.chat_template
        self.max_model_len = engine.max_model_len
        self.capabilities = frozenset(engine.capabilities)
        self._grammars = GrammarCompiler(engine.tokenizer)
        self.exited: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

    @classmethod
    async def start_for(cls, backend: "LocalBackend") -> "InlineEngine":
        engine = await asyncio.to_thread(backend.create_engine)
        await engine.start()
        return cls(engine)

    async def start(self) -> None:
        """Started by :meth:`start_for`."""

    async def stop(self) -> None:
        await self.close()

    async def close(self) -> None:
        self.closing = True
        try:
            await self.engine.stop()
        finally:
            if not self.exited.done():
                self.exited.set_result(0)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        plan = request.constraint
        if isinstance(plan, ConstraintPlan):
            request = replace(request, constraint=plan.build(self._grammars))
        return self.engine.generate(request)

    async def check_constraint(self, spec: ConstraintSpec) -> None:
        await asyncio.to_thread(self._grammars.constraint, spec)

    async def add_adapter(self, name: str, path: Path) -> None:
        await self.engine.add_adapter(name, path)  # type: ignore[attr-defined]

    async def remove_adapter(self, name: str) -> None:
        await self.engine.remove_adapter(name)  # type: ignore[attr-defined]

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[bytes]:
        return await self.engine.embed(inputs, dimensions)  # type: ignore[attr-defined]


async def launch(backend: "LocalBackend") -> WorkerEngine | InlineEngine:
    """``backend``'s engine, loaded where its config says: a worker process, or here."""
    if backend.config.worker:
        return await WorkerEngine.spawn(backend)
    return await InlineEngine.start_for(backend)
