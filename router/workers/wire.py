"""What the router and a worker process say to each other, and how it is framed.

Messages are msgspec Structs, encoded as MessagePack, each frame a 4-byte big-endian length and
the message. The router speaks first (:class:`Load`); the worker answers :class:`Ready` or
:class:`LoadFailed`, then serves :class:`Generate`, :class:`Abort`, :class:`Call` and
:class:`Stop`. Whatever a step of the engine produced for all of the worker's requests travels
back in one :class:`Steps` frame, never a frame per token per request.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Callable, Union

import msgspec

from ..constraints import ConstraintPlan
from ..engine import EngineRequest, EngineStep

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


class Load(msgspec.Struct, tag=True, array_like=True):
    """Router -> worker, first: which backend class, with which ``[[models]]`` entry."""

    backend: str  # "module:QualifiedName" of the LocalBackend subclass
    config: dict[str, Any]  # the entry, as router.toml gave it (converted again there)
    base_dir: str
    log_level: str = "info"


class Generate(msgspec.Struct, tag=True, array_like=True):
    rid: int
    request: EngineRequest  # its ``constraint`` travels apart, as a plan
    constraint: ConstraintPlan | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    rid: int


class Call(msgspec.Struct, tag=True, array_like=True):
    """A command answered by one :class:`Reply`: ``check_constraint`` (compile a grammar, or
    say why it does not), ``add_adapter``, ``remove_adapter``, ``embed`` (token id lists in,
    one float32 vector each out)."""

    cid: int
    method: str
    args: list[Any]


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Finish: stop the engine and exit."""


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Worker -> router: the engine is loaded. The tokenizer is pickled: the router tokenizes and
    detokenizes in its own process with the engine's own vocabulary."""

    tokenizer: bytes
    chat_template: str | None
    max_model_len: int
    capabilities: list[str]


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    error: str


class Failure(msgspec.Struct, array_like=True):
    """A request that ended in an error: ``kind`` says which (:data:`ERROR_KINDS`)."""

    rid: int
    kind: str
    message: str
    param: str | None = None


class Steps(msgspec.Struct, tag=True, array_like=True):
    """Everything since the last frame: each request's steps in order, failures, and the
    engine's stats when they changed."""

    steps: list[tuple[int, EngineStep]]
    failures: list[Failure] = []
    stats: dict[str, Any] | None = None


class Reply(msgspec.Struct, tag=True, array_like=True):
    cid: int
    error: Failure | None = None
    result: Any = None


ToWorker = Union[Load, Generate, Abort, Call, Stop]
ToRouter = Union[Ready, LoadFailed, Steps, Reply]


class FrameProtocol(asyncio.Protocol):
    """Length-prefixed MessagePack frames over a stream socket: ``on_message`` for each one
    received, :meth:`send` to write one (buffered by the transport, never awaited)."""

    def __init__(self, receives: Any, on_message: Callable[[Any], None], on_lost: Callable[[], None]) -> None:
        self._decoder = msgspec.msgpack.Decoder(receives)
        self._on_message = on_message
        self._on_lost = on_lost
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        at = 0
        end = len(buf)
        while end - at >= 4:
            (size,) = _HEADER.unpack_from(buf, at)
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes")
            if end - at - 4 < size:
                break
            message = self._decoder.decode(memoryview(buf)[at + 4 : at + 4 + size])
            at += 4 + size
            self._on_message(message)
        del buf[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._on_lost()

    def send(self, message: Any) -> bool:
        """Queue ``message``; False once the connection is gone."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        payload = _encoder.encode(message)
        transport.write(_HEADER.pack(len(payload)) + payload)
        return True


_encoder = msgspec.msgpack.Encoder()
