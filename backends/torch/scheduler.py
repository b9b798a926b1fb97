"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running sequences go first, most important first (lower
``priority``, then earlier arrival): one token for those decoding, a chunk of the prompt for those
still prefilling. Then waiting sequences are admitted in the same order while the budget, the seat
limit and free KV blocks allow, reusing cached prefix blocks. When a running sequence needs a block
and none is free, the least important running sequence is preempted: its blocks are released and
it goes back to the waiting queue, to be recomputed later (its cached blocks may still be there).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .kv_cache import BlockPool
from .sequence import Sequence, Status
from .speculative import NgramProposer, token_array

if TYPE_CHECKING:
    from .draft import DraftModel
    from .state import StateCache, StateSlots

log = logging.getLogger("router.torch")

SCORED_ROWS = 256
"""At most this many prompt rows per step score the next prompt token (prompt logprobs): each
takes the LM head and a row of logits over the whole vocabulary (with a 152k vocabulary, 256
rows are 156 MB of float32), so a long scored prompt is cut into chunks this size."""


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    num_new: int  # tokens computed this step, starting at seq.num_computed (the draft included)
    draft: list[int] = field(default_factory=list)
    """Speculative tokens after the sequence's last one (speculative.py): computed this step too,
    each of the last ``len(draft) + 1`` rows samples."""
    predicted: bool = False
    """The draft came from the request's prediction."""

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's known tokens (so it samples)."""
        return self.seq.num_computed + self.num_new == len(self.seq.tokens) + len(self.draft)

    @property
    def is_decode(self) -> bool:
        return self.num_new == 1 and self.samples


@dataclass(slots=True)
class Step:
    """One step's work: decode sequences first, then prefill chunks."""

    work: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


@dataclass(slots=True)
class StepRows:
    """A step's inputs as plain lists, one row per new token: its id, position and cache slot,
    the context length after it, which of the block tables it reads (one per sequence, padded to
    ``width`` with ``pad_block``; entries past a row's length are never read), and the rows
    whose logits are wanted (``out_rows``, ascending): a decoding sequence's token, the last
    token of a prompt's final chunk, a draft's rows, and the prompt tokens that score the next
    one (prompt logprobs). Of those, ``sampling`` indexes the ones that sample (in the order of the work
    that samples) and ``scored`` the others, as (index, work index, position). In a decode-only
    step, rows and sequences coincide and every out row samples."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    table_of: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    out_rows: list[int] = field(default_factory=list)
    sampling: list[int] = field(default_factory=list)
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    width: int = 0

    @classmethod
    def of(cls, work: list[Scheduled], block_size: int, pad_block: int = 0) -> "StepRows":
        rows = cls(width=max(len(w.seq.block_table) for w in work))
        for j, w in enumerate(work):
            seq, start = w.seq, w.seq.num_computed
            table = seq.block_table
            known = len(seq.tokens)  # positions from here on are the draft's
            scoring = seq.scoring(w.num_new)
            for p in range(start, start + w.num_new):
                if p in scoring:
                    rows.scored.append((len(rows.out_rows), j, p))
                    rows.out_rows.append(len(rows.ids))
                rows.ids.append(seq.tokens[p] if p < known else w.draft[p - known])
                rows.positions.append(p)
                rows.slots.append(table[p // block_size] * block_size + p % block_size)
                rows.lengths.append(p + 1)
                rows.table_of.append(j)
            rows.tables.append(table + [pad_block] * (rows.width - len(table)))
            if w.samples:
                for row in range(len(rows.ids) - 1 - len(w.draft), len(rows.ids)):
                    rows.sampling.append(len(rows.out_rows))
                    rows.out_rows.append(row)
        return rows


class Scheduler:
    """Waiting queue (a priority heap), running set, and the per-step plan."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        scored_rows: int = SCORED_ROWS,
        proposer: NgramProposer | None = None,
        eos_ids: frozenset[int] = frozenset(),
        draft_model: DraftModel | None = None,
        state_slots: StateSlots | None = None,
        state_cache: StateCache | None = None,
    ) -> None:
        self.pool = pool
        # Linear attention (state.py): a state slot for every running sequence, max_num_seqs of them,
        # and the states kept at block boundaries (the prefix cache's other half; None: none kept).
        self.state_slots = state_slots
        self.state_cache = state_cache
        self.proposer = proposer  # speculative decoding: drafts for decoding sequences
        self.draft_model = draft_model  # guesses where the proposer has none (draft.py)
        self.eos_ids = eos_ids  # drafts stop before an end token (see _draft)
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.scored_rows = scored_rows
        self._waiting: list[tuple[tuple, Sequence]] = []
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, s in self._waiting if not s.aborted)

    def has_work(self) -> bool:
        return bool(self.running) or any(not s.aborted for _, s in self._waiting)

    def sequences(self) -> list[Sequence]:
        """Every sequence running (aborted ones too, until finished) or waiting (not aborted)."""
        return [*self.running, *(s for _, s in self._waiting if not s.aborted)]

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self._waiting, (seq.order, seq))

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (done or aborted) and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        """Give back a sequence's blocks and its state slot."""
        seq.release(self.pool)
        if seq.state_slot is not None:
            self.state_slots.give(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        self.add(seq)

    def schedule(self) -> Step:
        step = Step()
        budget = self.max_batched_tokens
        self._scoring = self.scored_rows  # rows left this step that may score a prompt
        scheduled: set[int] = set()
        self.running.sort(key=lambda s: s.order)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(seq, budget)
            if num_new:
                num_new = self._fit(seq, num_new, scheduled, step)
            if not num_new:
                continue  # it was preempted itself, or has no scoring rows left this step
            self._scoring -= len(seq.scoring(num_new))
            seq.grow(self.pool, num_new)
            step.work.append(Scheduled(seq, num_new))
            scheduled.add(seq.id)
            budget -= num_new
        while budget > 0 and self._waiting and len(self.running) < self.max_num_seqs:
            _, seq = self._waiting[0]
            if seq.aborted:
                heapq.heappop(self._waiting)
                continue
            if not self._admit(seq, budget, step):
                break
            heapq.heappop(self._waiting)
            budget -= step.work[-1].num_new
        if budget > 0 and self.proposer is not None and self.proposer.active(len(self.running)):
            self._add_drafts(step, budget)
        # Decode rows first: the attention layout expects them at the front.
        step.work.sort(key=lambda w: not w.is_decode)
        return step

    def _add_drafts(self, step: Step, budget: int) -> None:
        """Speculative tokens for the step's decoding sequences, most important first, from what
        every running sequence's own token and the admissions left: the rest of the budget, and
        only fresh KV blocks, so a draft never delays, preempts or evicts anything (a cached
        block given to a draft that the model then rejects would be lost for nothing)."""
        fresh = self.pool.num_fresh
        bs = self.pool.block_size
        drafting = self.proposer.lookup or self.draft_model is not None
        guessing: list[tuple[Scheduled, int]] = []  # left to the draft model, with their limits
        for w in step.work:
            if budget <= 0:
                break
            if not w.is_decode or not (drafting or w.seq.prediction is not None):
                continue
            seq = w.seq
            draft, w.predicted = self._draft(seq, budget)
            # Room in its last block after its own token, then in the fresh blocks.
            room = len(seq.block_table) * bs - (seq.num_computed + 1) + fresh * bs
            if not draft and self.draft_model is not None:
                limit = min(self._limit(seq, budget), room)
                if limit >= 1:  # its blocks now: the draft model writes its guesses' keys there
                    fresh -= seq.blocks_needed(1 + limit)
                    seq.grow(self.pool, 1 + limit)
                    budget -= limit
                    guessing.append((w, limit))
                continue
            del draft[max(room, 0) :]
            if not draft:
                continue
            blocks = seq.blocks_needed(1 + len(draft))
            seq.grow(self.pool, 1 + len(draft))
            fresh -= blocks
            budget -= len(draft)
            w.num_new += len(draft)
            w.draft = draft
        if guessing:
            self._guess(guessing)

    def _guess(self, guessing: list[tuple[Scheduled, int]]) -> None:
        """The draft model's drafts, cut as :meth:`_draft` cuts the others; the blocks a shorter
        draft did not need go back (fresh: they never held a computed token)."""
        try:
            drafts = self.draft_model.propose([(w.seq, limit) for w, limit in guessing])
        except Exception:  # noqa: BLE001 - a failed guess costs the drafts, not the step
            log.exception("the draft model failed: this step runs without its drafts")
            drafts = [[] for _ in guessing]
        for (w, _), draft in zip(guessing, drafts):
            seq = w.seq
            self._cut(seq, draft)
            keep = -(-(seq.num_computed + 1 + len(draft)) // self.pool.block_size)
            while len(seq.block_table) > keep:
                self.pool.release(seq.block_table.pop())
            w.num_new += len(draft)
            w.draft = draft

    def _draft(self, seq: Sequence, budget: int) -> tuple[list[int], bool]:
        """Tokens to verify after a decoding sequence's last one, up to ``budget`` of them and
        within the request's ``max_tokens``, and whether they came from its prediction. The
        first of these that leaves anything: the tokens a grammar forces (they need no lookup),
        the request's prediction, the n-gram lookup. Each stops before an end token (EOS, a
        stop token id): the row before it samples the end anyway, so drafting one saves no step.
        Under a grammar each is cut where the grammar would refuse it (the model could not
        sample the refused token), and the lookup searches the prompt only: the output's own
        repeats are the grammar's syntax, which it forces anyway, and a match there mostly
        follows ``": "`` to the previous field's value (bench/speculative.py ``extract``: 55% of
        the drafted tokens kept with such matches, 77% without)."""
        req = seq.request
        proposer = self.proposer
        limit = self._limit(seq, budget)
        if limit < 1:
            return [], False
        constraint = req.constraint
        for source in ("forced", "prediction", "lookup"):
            if source == "forced" and constraint is not None:
                draft = constraint.forced()[:limit]
            elif source == "prediction" and seq.prediction is not None:
                draft = proposer.predict(seq, limit)
            elif source == "lookup" and proposer.lookup:
                draft = proposer.propose(token_array(seq), limit, before=seq.num_prompt if constraint is not None else None)
            else:
                continue
            self._cut(seq, draft)
            if draft:
                return draft, source == "prediction"
        return [], False

    def _limit(self, seq: Sequence, budget: int) -> int:
        """The most tokens to draft for ``seq``: within the budget, its ``max_tokens`` and the
        proposer's size for it."""
        return min(budget, seq.request.max_tokens - seq.num_output - 1, self.proposer.size_for(seq))

    def _cut(self, seq: Sequence, draft: list[int]) -> None:
        """Cut a draft before an end token (EOS, a stop token id: the row before it samples the
        end anyway) and where the request's grammar would refuse it."""
        req = seq.request
        for i, token in enumerate(draft):
            if token in req.stop_token_ids or (token in self.eos_ids and not req.ignore_eos):
                del draft[i:]
                break
        if draft and req.constraint is not None:
            del draft[req.constraint.accepts(draft) :]

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens ``seq`` would compute this step: what is left of it, within the budget,
        cut where its rows that score the prompt would pass this step's :data:`SCORED_ROWS`."""
        num_new = min(len(seq.tokens) - seq.num_computed, budget)
        scoring = seq.scoring(num_new)
        if len(scoring) > self._scoring:
            num_new = scoring.start - seq.num_computed + self._scoring
        return num_new

    def _capacity(self, seq: Sequence) -> int:
        """How many more tokens the sequence could hold with its blocks plus all free ones."""
        return (len(seq.block_table) + self.pool.num_free) * self.pool.block_size - seq.num_computed

    def _fit(self, seq: Sequence, num_new: int, scheduled: set[int], step: Step) -> int:
        """Shrink a prefill chunk to the free memory, or preempt to find room for one token.
        Returns the tokens to compute, 0 if ``seq`` had to give way itself."""
        while self._capacity(seq) < 1:
            victims = [s for s in self.running if s.id not in scheduled and s is not seq]
            victim = max(victims, key=lambda s: s.order) if victims else None
            if victim is None or victim.order < seq.order:
                # Everyone left matters more (or nobody is left): this sequence waits instead.
                self._preempt(seq)
                step.preempted.append(seq)
                return 0
            self._preempt(victim)
            step.preempted.append(victim)
        return min(num_new, self._capacity(seq))

    def _admit(self, seq: Sequence, budget: int, step: Step) -> bool:
        first = seq.cached_tokens is None
        hits = seq.take_prefix_hits(self.pool, self.state_cache)
        wanted = self._chunk(seq, budget)
        num_new = min(wanted, self._capacity(seq))
        # With others running, only admit what fits whole: a squeezed-in chunk would just be
        # preempted again at the next block boundary. Alone, take what there is.
        if num_new < 1 or (self.running and num_new < wanted):
            seq.release(self.pool)  # give back the shared prefix blocks; try again next step
            return False
        if first:
            seq.cached_tokens = hits
        self._scoring -= len(seq.scoring(num_new))
        seq.grow(self.pool, num_new)
        if self.state_slots is not None:  # free: fewer than max_num_seqs run
            seq.state_slot = self.state_slots.take()
        seq.status = Status.RUNNING
        self.running.append(seq)
        step.work.append(Scheduled(seq, num_new))
        return True

