"""What a local model takes in memory: estimated before it loads, measured once it has.

The fleet (:mod:`router.fleet`) budgets ``[server] memory_limit`` with these figures: a model's
estimate (its weights' files, its KV cache, a worker's own cost) until it has loaded once, then
the most resident memory its worker process was seen to take.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .units import format_size

WORKER_BASE = 160 << 20
"""A worker process before its engine: the interpreter, msgspec, the router's own modules and
numpy (measured at about 60 MiB; an engine's own packages come on top, in ``runtime``)."""

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


@dataclass(frozen=True, slots=True)
class Footprint:
    """A model's memory, by where it goes."""

    weights: int = 0
    cache: int = 0
    """The KV cache (and other per-sequence memory) the engine allocates."""
    runtime: int = WORKER_BASE
    """The process itself: the interpreter and the engine's libraries (torch, llama.cpp)."""

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.runtime

    def describe(self) -> str:
        return (f"{format_size(self.total)} (weights {format_size(self.weights)}, cache {format_size(self.cache)}, "
                f"process {format_size(self.runtime)})")


def file_bytes(path: Path) -> int:
    """The size of a weights file, or of a model folder's weight files (0 if none is there)."""
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    except OSError:
        pass
    return 0


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (RSS) now; None once it is gone."""
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
