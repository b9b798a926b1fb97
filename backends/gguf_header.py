"""A GGUF file's metadata values, read from its header alone.

The ``gguf`` package's reader maps the whole file and parses every tensor's entry first (seconds
for a large file, with its import); the fleet's estimates and the config checker need a handful
of numbers at once (``llama.block_count``, ``llama.attention.head_count_kv``, ...).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterable

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return struct.unpack(fmt, data)[0]


MAX_STRING = 1 << 24  # a longer string is no GGUF header's: a corrupt file


def _string(f: BinaryIO) -> bytes:
    size = _read(f, "<Q")
    if size > MAX_STRING:
        raise ValueError(f"a GGUF string of {size} bytes: not a GGUF header")
    data = f.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return data


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        data = _string(f)
        return data.decode("utf-8", "replace") if keep else None
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if count > MAX_STRING:
            raise ValueError(f"a GGUF array of {count} items: not a GGUF header")
        if keep:
            return [_value(f, item, True) for _ in range(count)]
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)  # a vocabulary's scores: skipped whole
        else:
            for _ in range(count):
                _value(f, item, False)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def read_metadata(path: Path, wanted: Iterable[str]) -> dict[str, Any]:
    """The values of the ``wanted`` keys that the file's header has (a ``{arch}.`` prefix is
    spelled out by the caller; ``general.architecture`` first tells which)."""
    wanted = set(wanted)
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        _read(f, "<Q")  # tensors
        for _ in range(_read(f, "<Q")):
            key = _string(f).decode("utf-8", "replace")
            keep = key in wanted
            value = _value(f, _read(f, "<I"), keep)
            if keep:
                out[key] = value
                if len(out) == len(wanted):
                    break
    return out


def architecture_numbers(path: Path, names: Iterable[str]) -> dict[str, Any]:
    """``general.architecture`` and the architecture's own ``names`` (``block_count``, ...)."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if arch is None:
        return {}
    found = read_metadata(path, [f"{arch}.{n}" for n in names])
    return {"architecture": arch, **{k.removeprefix(f"{arch}."): v for k, v in found.items()}}


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the entries after the metadata."""
    out: dict[str, tuple[int, ...]] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _read(f, "<I")
        tensors, values = _read(f, "<Q"), _read(f, "<Q")
        for _ in range(values):
            _string(f)
            _value(f, _read(f, "<I"), False)
        for _ in range(tensors):
            name = _string(f).decode("utf-8", "replace")
            rank = _read(f, "<I")
            if rank > 8:
                raise ValueError(f"a tensor of {rank} dimensions: not a GGUF file")
            dims = tuple(_read(f, "<Q") for _ in range(rank))
            _read(f, "<I")  # its type
            _read(f, "<Q")  # its offset
            out[name] = dims
    return out
