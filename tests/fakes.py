"""Small stand-ins for unit tests: a byte-level tokenizer with a few words and control tokens."""

from __future__ import annotations

from typing import Sequence

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = ["hello", " world", "Hello", "ab", "bc", "\n", " the"]


class ByteTokenizer:
    """Ids 0-255 are single bytes, then the control tokens, then a few multi-byte words.

    Enough to exercise split UTF-8 characters (a 4-byte emoji is four tokens), special tokens
    (decode skips them unless told not to) and greedy longest-match encoding. ``extra_specials``
    adds control tokens after the words (harmony's markers, say), leaving the other ids as they are.
    """

    def __init__(self, extra_specials: Sequence[str] = ()) -> None:
        self.pieces: list[bytes] = [bytes([i]) for i in range(256)]
        self.special_ids = {}
        for s in SPECIALS:
            self.special_ids[s] = len(self.pieces)
            self.pieces.append(s.encode())
        self.word_ids = {}
        for w in WORDS:
            self.word_ids[w] = len(self.pieces)
            self.pieces.append(w.encode())
        self.specials = [*SPECIALS, *extra_specials]
        for s in extra_specials:
            self.special_ids[s] = len(self.pieces)
            self.pieces.append(s.encode())
        self.vocab_size = len(self.pieces)
        self.bos_token = None
        self.eos_token = "<|im_end|>"
        self.eos_token_ids = frozenset({self.special_ids["<|im_end|>"], self.special_ids["<|endoftext|>"]})
        self.special_tokens = frozenset(self.specials)

    def encode(self, text: str, *, add_special_tokens: bool, parse_special: bool = True) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            if parse_special:
                hit = next((s for s in self.specials if text.startswith(s, i)), None)
                if hit:
                    out.append(self.special_ids[hit])
                    i += len(hit)
                    continue
            word = next((w for w in sorted(WORDS, key=len, reverse=True) if text.startswith(w, i)), None)
            if word:
                out.append(self.word_ids[word])
                i += len(word)
                continue
            out.extend(text[i].encode())
            i += 1
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        specials = set(self.special_ids.values()) if skip_special_tokens else set()
        return b"".join(self.pieces[t] for t in ids if t not in specials).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def token_str(self, token_id: int) -> str:
        return self.pieces[token_id].decode("utf-8", "replace")
