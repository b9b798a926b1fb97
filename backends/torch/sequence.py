"""One sequence inside the torch engine: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from router.engine import EngineRequest, TokenLogprobs

from .kv_cache import BlockPool, chain_hash

if TYPE_CHECKING:
    from .state import StateCache

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens, the blocks holding their KV, and how far prefill got."""

    def __init__(
        self,
        request: EngineRequest,
        deliver: Callable[[Any], None],
        block_size: int,
        adapter: int = 0,
        root: int | None = None,
    ) -> None:
        self.id = next(_ids)
        self.block_size = block_size
        self.request = request
        self.deliver = deliver
        self.tokens: list[int] = list(request.prompt_ids)
        self.num_prompt = len(self.tokens)
        self.num_computed = 0  # tokens whose keys and values are in the cache
        self.state_slot: int | None = None  # linear attention's state (state.py), while running
        self.restore_from: int | None = None  # a cached state to start from (state.StateCache), until copied
        # Where its prompt's cached blocks ended past the state it starts from (another prompt shares
        # them): its state is kept there too, for the next prompt sharing them (take_prefix_hits).
        self.shared_boundary: int | None = None
        self.output_state: int | None = None  # the block hash of its latest state kept past the prompt
        self.block_table: list[int] = []
        self._hashes: list[int] = []  # chain hash of each full block of `tokens`
        self.adapter = adapter  # the LoRA adapter's index (lora.Adapters); 0: the base model
        # Under an adapter the same tokens have other keys and values: its chain starts elsewhere.
        self._root = root
        self._registered = 0  # blocks already offered to the prefix cache
        self.status = Status.WAITING
        self.cached_tokens: int | None = None  # prefix-cache hits at first admission
        self.aborted = False
        self.sampling_state: Any = None  # owned by the runner (random generator)
        self.draft_size: int | None = None  # speculative decoding: this sequence's draft length
        self.token_buffer: Any = None  # speculative decoding: ``tokens`` as an array (token_array)
        self.token_count = 0  # how many of ``tokens`` the buffer holds
        # A draft model's keys and values (draft.py): right at positions before draft_valid, and
        # after it as far as the drafted tokens draft_tail match the tokens.
        self.draft_valid = 0
        self.draft_tail: list[int] = []
        # Predicted outputs: the request's prediction as an array, where drafting from it got to,
        # and its drafted tokens the model kept and refused (usage's prediction token counts).
        self.prediction: Any = None if request.prediction is None else np.asarray(request.prediction, dtype=np.int64)
        self.prediction_at = 0
        self.prediction_kept = 0
        self.prediction_refused = 0
        self.loop: Any = None  # the event loop whose request this is
        self.order = (request.priority, request.arrival, self.id)
        # Prompt logprobs, when asked: entry p scores prompt token p + 1 (from position p's logits).
        self.prompt_logprobs: list[TokenLogprobs] | None = [] if request.prompt_logprobs is not None else None

    def scoring(self, num_new: int) -> range:
        """The positions among the next ``num_new`` whose logits score the next prompt token:
        from the first not yet scored to the prompt's last but one (empty without prompt logprobs)."""
        done = self.prompt_logprobs
        if done is None:
            return range(0)
        return range(max(self.num_computed, len(done)), min(self.num_computed + num_new, self.num_prompt - 1))

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokens[: self.num_prompt]

    def block_hash(self, index: int) -> int:
        """Chain hash of full block ``index`` of the current tokens (memoised)."""
        bs = self.block_size
        while len(self._hashes) <= index:
            i = len(self._hashes)
            parent = self._hashes[i - 1] if i else self._root
            self._hashes.append(chain_hash(parent, self.tokens[i * bs : (i + 1) * bs]))
        return self._hashes[index]

    # --- block bookkeeping ----------------------------------------------------------------

    def take_prefix_hits(self, pool: BlockPool, states: StateCache | None = None) -> int:
        """Share cached blocks for the longest cached prefix; return how many tokens they hold.

        At least one token is left to compute, so there are logits to sample from; and no
        position whose logits still score the prompt (prompt logprobs) is skipped. With
        per-sequence states (``states``), the prefix ends where a cached state does too: the
        sequence starts from that state (:attr:`restore_from`). Cached blocks past that state
        mean an earlier prompt shares them (a system prompt, say, whose state was kept only
        where that prompt's chunks ended): :attr:`shared_boundary` asks for the state at their
        end to be kept as this prompt passes it, so that the next prompt sharing them starts there.
        """
        bs = self.block_size
        full = (len(self.tokens) - 1) // bs
        limit = full if self.prompt_logprobs is None else min(full, len(self.prompt_logprobs) // bs)
        # With states, the cached run is looked up past what a prompt scoring itself may skip: a
        # shared boundary is kept whichever way this prompt computes its tokens.
        cached: list[int] = []
        while len(cached) < (full if states is not None else limit) and (
                block := pool.lookup(self.block_hash(len(cached)))) is not None:
            cached.append(block)
        found = cached[:limit]
        if states is not None:
            shared = len(cached) * bs
            while found and (restore := states.lookup(self.block_hash(len(found) - 1))) is None:
                found.pop()
            self.restore_from = restore if found else None
            self.shared_boundary = shared if len(found) * bs < shared <= self.num_prompt else None
        for block in found:
            pool.share(block)
        self.block_table.extend(found)
        self._registered = len(found)
        self.num_computed = len(found) * bs
        return self.num_computed

    def blocks_needed(self, num_new: int) -> int:
        """Blocks to allocate so that ``num_new`` more tokens have slots."""
        total = -(-(self.num_computed + num_new) // self.block_size)
        return max(0, total - len(self.block_table))

    def grow(self, pool: BlockPool, num_new: int) -> None:
        for _ in range(self.blocks_needed(num_new)):
            self.block_table.append(pool.allocate())

    def trim(self, pool: BlockPool) -> None:
        """Release the blocks past those the computed tokens fill (after a draft's rejected
        rows: they are private, never offered to the prefix cache)."""
        keep = -(-self.num_computed // self.block_size)
        while len(self.block_table) > keep:
            pool.release(self.block_table.pop())

    def register_full_blocks(self, pool: BlockPool) -> None:
        """Offer blocks that became full (and computed) to the prefix cache."""
        bs = self.block_size
        full = min(self.num_computed, len(self.tokens)) // bs
        while self._registered < full:
            pool.register(self.block_table[self._registered], self.block_hash(self._registered))
            self._registered += 1

    def release(self, pool: BlockPool) -> None:
        # Release tail first: the head blocks (shared prefix) stay cached longest.
        for block in reversed(self.block_table):
            pool.release(block)
        self.block_table = []
        self.num_computed = 0
        self.restore_from = self.shared_boundary = None
        self._registered = 0
        self.draft_valid, self.draft_tail = 0, []
