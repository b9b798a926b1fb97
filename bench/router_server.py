"""One router process serving one model, started as tests/server.py's ``RouterProcess`` does.

Each backend gets its own process so its peak RSS is its own; the caller stops one before
starting the next so they never compete for the cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from router_probe import PROBE_FILE_ENV, vm_hwm_bytes

PROBE = Path(__file__).with_name("router_probe.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models(exc: urllib.error.HTTPError) -> dict:
    """The per-model states of a 503 /health body (empty when it is not that body)."""
    try:
        return json.load(exc).get("models") or {}
    except (ValueError, AttributeError):
        return {}


class RouterServer:
    """``router serve --config FILE --port P`` (through :mod:`router_probe`), ready once
    ``GET /health`` answers 200."""

    def __init__(self, name: str, config_text: str, workdir: Path, *, ready_timeout_s: float = 900) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / f"{name}.toml"
        self.config.write_text(config_text)
        self.log = workdir / f"{name}.log"
        self.probe_file = workdir / f"{name}.probe.json"
        self.probe_file.unlink(missing_ok=True)
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(PROBE), "serve", "--config", str(self.config),
             "--port", str(self.port), "--log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PROBE_FILE_ENV: str(self.probe_file)},
        )
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(f"router `{self.name}` {why}; its log ({self.log}):\n{self.log.read_text()[-4000:]}")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                # 503 while the model loads; a model that failed to load stays failed, and the
                # router keeps running, so the reason is read from the body instead of waiting.
                failed = {name: m.get("error") for name, m in _models(exc).items() if m.get("state") == "failed"}
                if failed:
                    raise self._fail(f"could not load its model: {failed}") from None
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        raise self._fail(f"was not ready after {timeout_s:.0f} s")

    def peak_memory(self) -> dict:
        """Peak RSS from /proc, and the process's own report (CUDA peaks) via SIGUSR1."""
        report: dict = {"peak_rss_bytes": vm_hwm_bytes(self.proc.pid), "cuda": None}
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self.probe_file.exists():
            time.sleep(0.05)
        if self.probe_file.exists():
            report["cuda"] = json.loads(self.probe_file.read_text()).get("cuda")
        return report

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
