"""``router`` as usual, plus one thing: on SIGUSR1 it writes its own peak memory to a file.

Peak RSS can be read from outside (``/proc/<pid>/status``), but the peak GPU memory the torch
caching allocator handed out is only known inside the process. The benchmark therefore starts the
router through this wrapper (same CLI, same arguments) and sends SIGUSR1 just before stopping it.
The handler runs on the main thread between event-loop callbacks; it only reads counters.
"""

from __future__ import annotations

import json
import os
import signal
import sys

PROBE_FILE_ENV = "BENCH_PROBE_FILE"


def vm_hwm_bytes(pid: int | str = "self") -> int | None:
    """Peak resident set size (VmHWM) of a process, from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cuda_peaks() -> dict[str, int] | None:
    """Peak allocated and reserved bytes over all CUDA devices, if this process uses CUDA.

    Never initializes CUDA itself: a process that did not touch the GPU reports nothing."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    devices = range(torch.cuda.device_count())
    return {
        "max_allocated_bytes": sum(torch.cuda.max_memory_allocated(d) for d in devices),
        "max_reserved_bytes": sum(torch.cuda.max_memory_reserved(d) for d in devices),
    }


def _dump(signum, frame) -> None:  # type: ignore[no-untyped-def]
    path = os.environ.get(PROBE_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"peak_rss_bytes": vm_hwm_bytes(), "cuda": cuda_peaks()}, f)
    os.replace(tmp, path)  # the reader polls for the file; it must never see half of it


def main() -> int:
    signal.signal(signal.SIGUSR1, _dump)
    from router.cli import main as router_main

    return router_main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
