"""A Hugging Face (fast) tokenizer as the serving pipeline's Tokenizer."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from tokenizers import Tokenizer as RustTokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: which character stands for which byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HFTokenizer:
    """Encodes with the Rust tokenizer directly (no Python per token)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        backend: RustTokenizer = hf_tokenizer.backend_tokenizer
        self._tk = backend
        # A twin that reads control-token text as plain text (for what users wrote).
        self._plain = RustTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self.vocab_size = len(hf_tokenizer)
        self.bos_token = hf_tokenizer.bos_token
        self.eos_token = hf_tokenizer.eos_token
        self.eos_token_ids = eos_token_ids
        self.special_tokens = frozenset(
            t.content for t in hf_tokenizer.added_tokens_decoder.values() if t.special
        )
        self._special_ids = {i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special}
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        self._byte_level = "ByteLevel" in json.dumps(decoder)
        self._bytes_of = _byte_decoder() if self._byte_level else None
        self._cache: dict[int, bytes] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in the router's process (from a worker's): the Rust tokenizers travel as
        # their JSON, without the twin's runtime setting.
        self.__dict__.update(state)
        self._plain.encode_special_tokens = True

    def encode(self, text: str, *, add_special_tokens: bool, parse_special: bool = True) -> list[int]:
        tk = self._tk if parse_special else self._plain
        return tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self._tk.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.token_str(token_id)
        if token_id in self._special_ids:
            out = piece.encode()
        elif self._bytes_of is not None:
            out = bytes(self._bytes_of.get(ch, 0) for ch in piece) if all(ch in self._bytes_of for ch in piece) else piece.encode()
        else:
            m = _BYTE_TOKEN.match(piece)
            out = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        self._cache[token_id] = out
        return out
