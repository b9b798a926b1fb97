"""From a ``[[models]]`` entry to a running engine: device, precision and memory decided here."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from router.config import resolve_path

from .engine import EngineOptions, TorchEngine
from .loader import load_checkpoint, weight_files
from .speculative import NgramOptions

log = logging.getLogger("router.torch")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device `{name}` asked for, but CUDA is not available")
        if device.index is None:  # torch.cuda.set_device and graph captures need an index
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device `{name}` asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def kv_budget(config, device: torch.device, dtype: torch.dtype, checkpoint, adapter_bytes: int = 0) -> int:  # type: ignore[no-untyped-def]
    """Bytes for the KV cache: ``kv_cache_gb``; else on CUDA a fraction of what the weights
    (and ``adapter_bytes``: the LoRA adapters' and the draft model's files, about their size on
    the device) leave free; else 1 GiB of RAM."""
    if config.kv_cache_gb is not None:
        return int(config.kv_cache_gb * (1 << 30))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        weights = sum(t.numel() for t in checkpoint.weights.values()) * torch.empty((), dtype=dtype).element_size()
        weights += adapter_bytes
        return int(max(free - weights, 0) * config.kv_cache_fraction)
    return 1 << 30


def speculative_options(config) -> NgramOptions | None:  # type: ignore[no-untyped-def]
    """The engine's n-gram drafting from a model's ``speculative_config`` (None: off)."""
    if config is None:
        return None
    return NgramOptions(
        num_tokens=config.num_speculative_tokens,
        min_n=config.prompt_lookup_min or 1,  # a draft model's: predictions only (no lookup)
        max_n=config.prompt_lookup_max or 1,
        disable_by_batch_size=config.disable_by_batch_size,
    )


def build_engine(config, path: Path, adapters: dict[str, Path] | None = None,  # type: ignore[no-untyped-def]
                 draft_model: Path | None = None) -> TorchEngine:
    """The engine for a ``[[models]]`` entry; ``adapters``: its LoRA folders by served name;
    ``draft_model``: ``speculative_config.model`` resolved against the config's folder (else
    taken as it is)."""
    spec = config.speculative_config
    if draft_model is None and spec is not None and spec.model is not None:
        draft_model = resolve_path(spec.model)
    device = pick_device(config.device)
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = _DTYPES[config.dtype]
    if config.weight_format != "native" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f'weight_format = "{config.weight_format}" is for the CPU with dtype float32')

    def load():  # type: ignore[no-untyped-def]
        # Runs on the engine thread; the budget needs the weights' size, hence decided here.
        checkpoint = load_checkpoint(path)
        if dtype == torch.float16 and checkpoint.spec.float16_overflows:
            raise ValueError('dtype = "float16": Gemma 2, 3 and 4 overflow float16 (numerically unstable); '
                             'use "bfloat16" or "float32"')
        files = [folder / "adapter_model.safetensors" for folder in options.lora_modules.values()]
        if draft_model is not None:  # its weights' files: about what it takes on the device
            files += [draft_model] if draft_model.is_file() else weight_files(draft_model)
        adapter_bytes = sum(f.stat().st_size for f in files if f.is_file())
        options.kv_cache_bytes = kv_budget(config, device, dtype, checkpoint, adapter_bytes)
        options.max_model_len = config.max_model_len or checkpoint.spec.context_length
        return checkpoint

    options = EngineOptions(
        device=device,
        dtype=dtype,
        kv_dtype=None if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype],
        max_model_len=config.max_model_len or 0,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_batched_tokens=config.max_batched_tokens or (8192 if device.type == "cuda" else 512),
        prefix_caching=config.prefix_caching,
        num_threads=config.num_threads,
        seed=config.seed,
        weight_format=config.weight_format,
        decode_graphs="capture" if device.type == "cuda" and config.cuda_graphs else "off",
        lora_modules=dict(adapters or {}),
        speculative=speculative_options(config.speculative_config),
        draft_model=draft_model,
    )
    engine = TorchEngine(load, options)
    log.info(
        "torch engine: %s %s, %d %s KV blocks of %d tokens, context %d, decode graphs %s, %d LoRA adapters, "
        "speculative %s",
        device, str(dtype).removeprefix("torch."), engine.pool.num_blocks,
        str(engine.kv.k[0].dtype).removeprefix("torch."), config.block_size, engine.max_model_len,
        options.decode_graphs, len(options.lora_modules),
        f"{options.speculative}, draft model {draft_model}" if draft_model else options.speculative or "off",
    )
    return engine
