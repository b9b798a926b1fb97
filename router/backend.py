"""Backend types: what turns one ``[[models]]`` entry of router.toml into a served model.

A plugin registers backend classes with the ``register_backends`` hook. Two bases:

- :class:`LocalBackend` for engines that run here (llama.cpp, torch): implement
  :meth:`LocalBackend.create_engine` and the shared serving pipeline does the rest.
- :class:`Backend` for anything that answers whole requests itself (the remote relay).
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, ClassVar, Union

import msgspec

from .config import ModelConfig, resolve_path
from .engine import Engine
from .errors import BadRequest, Unavailable
from .footprint import Footprint, file_bytes
from .params import GenerationParams

log = logging.getLogger("router.backend")

Reply = Union[bytes, AsyncIterator[bytes]]
"""A JSON body, or the already framed events of a Server-Sent Events stream."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What plugins see of the model a request is for."""

    name: str
    backend: str
    capabilities: frozenset[str]
    max_model_len: int | None
    config: ModelConfig


class Backend(abc.ABC):
    """One served model. Subclass, set ``Config`` to the options it takes, register it."""

    Config: ClassVar[type[ModelConfig]] = ModelConfig
    local: ClassVar[bool] = False
    """Whether its engine runs on this machine, loaded and unloaded by the fleet
    (:mod:`router.fleet`); only such models take ``preload``, ``keep_alive``, ``pin`` and
    ``worker``."""
    tasks: ClassVar[frozenset[str]] = frozenset({"generate"})
    """The ``task`` values a model of this backend may have (``generate``, ``embed``)."""

    def __init__(self, config: ModelConfig, base_dir: Path = Path(".")) -> None:
        self.config = config
        self.base_dir = base_dir
        self.state = "loading"  # loading | ready | failed | stopped; local models: unloaded, unloading
        self.error: str | None = None
        self.capabilities: frozenset[str] = frozenset()
        self.max_model_len: int | None = config.max_model_len
        self._info: ModelInfo | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def info(self) -> ModelInfo:
        # Built again only when loading changed what it shows: it is read on every request.
        info = self._info
        if info is None or info.capabilities is not self.capabilities or info.max_model_len != self.max_model_len:
            info = self._info = ModelInfo(
                self.name, self.config.backend, self.capabilities, self.max_model_len, self.config
            )
        return info

    @classmethod
    def estimate_memory(cls, config: ModelConfig, base_dir: Path) -> Footprint | None:
        """What the model will take in this machine's memory once loaded, before loading it
        (None: nothing here, a remote model). The fleet uses it until a load has measured it."""
        return None

    async def start(self) -> None:
        """Load whatever the model needs; the router calls it once, in the background."""
        self.state = "ready"

    async def stop(self) -> None:
        self.state = "stopped"

    def status(self) -> dict[str, Any]:
        """What /health reports for this model."""
        out: dict[str, Any] = {"state": self.state}
        if self.error:
            out["error"] = self.error
        return out

    def check_ready(self) -> None:
        if self.state != "ready":
            why = f": {self.error}" if self.error else ""
            raise Unavailable(
                f"Model `{self.name}` is {self.state}{why}.",
                param="model",
                code="model_not_ready",
                headers={"Retry-After": "5"},
            )

    async def tokenize(self, request: Any) -> bytes:
        """Answer ``/tokenize``; only models whose tokenizer lives here can."""
        raise BadRequest(f"Model `{self.name}` cannot tokenize here.", param="model")

    async def detokenize(self, request: Any) -> bytes:
        """Answer ``/detokenize``."""
        raise BadRequest(f"Model `{self.name}` cannot detokenize here.", param="model")

    async def count_prompt_tokens(self, request: Any, params: GenerationParams) -> int:
        """The prompt tokens a decoded chat request takes, as its usage reports them (Anthropic's
        ``count_tokens``). Here: a one-token answer's usage, what any backend can give."""
        params.max_tokens, params.stream, params.fit_max_tokens = 1, False, False
        reply = await self.chat(request, params)
        assert isinstance(reply, bytes)
        return int(msgspec.json.decode(reply)["usage"]["prompt_tokens"])

    async def embed(self, request: Any) -> tuple[bytes, int]:
        """Answer a decoded ``/v1/embeddings`` request: the JSON body, and the prompt tokens."""
        raise BadRequest(f"Model `{self.name}` cannot embed here.", param="model")

    @abc.abstractmethod
    async def chat(self, request: Any, params: GenerationParams) -> Reply:
        """Answer a decoded ``/v1/chat/completions`` request."""

    @abc.abstractmethod
    async def complete(self, request: Any, params: GenerationParams) -> Reply:
        """Answer a decoded ``/v1/completions`` request."""


class LocalBackend(Backend):
    """A model served by a local :class:`~router.engine.Engine` through the shared pipeline
    (template, tokenize, detokenize, stop strings, usage, chunks). The engine runs in a worker
    process of its own (``worker = true``, the default; :mod:`router.workers`) or in the router's;
    the fleet (:mod:`router.fleet`) starts and stops it."""

    local = True
    engine: Any
    """While loaded: the engine as the pipeline talks to it, a
    :class:`router.workers.client.WorkerEngine` or :class:`~router.workers.client.InlineEngine`."""

    def __init__(self, config: ModelConfig, base_dir: Path = Path(".")) -> None:
        super().__init__(config, base_dir)
        self.runtime_adapters: dict[str, Path] = {}
        """LoRA adapters loaded while serving (``/v1/load_lora_adapter``): loaded again with the
        engine after an unload or a crash."""

    @abc.abstractmethod
    def create_engine(self) -> Engine:
        """Build the engine. It runs in the model's worker process (the class is imported there
        by its module and rebuilt from the config; the process's stderr is the router's), or
        with ``worker = false`` in a thread of the router's; it may block. The engine's
        tokenizer must pickle: the router tokenizes with it in its own process."""

    @classmethod
    def estimate_memory(cls, config: ModelConfig, base_dir: Path) -> Footprint | None:
        """The weights' file(s) at ``path`` and a worker's own cost; backends that know their
        cache and libraries say more."""
        path = getattr(config, "path", None)
        weights = 0
        if isinstance(path, str):
            try:
                weights = file_bytes(resolve_path(path, base_dir))
            except ValueError:
                pass
        return Footprint(weights=weights)

    async def start(self) -> None:
        from .workers.client import launch

        engine = await launch(self)
        try:
            self._attach(engine)
            for name, path in self.runtime_adapters.items():
                await engine.add_adapter(name, path)
        except BaseException:
            await engine.close()
            raise

    def _attach(self, engine: Any) -> None:
        from .templates import ChatTemplate

        tok = engine.tokenizer
        source = engine.chat_template
        if self.config.chat_template is not None:
            source = resolve_path(self.config.chat_template, self.base_dir).read_text("utf-8")
        self.template = (
            ChatTemplate(source, bos_token=tok.bos_token, eos_token=tok.eos_token)
            if source
            else None
        )
        capabilities = set(engine.capabilities)
        if self.config.tool_parser and "structured_outputs" in capabilities:
            capabilities.add("tool_choice")  # required / named calls are forced by a grammar
        self.capabilities = frozenset(capabilities)
        self.max_model_len = engine.max_model_len
        self.engine = engine
        self.error = None
        self.state = "ready"

    def detach(self) -> None:
        """The engine is gone (unloaded, or its worker died): the model is unloaded. ``engine``
        stays, dead: a request that took it before fails with its
        :class:`~router.workers.client.WorkerLost` (a 503), not for want of an attribute."""
        self.state = "unloaded"

    def status(self) -> dict[str, Any]:
        out = super().status()
        if self.state == "ready":
            out.update(self.engine.stats())
        return out

    async def stop(self) -> None:
        engine = self.__dict__.get("engine")
        self.state = "unloading"
        try:
            if engine is not None:
                await engine.close()
        finally:
            self.detach()

    async def chat(self, request: Any, params: GenerationParams) -> Reply:
        from . import serving

        return await serving.chat(self, request, params)

    async def tokenize(self, request: Any) -> bytes:
        from . import serving

        return serving.tokenize(self, request)

    async def count_prompt_tokens(self, request: Any, params: GenerationParams) -> int:
        from . import serving

        return serving.count_chat_prompt(self, request, params)

    async def embed(self, request: Any) -> tuple[bytes, int]:
        from .embeddings import embed

        return await embed(self, request)

    async def detokenize(self, request: Any) -> bytes:
        from . import serving

        return serving.detokenize(self, request)

    async def complete(self, request: Any, params: GenerationParams) -> Reply:
        from . import serving

        return await serving.complete(self, request, params)


class AdapterModel(Backend):
    """A LoRA adapter of a local model, served as a model of its own name: requests for it run
    on its parent's engine (and admission queue) with ``params.adapter`` set; readiness,
    capabilities and limits are the parent's."""

    def __init__(self, parent: Backend, adapter: str) -> None:
        self.parent = parent
        self.adapter = adapter
        self.config = parent.config
        self.base_dir = parent.base_dir
        self._info = None

    @property
    def name(self) -> str:
        return self.adapter

    # Read through, so that they follow the parent's loading.
    state = property(lambda self: self.parent.state)
    error = property(lambda self: self.parent.error)
    capabilities = property(lambda self: self.parent.capabilities)
    max_model_len = property(lambda self: self.parent.max_model_len)

    async def start(self) -> None:
        """The parent loads (and stops) the engine."""

    async def stop(self) -> None:
        """See :meth:`start`."""

    def status(self) -> dict[str, Any]:
        return {**self.parent.status(), "parent": self.parent.name}

    async def tokenize(self, request: Any) -> bytes:
        return await self.parent.tokenize(request)

    async def detokenize(self, request: Any) -> bytes:
        return await self.parent.detokenize(request)

    async def count_prompt_tokens(self, request: Any, params: GenerationParams) -> int:
        return await self.parent.count_prompt_tokens(request, params)  # an adapter adds no tokens

    async def chat(self, request: Any, params: GenerationParams) -> Reply:
        params.adapter = self.adapter
        return await self.parent.chat(request, params)

    async def complete(self, request: Any, params: GenerationParams) -> Reply:
        params.adapter = self.adapter
        return await self.parent.complete(request, params)
