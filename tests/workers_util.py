"""Looking at a running router's worker processes from a test: which exist, what they take."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

PLUGIN_PKG = Path(__file__).parent / "plugin_pkg"


def workers(router_pid: int) -> dict[str, psutil.Process]:
    """The router's worker processes by the model their command line names."""
    out = {}
    for child in psutil.Process(router_pid).children():
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "router.workers" in cmd and "--model" in cmd:
            out[cmd[cmd.index("--model") + 1]] = child
    return out


def resident(processes) -> int:
    total = 0
    for p in processes:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def statuses(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return {m["id"]: m["status"] for m in json.load(r)["data"]}


def metric(url: str, name: str, **labels: str) -> float:
    """One series' value from /metrics (0 when it has none yet)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    assert want is not None
    return 0.0


def wait_for(predicate, timeout: float = 30, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not hold within {timeout} s")


class Sampler:
    """Samples the router's workers every ``every`` seconds in a thread: the most that ran at
    once, and the most resident memory they took together."""

    def __init__(self, router_pid: int, every: float = 0.05) -> None:
        self.router_pid = router_pid
        self.every = every
        self.most_workers = 0
        self.most_memory = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            found = workers(self.router_pid)
            self.most_workers = max(self.most_workers, len(found))
            self.most_memory = max(self.most_memory, resident(found.values()))
            time.sleep(self.every)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def plugin_site(tmp: Path) -> Path:
    """The example third-party plugin package (tests/plugin_pkg) installed into a folder of
    its own: put it on PYTHONPATH and its ``echo`` backend is there."""
    src = tmp / "src"
    shutil.copytree(PLUGIN_PKG, src)
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(src)],
        check=True,
    )
    return site
