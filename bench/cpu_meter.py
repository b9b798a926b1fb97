"""How busy the machine was during a measurement, and how much of that was not us.

A shared machine makes every number here noisy. Rather than guess afterwards, each level records
the cores busy on the whole machine (``/proc/stat``) and the cores used by the processes being
measured (``/proc/<pid>/stat``); the difference is load from somebody else, shown next to the
numbers it disturbed. Linux only; elsewhere it reports nothing.
"""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies over all cores; iowait counts as idle."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    total = sum(fields[:8])  # user..steal; guest time is already inside user
    return total - fields[3] - fields[4], total


def _process_ticks(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


class CpuMeter:
    """Start, run the measurement, :meth:`stop`: busy cores on the machine, in ``pids``, and
    elsewhere, averaged over the interval."""

    def __init__(self, pids: list[int | str]) -> None:
        self.pids = pids
        self._t = time.perf_counter()
        self._machine = _machine_ticks()
        self._own = sum(_process_ticks(p) for p in pids)

    def stop(self) -> dict | None:
        machine = _machine_ticks()
        if machine is None or self._machine is None:
            return None
        elapsed = time.perf_counter() - self._t
        busy, total = machine[0] - self._machine[0], machine[1] - self._machine[1]
        cores = (os.cpu_count() or 1) * (busy / total if total else 0.0)
        own = (sum(_process_ticks(p) for p in self.pids) - self._own) / _TICK / elapsed if elapsed else 0.0
        return {"machine_busy_cores": cores, "own_cores": own, "other_cores": max(cores - own, 0.0)}
