"""What a torch model will take in memory, from its files' headers alone (no torch imported).

The fleet (router/fleet.py) uses it until the model has loaded once and been measured. The
weights' bytes come from the parameter count (safetensors headers, or a GGUF file's tensor
entries) at the weight format's bytes per parameter; the integer formats keep the embedding
table in float32. The KV cache is the budget the engine allocates at start (``kv_cache_gb``,
else 1 GiB on the CPU).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from router.footprint import Footprint, file_bytes

RUNTIME = 480 << 20
"""A torch worker before its weights and cache: torch, transformers and the tokenizers
(about 265 MiB imported), the engine's C kernels, the allocator's slack."""
BYTES_PER_PARAMETER = {"fp16": 2.0, "int8": 1.125, "int4": 0.625}  # with their scales and minimums
PACKING_LEFTOVER = 4
"""Bytes per packed parameter beside the packed weights: fbgemm's float16 copy for prefill batches
(``PackedLinear``'s ``fp16_copy``, 2 bytes) and what packing leaves in the allocator (measured: an
int4 SmolLM2-135M worker takes about 580 MiB beyond its packed weights and cache)."""
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "token_embd.weight")


def parameters(path: Path) -> tuple[int, int]:
    """(every parameter, the embedding table's) of a GGUF file or a folder's safetensors."""
    shapes: dict[str, tuple[int, ...]] = {}
    if path.is_file():
        from ..gguf_header import tensor_shapes

        shapes = tensor_shapes(path)
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        files = [f for f in files if not f.name.startswith("consolidated")] or files
        for f in files:
            with open(f, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            shapes.update((k, tuple(v["shape"])) for k, v in header.items() if k != "__metadata__")
    total = sum(math.prod(s) for s in shapes.values())
    embedding = sum(math.prod(s) for k, s in shapes.items() if k.endswith(EMBEDDINGS))
    return total, embedding


def estimate(config, path: Path) -> Footprint:  # type: ignore[no-untyped-def]
    """``config``: the model's TorchConfig."""
    try:
        total, embedding = parameters(path)
    except (OSError, ValueError, KeyError, struct.error):
        total = embedding = 0
    on_gpu = config.device.startswith("cuda")
    if config.weight_format in BYTES_PER_PARAMETER:
        packed = total - embedding
        weights = packed * (BYTES_PER_PARAMETER[config.weight_format] + PACKING_LEFTOVER) + embedding * 4
    else:
        dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        weights = total * (4 if dtype == "float32" else 2)
    cache = int(config.kv_cache_gb * (1 << 30)) if config.kv_cache_gb is not None else (0 if on_gpu else 1 << 30)
    return Footprint(weights=int(weights), cache=cache, runtime=RUNTIME)


def estimate_embedder(path: Path) -> Footprint:
    """An embedding model (``task = "embed"``): its weights as stored (a zip holds them about
    as large), no KV cache, the same process cost."""
    return Footprint(weights=file_bytes(path), runtime=RUNTIME)
