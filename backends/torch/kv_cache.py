"""The paged KV cache: fixed-size blocks, reference counts and the prefix cache.

Keys and values live in one tensor pair per layer, ``[num_blocks * block_size, kv_heads,
head_dim]`` (latent attention: one tensor, the values a view of the keys' first dimensions; a
short convolution: its inputs alone). :class:`BlockPool` hands out block ids. A block that is
full is identified by a hash chained over all tokens up to its end, so two requests sharing a prompt prefix share its blocks.
A released block keeps its contents and its hash until a new allocation needs the space (least
recently used first): a later request with the same prefix finds it again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from .model import ModelSpec


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Identity of a full block: its tokens and everything before them."""
    return hash((parent, tuple(tokens)))


class BlockPool:
    """Allocates KV blocks; counts who uses each; remembers full blocks by content."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._fresh: deque[int] = deque(range(num_blocks))  # unused, no content worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unused, hashed; LRU first

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._evictable)

    @property
    def num_fresh(self) -> int:
        """Free blocks holding nothing the prefix cache keeps (allocated before cached ones)."""
        return len(self._fresh)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """A block for new content (evicting the least recently used cached block if needed)."""
        if self._fresh:
            block = self._fresh.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._hash[block]
            if h is not None and self._by_hash.get(h) == block:
                del self._by_hash[h]
            self._hash[block] = None
        else:
            raise MemoryError("no free KV block")
        self._refs[block] = 1
        return block

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash) if self.prefix_caching else None

    def share(self, block: int) -> None:
        """Take a reference to a cached block (a prefix hit)."""
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._hash[block] is not None:
                self._evictable[block] = None
            else:
                self._fresh.append(block)

    def register(self, block: int, block_hash: int) -> None:
        """Remember a block that just became full, so later prompts can reuse it."""
        if not self.prefix_caching or self._hash[block] is not None:
            return
        if block_hash not in self._by_hash:
            self._by_hash[block_hash] = block
            self._hash[block] = block_hash

    def refs(self, block: int) -> int:
        return self._refs[block]


@dataclass
class KVCache:
    """The key and value tensors of every layer."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    num_blocks: int

    @classmethod
    def for_model(cls, spec: "ModelSpec", num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> "KVCache":
        """Zeroed tensors for ``num_blocks`` blocks of each of ``spec``'s layers, shaped as the
        layer keeps a token (:meth:`.model.ModelSpec.kv_entry`)."""
        k, v = [], []
        for entry in map(spec.kv_entry, range(spec.num_layers)):
            keys = torch.zeros((num_blocks * block_size, entry["kv_heads"], entry["head_dim"]), dtype=dtype,
                               device=device)
            k.append(keys)
            # values_in_keys: the values are the keys' first that many dimensions (latent
            # attention; none at all for a convolution's inputs): one tensor, viewed twice.
            inside = entry["values_in_keys"]
            v.append(keys[..., :inside] if inside is not None else torch.zeros_like(keys))
        return cls(k, v, block_size, num_blocks)

    @staticmethod
    def bytes_per_block(spec: "ModelSpec", block_size: int, dtype: torch.dtype) -> int:
        """What one block of every layer of ``spec``'s model takes."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for layer in range(spec.num_layers):
            entry = spec.kv_entry(layer)
            tensors = 1 if entry["values_in_keys"] is not None else 2
            total += tensors * block_size * entry["kv_heads"] * entry["head_dim"] * size
        return total
