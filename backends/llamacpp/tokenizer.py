"""The GGUF vocabulary through llama.cpp, as the serving pipeline's Tokenizer."""

from __future__ import annotations

import ctypes
from typing import Sequence

import llama_cpp


class _VocabOnly:
    """A GGUF file's vocabulary loaded alone (no weights, no context): llama-cpp-python's
    ``Llama(vocab_only=True)`` still makes a context, and says so on stderr."""

    def __init__(self, path: str) -> None:
        from llama_cpp._internals import LlamaModel

        from .engine import _LOAD_LOCK

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model_path = path
        with _LOAD_LOCK:  # quiet loading redirects stderr: one at a time (see engine.py)
            self._loaded = LlamaModel(path_model=path, params=params, verbose=False)
        self.model = self._loaded.model


class LlamaCppTokenizer:
    """Tokenizer over a loaded llama.cpp model's vocabulary. It pickles as its GGUF file's path:
    unpickled (in the router's process, from a worker's), it opens the file's vocabulary alone."""

    def __init__(self, model: llama_cpp.Llama | _VocabOnly) -> None:
        self._model = model  # the vocabulary lives as long as the model
        self._path = model.model_path
        self._vocab = llama_cpp.llama_model_get_vocab(model.model)
        vocab = self._vocab
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self._add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        # Every token's bytes, read once: decoding is then a join, with no C call per token.
        self._pieces = [self._piece(t, special=False) for t in range(self.vocab_size)]
        self._special_pieces: dict[int, bytes] = {}
        control = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
        specials = set()
        eog = set()
        for t in range(self.vocab_size):
            if llama_cpp.llama_vocab_get_attr(vocab, t) & control:
                text = self._piece(t, special=True).decode("utf-8", "replace")
                if text:
                    specials.add(text)
            if llama_cpp.llama_vocab_is_eog(vocab, t):
                eog.add(t)
        self.special_tokens = frozenset(specials)
        self.eos_token_ids = frozenset(eog)
        bos = llama_cpp.llama_vocab_bos(vocab)
        eos = llama_cpp.llama_vocab_eos(vocab)
        self.bos_token = self._text_of(bos)
        self.eos_token = self._text_of(eos)

    @classmethod
    def from_file(cls, path: str) -> "LlamaCppTokenizer":
        """The vocabulary of the GGUF file at ``path``, without its weights."""
        return cls(_VocabOnly(path))

    def __reduce__(self) -> tuple:
        return (LlamaCppTokenizer.from_file, (self._path,))

    def _text_of(self, token: int) -> str | None:
        if token < 0 or token >= self.vocab_size:
            return None
        return self._piece(token, special=True).decode("utf-8", "replace") or None

    def _piece(self, token: int, *, special: bool) -> bytes:
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def encode(self, text: str, *, add_special_tokens: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        # A token covers at least one byte; leave room for BOS/EOS.
        capacity = len(data) + 4
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buf, capacity, add_special_tokens, parse_special
        )
        if n < 0:  # pragma: no cover - capacity is an upper bound
            raise RuntimeError(f"tokenization needs {-n} tokens")
        return list(buf[:n])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")
        pieces = self._pieces
        return b"".join(pieces[t] for t in ids).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        special = self._special_pieces.get(token_id)
        if special is None:
            special = self._special_pieces[token_id] = self._piece(token_id, special=True)
        return special

    def token_str(self, token_id: int) -> str:
        return llama_cpp.llama_vocab_get_text(self._vocab, token_id).decode("utf-8", "replace")
