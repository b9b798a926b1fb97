"""The ``remote`` backend: a model that runs on other OpenAI-compatible servers.

TensorRT-LLM's trtllm-serve, vLLM, llama.cpp's llama-server or another router, reached over HTTP,
with several deployments per model, balanced by requests in flight, health-checked, failed over
before the first byte, relayed event by event. See docs/remote.md.

router.toml::

    [[models]]
    name = "llama-70b"
    backend = "remote"
    upstream_model = "meta-llama/Llama-3.1-70B-Instruct"
    api_key = "env:TRT_API_KEY"
    forward_extras = ["top_k", "priority"]

    [[models.deployments]]
    url = "http://trt-a:8000/v1"

    [[models.deployments]]
    url = "http://trt-b:8000/v1"
    weight = 2

The HTTP client (:mod:`.http`) is imported only when a model of this backend starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from router.backend import Backend, Reply
from router.errors import Unavailable
from router.hookspecs import hookimpl
from router.params import GenerationParams

from .config import DeploymentConfig, RemoteConfig
from .deployment import ALWAYS_ACCEPTED

if TYPE_CHECKING:
    from .balancer import Balancer
    from .relay import Relay

__all__ = ["DeploymentConfig", "RemoteBackend", "RemoteConfig"]

log = logging.getLogger("router.remote")


class RemoteBackend(Backend):
    """Relays a model's requests to its deployments.

    ``state`` is ``ready`` while at least one deployment can take traffic and ``down`` while
    none can (requests then get 503 with ``Retry-After``); ``status()`` shows every deployment.
    """

    Config = RemoteConfig
    tasks = frozenset({"generate", "embed"})
    config: RemoteConfig

    def __init__(self, config: RemoteConfig, base_dir: Path = Path(".")) -> None:
        self._lifecycle = "loading"
        self._error: str | None = None
        self._relay: Relay | None = None
        self._balancer: Balancer | None = None
        self._checker_task: asyncio.Task[None] | None = None
        super().__init__(config, base_dir)
        self.forwardable = frozenset(
            name
            for d in config.deployments
            for name in (d.forward_extras if d.forward_extras is not None else config.forward_extras)
        )
        self.capabilities = self.forwardable | ALWAYS_ACCEPTED

    # ``state`` and ``error`` follow the deployments once started.

    @property  # type: ignore[override]
    def state(self) -> str:
        if self._lifecycle == "ready" and not self._balancer.any_available():  # type: ignore[union-attr]
            return "down"
        return self._lifecycle

    @state.setter
    def state(self, value: str) -> None:
        self._lifecycle = value

    @property  # type: ignore[override]
    def error(self) -> str | None:
        if self._error is None and self.state == "down":
            return self._balancer.why_unavailable()  # type: ignore[union-attr]
        return self._error

    @error.setter
    def error(self, value: str | None) -> None:
        self._error = value

    async def start(self) -> None:
        from .http import Pool
        from .balancer import Balancer
        from .deployment import build_deployments
        from .health import HealthChecker
        from .relay import Relay

        cfg = self.config
        deployments = build_deployments(cfg)
        for d in deployments:
            d.pool = Pool(d.url, limit=d.max_connections)
        self._balancer = Balancer(
            deployments, failure_threshold=cfg.failure_threshold, cooldown=cfg.cooldown
        )
        self._relay = Relay(self.name, cfg, self._balancer, self.forwardable)
        if cfg.health_check_interval > 0:
            checker = HealthChecker(
                self.name, deployments,
                interval=cfg.health_check_interval, timeout=cfg.health_check_timeout,
            )
            await checker.check_all()
            self._checker_task = asyncio.create_task(checker.run(), name=f"health:{self.name}")
        self._lifecycle = "ready"
        if not self._balancer.any_available():
            log.warning("model %s: %s; checking again every %gs", self.name,
                        self._balancer.why_unavailable(), cfg.health_check_interval)

    async def stop(self) -> None:
        if self._checker_task is not None:
            self._checker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker_task
        if self._balancer is not None:
            for d in self._balancer.deployments:
                if d.pool is not None:
                    await d.pool.close()
        self._lifecycle = "stopped"

    def status(self) -> dict[str, Any]:
        out = super().status()
        if self._balancer is not None:
            now = self._balancer.clock()
            out["deployments"] = [d.status(now) for d in self._balancer.deployments]
        return out

    def check_ready(self) -> None:
        if self._lifecycle != "ready":
            super().check_ready()
            return
        balancer = self._balancer
        assert balancer is not None
        if not balancer.any_available():
            retry = balancer.retry_after(self.config.health_check_interval)
            raise Unavailable(
                f"Model `{self.name}` is down: {balancer.why_unavailable()}.",
                param="model", code="no_deployment_available",
                headers={"Retry-After": str(retry)},
            )

    async def chat(self, request: Any, params: GenerationParams) -> Reply:
        assert self._relay is not None
        return await self._relay.request("chat", request, params)

    async def complete(self, request: Any, params: GenerationParams) -> Reply:
        assert self._relay is not None
        return await self._relay.request("completions", request, params)

    async def embed(self, request: Any) -> tuple[bytes, int]:
        """``/v1/embeddings`` relayed as it came (the upstream's model name put in), with the
        same balancing, failover and error mapping as generation."""
        assert self._relay is not None
        reply = await self._relay.request("embeddings", request, GenerationParams())
        assert isinstance(reply, bytes)
        usage = msgspec.json.decode(reply).get("usage") or {}
        return reply, usage.get("prompt_tokens", 0) if isinstance(usage, dict) else 0


@hookimpl
def register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("remote", RemoteBackend)
