"""Quantities router.toml writes as people do: sizes (``"12GiB"``, ``"800MB"``) and durations
(``"5m"``, ``"30s"``), or plain numbers (bytes, seconds)."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SIZE = re.compile(rf"^\s*{_NUMBER}\s*([a-z]*)\s*$", re.IGNORECASE)
_DURATION_PART = re.compile(rf"{_NUMBER}\s*(ms|s|m|h|d)", re.IGNORECASE)


def parse_size(value: int | float | str) -> int:
    """Bytes from ``12GiB``, ``800MB``, ``1.5G`` (binary, as Docker's), ``1024`` or a number.
    KB, MB, GB, TB are powers of ten; KiB, MiB, GiB, TiB and K, M, G, T powers of two."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 12GiB or 800MB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return int(value)
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"`{value}` is not a size; write a number of bytes or one with a unit: "
                         "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_duration(value: int | float | str) -> float | None:
    """Seconds from ``"5m"``, ``"30s"``, ``"1h30m"``, ``"250ms"`` or a number of seconds; a
    negative value (Ollama's ``-1``) means forever: None."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 5m or 30s, got {value!r}")
    if isinstance(value, (int, float)):
        return None if value < 0 else float(value)
    text = value.strip()
    if re.fullmatch(r"-\d+(\.\d*)?\s*[a-z]*", text, re.IGNORECASE):
        return None
    parts = _DURATION_PART.findall(text)
    if not parts or _DURATION_PART.sub("", text).strip():
        if re.fullmatch(_NUMBER, text):
            return float(text)
        raise ValueError(f"`{value}` is not a duration; write seconds or a number with a unit: "
                         "ms, s, m, h, d (\"30s\", \"5m\", \"1h30m\"); -1 means never")
    return sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in parts)


def format_size(n: float) -> str:
    """``1.2 GiB``, ``812 MiB``: for messages and logs."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"
