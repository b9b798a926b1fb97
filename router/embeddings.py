"""``POST /v1/embeddings`` (OpenAI's shape) on models with ``task = "embed"``.

The router tokenizes (with the engine's own tokenizer, as for generation) and checks lengths;
the engine, in the model's worker, runs the forward passes, sharing them between concurrent
requests (backends/torch/embedder.py). Vectors come back as float32; ``encoding_format:
"base64"`` sends their little-endian bytes as they are.
"""

from __future__ import annotations

import base64
import weakref
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from .engine import EngineError
from .errors import BadRequest

if TYPE_CHECKING:
    from .backend import LocalBackend

MAX_INPUTS = 2048
"""Inputs one request may carry (OpenAI's limit)."""


class EmbeddingRequest(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    model: str
    input: Union[str, list[Union[str, int, list[int]]]]
    """A text, texts, a list of token ids, or lists of token ids."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    """vLLM's: keep an input's first k tokens (-1: as many as the model takes) instead of a 400."""


class Embedding(Struct, kw_only=True):
    object: str = "embedding"
    embedding: Union[list[float], str]
    index: int


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct, kw_only=True):
    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


_encode = msgspec.json.Encoder().encode


def inputs_of(req: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The request's inputs as texts or as token id lists, all of one kind (400 otherwise)."""
    given = req.input
    if isinstance(given, str):
        given = [given]
    if not given:
        raise BadRequest("`input` is an empty list; send at least one text or token list.", param="input")
    if len(given) > MAX_INPUTS:
        raise BadRequest(f"`input` has {len(given)} items; at most {MAX_INPUTS} are allowed.", param="input")
    if all(isinstance(x, int) for x in given):
        return [given]  # type: ignore[list-item]  # one input as token ids
    for kind in (str, list):
        if all(isinstance(x, kind) for x in given):
            for i, x in enumerate(given):
                if not x:
                    what = "an empty string" if kind is str else "an empty token list"
                    raise BadRequest(f"`input[{i}]` is {what}.", param=f"input[{i}]")
            return given  # type: ignore[return-value]
    raise BadRequest("`input` mixes kinds: send texts, a token list, or token lists, not a mix.", param="input")


def _fit(ids: list[int], limit: int, keep_tail: int, i: int, truncate: int | None) -> list[int]:
    if len(ids) <= limit and (truncate is None or truncate < 0 or len(ids) <= truncate):
        return ids
    if truncate is None:
        raise BadRequest(
            f"`input[{i}]` has {len(ids)} tokens; the model takes at most {limit}. "
            "Shorten it, or set `truncate_prompt_tokens` to keep its first tokens.",
            param=f"input[{i}]", code="context_length_exceeded")
    k = limit if truncate < 0 else min(truncate, limit)
    if k <= keep_tail:
        raise BadRequest(f"`truncate_prompt_tokens` must leave room for text: more than {keep_tail}.",
                         param="truncate_prompt_tokens")
    return ids[: k - keep_tail] + (ids[-keep_tail:] if keep_tail else [])


async def embed(backend: "LocalBackend", req: EmbeddingRequest) -> tuple[bytes, int]:
    """The JSON answer for ``req`` on a loaded local embedding model, and its prompt tokens."""
    import numpy as np  # not at import: `router --help` stays light
    engine = backend.engine
    tok = engine.tokenizer
    inputs = inputs_of(req)
    limit = engine.max_model_len
    if isinstance(inputs[0], str):
        tail = _trailing_specials(tok)
        ids = [_fit(tok.encode(t, add_special_tokens=True), limit, tail, i, req.truncate_prompt_tokens)  # type: ignore[arg-type]
               for i, t in enumerate(inputs)]
    else:
        for i, x in enumerate(inputs):
            bad = next((t for t in x if not 0 <= t < tok.vocab_size), None)  # type: ignore[union-attr]
            if bad is not None:
                raise BadRequest(f"`input[{i}]` has token id {bad}, outside the vocabulary (0 to {tok.vocab_size - 1}).",
                                 param=f"input[{i}]")
        ids = [_fit(list(x), limit, 0, i, req.truncate_prompt_tokens) for i, x in enumerate(inputs)]  # type: ignore[arg-type]
    try:
        vectors = await engine.embed(ids, req.dimensions)
    except EngineError as exc:  # its worker died under it (503), or the engine failed (500)
        from .serving import engine_failure

        raise engine_failure(exc) from None
    rows = np.frombuffer(b"".join(vectors), dtype="<f4").reshape(len(ids), -1)
    data = [Embedding(embedding=base64.b64encode(row.tobytes()).decode() if req.encoding_format == "base64"
                      else row.tolist(), index=i) for i, row in enumerate(rows)]
    used = sum(len(x) for x in ids)
    body = EmbeddingList(data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used))
    return _encode(body), used


_tails: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _trailing_specials(tok: Any) -> int:
    """How many special tokens the tokenizer puts after a text (BERT's [SEP]: 1); found once per
    tokenizer (a loaded model's), forgotten with it."""
    found = _tails.get(tok)
    if found is not None:
        return found
    empty = tok.encode("", add_special_tokens=True)
    probe = tok.encode("a", add_special_tokens=True)
    same = 0
    while same < len(empty) and same < len(probe) and empty[-1 - same] == probe[-1 - same]:
        same += 1
    _tails[tok] = same
    return same
