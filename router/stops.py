"""Stop strings: end a sequence at the first stop string and never leak any of it.

A stop string can span two tokens or two deltas, so text that could still turn out to be the
beginning of a stop string is held back until the next delta decides it.
"""

from __future__ import annotations

from typing import Sequence


class StopChecker:
    """Tracks one sequence's text; releases what is safe to send and spots stop strings."""

    __slots__ = ("_stops", "_include", "_longest", "text", "_released", "stopped_by")

    def __init__(self, stops: Sequence[str] = (), include_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_in_output
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""
        """All text of the sequence so far, cut at the stop string once one is found."""
        self._released = 0
        self.stopped_by: str | None = None

    @property
    def watching(self) -> bool:
        """Whether there are stop strings to look for."""
        return bool(self._stops)

    def push(self, delta: str) -> str:
        """Add decoded text; return what may be sent now. Sets :attr:`stopped_by` on a match."""
        if self.stopped_by is not None or not delta:
            return ""
        if not self._stops:
            self.text += delta
            self._released = len(self.text)
            return delta
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += delta
        hit = self._earliest(search_from)
        if hit is not None:
            at, stop = hit
            self.stopped_by = stop
            self.text = self.text[: at + len(stop) if self._include else at]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_suffix())

    def flush(self) -> str:
        """The sequence ended without a stop string: release what was held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self.text[self._released : upto]
        self._released = upto
        return out

    def _earliest(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or (at, len(stop)) < (best[0], len(best[1]))):
                best = (at, stop)
        return best

    def _partial_suffix(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        if self._include:
            # The stop string is sent anyway; nothing after it will be, so no need to wait.
            return 0
        text = self.text
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
