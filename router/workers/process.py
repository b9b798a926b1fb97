"""A worker process: ``python -m router.workers --model NAME --fd N``.

The router starts one per loaded local model, with one end of a socket pair as ``--fd``; the
model's name on the command line shows in ``ps`` which process serves what. It loads the engine
its :class:`~router.workers.wire.Load` names, answers :class:`~router.workers.wire.Ready`, and
serves until :class:`~router.workers.wire.Stop` or until the router's end of the socket closes
(the router is gone: nobody is left to serve).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec

from .wire import FrameProtocol, Load, LoadFailed, Ready, ToWorker

log = logging.getLogger("router.worker")


def backend_class(path: str) -> type:
    """The class ``module:Qualified.Name`` names."""
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Worker:
    """One model's engine, served over the socket to the router."""

    def __init__(self, model: str, sock: socket.socket) -> None:
        self.model = model
        self.sock = sock
        self.host: Any = None
        self.loaded: asyncio.Future[Load] = asyncio.get_running_loop().create_future()
        self.gone = asyncio.Event()
        self.protocol = FrameProtocol(ToWorker, self._receive, self.gone.set)

    def _receive(self, message: Any) -> None:
        if self.host is not None:
            self.host.receive(message)
        elif isinstance(message, Load) and not self.loaded.done():
            self.loaded.set_result(message)

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self.protocol, sock=self.sock)
        waiting = asyncio.ensure_future(self.gone.wait())
        await asyncio.wait([self.loaded, waiting], return_when=asyncio.FIRST_COMPLETED)
        if not self.loaded.done():
            return 0  # the router left before saying what to load
        load = self.loaded.result()
        _configure_logging(load.log_level, self.model)
        try:
            engine = await self._load(load)
        except Exception as exc:  # noqa: BLE001 - reported to the router, which shows it
            log.error("model %s failed to load: %s: %s", self.model, type(exc).__name__, exc)
            self.protocol.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
            return 1
        from ..gctune import tune_for_serving
        from .host import EngineHost

        self.host = EngineHost(engine, self.protocol.send)
        tokenizer = pickle.dumps(engine.tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self.protocol.send(Ready(tokenizer, engine.chat_template, engine.max_model_len, sorted(engine.capabilities)))
        tune_for_serving()
        stopping = asyncio.ensure_future(self.host.stopped.wait())
        await asyncio.wait([stopping, waiting], return_when=asyncio.FIRST_COMPLETED)
        await self.host.close()
        await engine.stop()
        return 0

    async def _load(self, load: Load) -> Any:
        cls = backend_class(load.backend)
        config = msgspec.convert(load.config, type=cls.Config)
        backend = cls(config, Path(load.base_dir))
        engine = await asyncio.to_thread(backend.create_engine)
        await engine.start()
        return engine


def _configure_logging(level: str, model: str) -> None:
    from ..telemetry import configure_logging

    configure_logging(level, f"worker {model}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router.workers", description="a router's worker process for one model")
    parser.add_argument("--model", required=True, help="the model it serves (for ps; the router says what to load)")
    parser.add_argument("--fd", type=int, required=True, help="its end of the socket pair to the router")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        run = asyncio.run

    async def serve() -> int:
        return await Worker(args.model, sock).serve()

    code = run(serve())
    sys.stdout.flush()
    sys.stderr.flush()
    # Engine threads (torch's, llama.cpp's) are daemons: no need to wait for the interpreter's
    # teardown of every module to hand the memory back.
    os._exit(code)


if __name__ == "__main__":
    main()
