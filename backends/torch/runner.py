"""One engine step on the device: scheduled work -> input tensors -> forward -> sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from router.bad_words import banned_tokens
from router.engine import TokenLogprobs

from .attention import AttentionMetadata, PrefillBatcher, decode_mask, prefill_span
from .conv import conv_windows
from .kv_cache import KVCache
from .model import CausalLM
from .sampler import BatchSampler, RowSampling
from .scheduler import Scheduled, Step, StepRows
from .speculative import accepted_count, rewind
from .state import kept_boundary

if TYPE_CHECKING:
    from .cpu_decode import CpuDecoder
    from .graphs import DecodeGraphs
    from .lora import Adapters
    from .state import RecurrentState, StateCache


@dataclass(slots=True)
class Sampled:
    """A sequence's new tokens from one step: one, or with a draft up to ``len(draft) + 1`` (the
    draft tokens the model agreed with, then the token after them), and each one's logprobs."""

    work: Scheduled
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


class ModelRunner:
    """Owns the model, the KV tensors and the sampler; runs scheduled steps."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        sampler: BatchSampler,
        device: torch.device,
        eos_ids: frozenset[int],
        decoder: CpuDecoder | None = None,
        graphs: DecodeGraphs | None = None,
        adapters: Adapters | None = None,
        states: RecurrentState | None = None,
        state_cache: StateCache | None = None,
    ) -> None:
        self.model = model
        self.states = states  # linear attention's per-sequence states (state.py); None: no such layers
        self.state_cache = state_cache  # their copies at block boundaries (the prefix cache's); None: none kept
        self._placed: list[int] = []  # the hashes of the states the running step keeps inside its prompt chunks
        self.decoder = decoder  # the packed formats' one C call for steps that decode or compute short prompts
        self.graphs = graphs  # decode-only steps on static buffers (CUDA graphs)
        self.adapters = adapters  # LoRA: which rows of a step use which adapter (lora.py)
        self.kv = kv
        self.sampler = sampler
        self.device = device
        self.eos_ids = eos_ids
        # The masks a step needs: full attention's, the sliding window's, or both (Qwen2/Qwen3
        # with use_sliding_window slide on some layers only).
        self.window, self.chunked = model.spec.sliding_window, model.spec.chunked_windows  # Llama 4's: chunks
        self.full_layers, self.window_layers = model.spec.mask_kinds
        self.conv_kernel = model.spec.conv_kernel if model.spec.conv_layers else 0
        mamba = model.spec.mamba  # Mamba2 holds a prompt's time steps within a limit: which rows are prompt tokens
        self.limits_time_steps = mamba is not None and mamba.dt_limit != (0.0, float("inf"))
        bs = kv.block_size
        self._offsets = torch.arange(bs, device=device)
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._batcher = PrefillBatcher(model.spec, kv.k, kv.v, model.embed_tokens.weight.dtype)

    def prepare(self, step: Step, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.kv.block_size
        decode = [w for w in step.work if w.is_decode]
        dev = self.device
        meta = AttentionMetadata(
            self.kv.k, self.kv.v, torch.tensor(rows.slots, dtype=torch.long).to(dev, non_blocking=True)
        )
        if decode:  # the step's first rows and tables, one of each per decoding sequence
            n = meta.num_decode = len(decode)
            tables = torch.tensor(rows.tables[:n], dtype=torch.long).to(dev, non_blocking=True)
            lengths = torch.tensor(rows.lengths[:n], dtype=torch.long).to(dev, non_blocking=True)
            context = max(rows.lengths[:n])
            meta.decode_slots = (tables[:, :, None] * bs + self._offsets).view(n, -1)[:, :context]
            if self.full_layers:
                meta.decode_mask = decode_mask(lengths, context, None)
            if self.window_layers:
                meta.decode_window_mask = decode_mask(lengths, context, self.window, self.chunked)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long).to(dev, non_blocking=True)  # noqa: E731
        positions = as_tensor(rows.positions)
        if self.conv_kernel:  # LFM2: every row's window of convolution inputs
            meta.conv_slots, meta.conv_valid = conv_windows(positions, as_tensor(rows.tables), as_tensor(rows.table_of),
                                                            bs, self.conv_kernel)
        if self.limits_time_steps:
            meta.prompt_rows = torch.tensor(
                [p < step.work[j].seq.num_prompt for p, j in zip(rows.positions, rows.table_of)]).to(dev, non_blocking=True)
        if self.states is not None:  # each sequence's state slot, zeroed where it starts from its first token
            meta.states = self.states
            meta.state_slots = as_tensor([w.seq.state_slot for w in step.work])
            fresh = [w.seq.state_slot for w in step.work if w.seq.num_computed == 0]
            if fresh:
                self.states.reset(as_tensor(fresh))
            restored = [(w.seq.restore_from, w.seq.state_slot) for w in step.work if w.seq.restore_from is not None]
            if restored:  # prefix hits: the state after the cached blocks (copied before any is replaced below)
                self.state_cache.restore(restored)
                for w in step.work:
                    w.seq.restore_from = None
        row, chunks = len(decode), step.work[len(decode) :]
        contexts = [w.seq.num_computed + w.num_new for w in chunks]
        for w, context in zip(chunks, contexts):
            meta.prefills.append(prefill_span(row, w.seq.block_table, w.num_new, context, self._offsets,
                                              self.full_layers, self.window_layers, self.window, self.chunked))
            row += w.num_new
        meta.prefill_batches = self._batcher(meta.prefills, contexts, [w.seq.block_table for w in chunks], self._offsets)
        if self.state_cache is not None:
            self._keep_states(chunks, meta)
        meta.wanted_rows = rows.out_rows
        return as_tensor(rows.ids), positions, meta, as_tensor(rows.out_rows)

    def _keep_states(self, chunks: list[Scheduled], meta: AttentionMetadata) -> None:
        """The states each prompt chunk keeps: at the last block boundary inside it
        (state.kept_boundary), and at the end of the blocks it shares with an earlier prompt
        (Sequence.shared_boundary); placed in the prefix cache's slots for the layers to copy
        there as they pass them."""
        bs, kept = self.kv.block_size, []
        for j, w in enumerate(chunks):
            seq = w.seq
            start, end = seq.num_computed, seq.num_computed + w.num_new
            last = kept_boundary(start, end, len(seq.tokens), bs)
            shared = seq.shared_boundary if seq.shared_boundary is not None and start < seq.shared_boundary <= end else None
            # The shared boundary's state placed last: where the step has more to keep than the
            # cache has slots, the copy other prompts will start from is the last to give way.
            kept.extend((j, seq, at) for at in dict.fromkeys(at for at in (last, shared) if at is not None))
        saves = [self._kept_hash(seq, at) for _, seq, at in kept]
        targets = self.state_cache.place(saves)
        for (j, seq, at), (block_hash, _), target in zip(kept, saves, targets):
            self._owned(seq, at, block_hash, target)
            if target is not None:
                meta.prefills[j].keeps += ((at - seq.num_computed, target),)
                self._placed.append(block_hash)

    @staticmethod
    def _kept_hash(seq, at: int) -> tuple[int, int | None]:
        """The hash a state kept at position ``at`` goes by, and the one it replaces: past the
        prompt, the sequence's own previous copy (only its latest is worth keeping)."""
        return seq.block_hash(at // seq.block_size - 1), seq.output_state if at > seq.num_prompt else None

    @staticmethod
    def _owned(seq, at: int, block_hash: int, target: int | None) -> None:
        """Past the prompt, the copy a sequence now owns: the one just placed, or none where the
        state was kept already (another sequence's copy is not its to replace)."""
        if at > seq.num_prompt:
            seq.output_state = block_hash if target is not None else None

    @torch.inference_mode()
    def run(self, step: Step) -> list[Sampled]:
        """Compute one step; advance every scheduled sequence; return the sampled tokens."""
        logits, rows = None, None
        # LoRA rows: the C decoder adds them itself once it has the adapters; captured graphs
        # know only the base weights.
        adapted = self.adapters is not None and self.adapters.select(step.work)
        decoder = self.decoder
        if decoder is not None and (not adapted or decoder.serves_adapters) and decoder.accepts(step):
            rows = StepRows.of(step.work, self.kv.block_size)
            logits = decoder.logits(step, rows, self.adapters.row_adapters(step.work) if adapted else None)
        elif not adapted and self.graphs is not None and (shape := self.graphs.shape(step)) is not None:
            # Decode rows only: each samples, none scores a prompt.
            logits = self.graphs.logits(step, shape)  # None: that shape could not be captured
        if logits is None:
            rows = StepRows.of(step.work, self.kv.block_size)
            self._placed = []
            try:
                input_ids, positions, meta, out_rows = self.prepare(step, rows)
                logits = self.model(input_ids, positions, meta, out_rows)
            except BaseException:
                if self.state_cache is not None:  # never written: nobody may start from them
                    self.state_cache.forget(self._placed)
                raise
        if rows is not None and rows.scored:
            self._score_prompts(step, rows, logits)
            logits = logits[rows.sampling]
        sampling = [w for w in step.work if w.samples]
        decoding = [w for w in step.work if w.is_decode] if self.state_cache is not None else []
        for w in step.work:
            w.seq.num_computed += w.num_new
        if decoding:
            self._save_states(decoding)
        if not sampling:
            return []
        rows = [row for w in sampling for row in self._rows(w)]
        # A seeded row draws from its sequence's generator: where a draft's rows were only partly
        # kept, the generator is rewound to the kept rows' draws (speculative.rewind).
        states = {
            j: w.seq.sampling_state.get_state()
            for j, w in enumerate(sampling)
            if w.draft and w.seq.sampling_state is not None and not w.seq.request.sampling.greedy
        }
        tokens, logprobs = self.sampler.sample(logits, rows)
        if not states and len(rows) == len(sampling):
            return [Sampled(w, [t], [lp]) for w, t, lp in zip(sampling, tokens, logprobs)]
        out, at = [], 0
        for j, w in enumerate(sampling):
            n = len(w.draft) + 1
            kept = accepted_count(tokens[at : at + n], w.draft) if w.draft else 1
            if w.draft:
                w.seq.num_computed -= n - kept  # rejected rows' keys and values are overwritten later
                if j in states and kept < n:
                    rewind(w.seq.sampling_state, states[j], kept)
            out.append(Sampled(w, tokens[at : at + kept], logprobs[at : at + kept]))
            at += n
        return out

    def _save_states(self, decoding: list[Scheduled]) -> None:
        """Keep the states of the step's decoding sequences whose computed tokens now end a block
        (state.StateCache; prompt chunks kept theirs as they ran, :meth:`_keep_states`)."""
        bs = self.kv.block_size
        ending = [w.seq for w in decoding if w.seq.num_computed % bs == 0]
        saves = [(seq.state_slot, *self._kept_hash(seq, seq.num_computed)) for seq in ending]
        for seq, (_, block_hash, _), target in zip(ending, saves, self.state_cache.save(saves)):
            self._owned(seq, seq.num_computed, block_hash, target)

    def _score_prompts(self, step: Step, rows: StepRows, logits: torch.Tensor) -> None:
        """Prompt logprobs: the logits of position p give prompt token p + 1's entry."""
        at = [i for i, _, _ in rows.scored]
        seqs = [step.work[j].seq for _, j, _ in rows.scored]
        targets = [seq.tokens[p + 1] for seq, (_, _, p) in zip(seqs, rows.scored)]
        ks = [seq.request.prompt_logprobs for seq in seqs]
        entries = self.sampler.score(logits[at], targets, ks)
        for seq, entry in zip(seqs, entries):
            seq.prompt_logprobs.append(entry)  # positions arrive in order: see Sequence.scoring

    def _allowed_mask(self, ids: tuple[int, ...]) -> torch.Tensor:
        """The bool mask of ``allowed_token_ids`` (one per distinct set: requests repeat them)."""
        mask = self._masks.get(ids)
        if mask is None:
            if len(self._masks) >= 64:
                self._masks.clear()
            mask = self._masks[ids] = torch.zeros(self.sampler.vocab_size, dtype=torch.bool)
            mask[list(ids)] = True
        return mask

    def _rows(self, w: Scheduled) -> list[RowSampling]:
        """The sampling rows of a sequence: one, or one per drafted token plus one, row ``i``
        sampling as if the draft's first ``i`` tokens had been generated."""
        seq = w.seq
        req = seq.request
        params = req.sampling
        if params.seed is not None and seq.sampling_state is None:
            seq.sampling_state = torch.Generator(device=self.device).manual_seed(params.seed % (2**63))
        allowed = [None] * (len(w.draft) + 1)
        if req.constraint is not None:  # the grammar's mask at each row (the draft is one it accepts)
            # (None: any token, as while a thinking model reasons before its grammar begins)
            masks = req.constraint.allowed_along(w.draft)
            allowed = [None if mask is None else torch.from_numpy(mask) for mask in masks]
        elif params.allowed_token_ids is not None:
            allowed = [self._allowed_mask(params.allowed_token_ids)] * len(allowed)
        output, prompt = seq.output_ids, seq.prompt_ids
        rows = []
        for i in range(len(w.draft) + 1):
            so_far = output + w.draft[:i] if i else output
            suppress = frozenset()
            if seq.num_output + i < req.min_tokens:
                suppress = self.eos_ids | req.stop_token_ids
            if req.bad_words:
                suppress = suppress | banned_tokens(req.bad_words, so_far)
            rows.append(
                RowSampling(
                    params=params,
                    generator=seq.sampling_state,
                    output_ids=so_far,
                    prompt_ids=prompt,
                    suppress=suppress,
                    allowed=allowed[i],
                )
            )
        return rows
