"""What one app serves: config, plugins, request types, models, keys, queues and metrics."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Iterable

from .admission import AdmissionQueue
from .auth import Keyring
from .backend import AdapterModel, Backend
from .config import RouterConfig
from .errors import ModelNotFound
from .metrics import RouterMetrics
from .plugins import Plugins
from .requests import RequestTypes, compose

log = logging.getLogger("router.state")


class RouterState:
    """Everything one app serves. Models load in the background; /health tells when."""

    def __init__(self, config: RouterConfig, plugins: Plugins) -> None:
        self.config = config
        self.plugins = plugins
        self.types: RequestTypes = compose(plugins.request_fields())
        self.models: dict[str, Backend] = {
            m.name: plugins.backends[m.backend](m, config.base_dir) for m in config.models
        }
        self.queues = {
            m.name: AdmissionQueue(m.name, m.max_concurrency, m.max_queue) for m in config.models
        }
        # LoRA adapters: models of their own names on their parent's engine and queue.
        self.adapters: dict[str, Backend] = {}
        for backend in list(self.models.values()):
            for name in backend.config.adapter_names():
                self.adapters[name] = AdapterModel(backend, name)
                self.queues[name] = self.queues[backend.name]
        self.keyring = Keyring(config)
        self.metrics = RouterMetrics(self.gauges)
        self.created = int(time.time())
        self.openapi: bytes | None = None  # built on first request
        self._loading: list[asyncio.Task[None]] = []

    def model(self, name: str, allowed: frozenset[str] | None = None) -> Backend:
        """The model called ``name``, if it exists and the caller's key may use it (else 404)."""
        backend = self.models.get(name) or self.adapters.get(name)
        if backend is None or (allowed is not None and name not in allowed):
            raise ModelNotFound(name)
        return backend

    def visible(self, allowed: frozenset[str] | None) -> list[Backend]:
        """The models this caller may use, each base model followed by its adapters."""
        every = [b for base in self.models.values() for b in (base, *self._adapters_of(base))]
        return [b for b in every if allowed is None or b.name in allowed]

    def _adapters_of(self, base: Backend) -> list[Backend]:
        return [self.adapters[name] for name in base.config.adapter_names()]

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start loading every model in the background, with a progress bar on stderr."""
        from tqdm import tqdm

        bar = tqdm(total=len(self.models), desc="loading models", unit="model", file=sys.stderr,
                   disable=not self.models, leave=True)
        for backend in self.models.values():
            self._loading.append(asyncio.create_task(self._start(backend, bar)))

    async def _start(self, backend: Backend, bar: object) -> None:
        t0 = time.monotonic()
        try:
            await backend.start()
        except Exception as exc:  # noqa: BLE001 - one broken model must not stop the others
            backend.state = "failed"
            backend.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to load: %s", backend.name, backend.error)
        else:
            log.info("model %s (%s) ready in %.1fs", backend.name, backend.config.backend, time.monotonic() - t0)
        finally:
            bar.update(1)  # type: ignore[attr-defined]

    async def wait_ready(self) -> None:
        await asyncio.gather(*self._loading, return_exceptions=True)

    async def stop(self) -> None:
        for task in self._loading:
            task.cancel()
        await asyncio.gather(*self._loading, return_exceptions=True)
        for backend in self.models.values():
            try:
                await backend.stop()
            except Exception:  # noqa: BLE001
                log.exception("model %s did not stop cleanly", backend.name)

    # --- gauges read at scrape time -------------------------------------------------------

    def gauges(self, name: str) -> Iterable[tuple[tuple[str, ...], float]]:
        for backend in self.models.values():
            labels = (backend.name, backend.config.backend)
            stats = backend.status()
            queue = self.queues[backend.name]
            if name == "router:num_requests_running":
                yield labels, stats.get("running", queue.running)
            elif name == "router:num_requests_waiting":
                yield labels, stats.get("waiting", 0) + queue.waiting
            elif name == "router:kv_cache_usage_perc" and "kv_blocks_total" in stats:
                yield labels, stats["kv_blocks_used"] / max(stats["kv_blocks_total"], 1)
            elif name == "router:num_preemptions_total" and "preemptions" in stats:
                yield labels, stats["preemptions"]
            elif name.startswith("router:remote_deployment"):
                for d in stats.get("deployments", ()):
                    if name.endswith("_up"):
                        yield labels + (d["url"],), 1.0 if d.get("state") == "up" else 0.0
                    else:
                        yield labels + (d["url"],), d.get("in_flight", 0)
