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
from .config import RouterConfig, resolve_path
from .errors import APIError, BadRequest, ModelNotFound
from .fleet import Fleet
from .metrics import RouterMetrics
from .plugins import Plugins
from .requests import RequestTypes, compose

log = logging.getLogger("router.state")

# Speculative decoding's counters (vLLM's spec_decode metrics) and the engine stats they read.
_SPEC_STATS = {
    "router:spec_decode_num_drafts_total": "spec_drafts",
    "router:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "router:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
}


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
        self.adapters: dict[str, AdapterModel] = {}
        for backend in list(self.models.values()):
            for name in backend.config.adapter_names():
                self._serve_adapter(backend, name)
        self._lora_updates = asyncio.Lock()
        self.keyring = Keyring(config)
        self.metrics = RouterMetrics(self.gauges)
        self.fleet = Fleet(self.models, config.server, self.metrics)
        self.created = int(time.time())
        self.openapi: bytes | None = None  # built on first request
        self._loading: list[asyncio.Task[None]] = []  # remote models' starts
        self._progress: asyncio.Task[None] | None = None

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
        return [a for a in self.adapters.values() if a.parent is base]

    def _serve_adapter(self, base: Backend, name: str) -> None:
        self.adapters[name] = AdapterModel(base, name)
        self.queues[name] = self.queues[base.name]
        self.openapi = None  # its model list changed

    # --- LoRA adapters at run time (server.runtime_lora_updating) -------------------------

    async def load_adapter(self, name: str, path: str, model: str | None) -> None:
        """Load a LoRA adapter of ``model`` (or of the one model that takes adapters) and serve
        it as ``name``. 400 naming what is wrong; 404 for an unknown model. Shielded: a client
        that leaves does not leave the engine and the router disagreeing on what is loaded."""
        await asyncio.shield(self._load_adapter(name, path, model))

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (400 while requests generate with it; shielded too).
        A request that found it before and reaches the engine after gets a 404."""
        await asyncio.shield(self._unload_adapter(name))

    async def _load_adapter(self, name: str, path: str, model: str | None) -> None:
        async with self._lora_updates:
            if name in self.models or name in self.adapters:
                raise BadRequest(f"The model name `{name}` is already in use.", param="lora_name")
            takers = [b for b in self.models.values() if "lora_adapters" in b.capabilities]
            if model is None:
                if len(takers) != 1:
                    names = ", ".join(f"`{b.name}`" for b in takers) or "none ready now"
                    raise BadRequest(f"Name the base model in `model`; models that take LoRA adapters: {names}.",
                                     param="model")
                base = takers[0]
            else:
                base = self.model(model)
                if isinstance(base, AdapterModel) or "lora_adapters" not in base.capabilities:
                    base.check_ready()
                    raise BadRequest(f"Model `{model}` (backend `{base.config.backend}`) cannot take LoRA adapters.",
                                     param="model")
            lease = await self.fleet.lease(base)
            try:
                folder = resolve_path(path, self.config.base_dir)
                await base.engine.add_adapter(name, folder)  # type: ignore[attr-defined]
            except ValueError as exc:  # the adapter's own problems, named by the engine
                raise BadRequest(str(exc), param="lora_path") from None
            finally:
                lease.release()
            base.runtime_adapters[name] = folder  # type: ignore[attr-defined]
            self._serve_adapter(base, name)
            log.info("LoRA adapter %s of %s loaded from %s", name, base.name, path)

    async def _unload_adapter(self, name: str) -> None:
        async with self._lora_updates:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise APIError(f"The LoRA adapter `{name}` cannot be found.", param="lora_name",
                               code="lora_adapter_not_found", status=404)
            parent = adapter.parent
            if parent.state == "ready":  # else it is not loaded there: nothing to take out
                try:
                    await parent.engine.remove_adapter(name)  # type: ignore[attr-defined]
                except ValueError as exc:
                    raise BadRequest(str(exc), param="lora_name") from None
            parent.runtime_adapters.pop(name, None)  # type: ignore[attr-defined]
            del self.adapters[name], self.queues[name]
            self.openapi = None
            log.info("LoRA adapter %s of %s unloaded", name, adapter.parent.name)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start remote models and the local ones that preload, in the background; a progress
        bar on stderr counts them as they get ready (or fail)."""
        remote = [b for b in self.models.values() if self.fleet.slot_of(b) is None]
        self._loading = [asyncio.create_task(self._start(backend)) for backend in remote]
        self.fleet.start()
        starting = remote + [s.backend for s in self.fleet.slots.values() if s.backend.config.preload]
        if starting:
            self._progress = asyncio.create_task(self._show_progress(starting))

    async def _start(self, backend: Backend) -> None:
        t0 = time.monotonic()
        try:
            await backend.start()
        except Exception as exc:  # noqa: BLE001 - one broken model must not stop the others
            backend.state = "failed"
            backend.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to start: %s", backend.name, backend.error)
        else:
            log.info("model %s (%s) ready in %.1fs", backend.name, backend.config.backend, time.monotonic() - t0)

    async def _show_progress(self, starting: list[Backend]) -> None:
        from tqdm import tqdm

        bar = tqdm(total=len(starting), desc="loading models", unit="model", file=sys.stderr, leave=True)
        try:
            while starting:
                await asyncio.sleep(0.1)
                still = [b for b in starting if b.state == "loading"] if self.preloading else []
                if len(still) < len(starting):  # ready, failed, or not preloaded for want of room
                    bar.update(len(starting) - len(still))
                starting = still
        finally:
            bar.close()

    @property
    def preloading(self) -> bool:
        """Whether models are still starting at start-up (remote ones, local ones that preload)."""
        return self.fleet.preloading or any(not t.done() for t in self._loading)

    async def wait_ready(self) -> None:
        await asyncio.gather(*self._loading, self.fleet.wait_ready(), return_exceptions=True)

    async def stop(self) -> None:
        for task in [*self._loading, *([self._progress] if self._progress else [])]:
            task.cancel()
        await asyncio.gather(*self._loading, *([self._progress] if self._progress else []), return_exceptions=True)
        await self.fleet.stop()
        for backend in self.models.values():
            if self.fleet.slot_of(backend) is None:
                try:
                    await backend.stop()
                except Exception:  # noqa: BLE001
                    log.exception("model %s did not stop cleanly", backend.name)

    # --- gauges read at scrape time -------------------------------------------------------

    def gauges(self, name: str) -> Iterable[tuple[tuple[str, ...], float]]:
        if name in ("router:model_memory_bytes", "router:model_loaded"):
            yield from self.fleet.gauge(name)
            return
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
            elif name.startswith("router:spec_decode_") and "spec_drafts" in stats:
                yield labels, stats[_SPEC_STATS[name]]
            elif name.startswith("router:remote_deployment"):
                for d in stats.get("deployments", ()):
                    if name.endswith("_up"):
                        yield labels + (d["url"],), 1.0 if d.get("state") == "up" else 0.0
                    else:
                        yield labels + (d["url"],), d.get("in_flight", 0)
