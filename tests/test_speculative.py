"""Speculative decoding's pieces without a model: n-gram drafts, acceptance, the generator's
rewind, the scheduler's drafts and the rows a draft gives a step."""

from __future__ import annotations

import random
import re

import msgspec
import pytest
import torch

from backends.torch import SpeculativeConfig, TorchConfig
from backends.torch.kv_cache import BlockPool
from backends.torch.scheduler import Scheduled, Scheduler, StepRows
from backends.torch.sequence import Sequence
from backends.torch.setup import speculative_options
from backends.torch.speculative import NgramOptions, NgramProposer, accepted_count, rewind, token_array
from router.engine import EngineRequest, SamplingParams

BS = 4


def proposer(k=3, min_n=1, max_n=3, by_batch=None) -> NgramProposer:
    return NgramProposer(NgramOptions(k, min_n, max_n, by_batch))


def reference(tokens, k, min_n, max_n, limit=99, before=None):
    """The definition, by brute force: longest n first, the most recent earlier occurrence
    (with ``before``: the most recent that ends before that position)."""
    k = min(k, limit)
    if k < 1:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix and (before is None or start + n <= before):
                return tokens[start + n : start + n + k]
    return []


# --- drafts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([1, 2, 3, 4], []),  # the last token never occurred before
        ([5, 6, 7, 5], [6, 7, 5]),  # a 1-gram: what followed the earlier 5
        ([1, 2, 9, 8, 2, 7, 6, 1, 2], [9, 8, 2]),  # the 2-gram [1, 2] beats the later 1-gram [2]
        ([1, 2, 3, 1, 2, 4, 1, 2], [4, 1, 2]),  # two occurrences: the most recent one
        ([4, 4, 4, 4], [4]),  # a run: the most recent window leaves one token to follow
        ([1, 2, 1, 2, 1, 2], [1, 2]),  # a loop: the 3-gram [2, 1, 2] at 1 is followed by [1, 2]
        ([7], []),  # too short
        ([3, 3], [3]),
    ],
)
def test_ngram_drafts(tokens, expected):
    assert proposer().propose(tokens, 10) == expected
    assert expected == reference(tokens, 3, 1, 3)


def test_min_n_ignores_shorter_matches():
    tokens = [1, 2, 9, 8, 3, 2]  # only the 1-gram [2] occurred before
    assert proposer(min_n=1).propose(tokens, 10) == [9, 8, 3]
    assert proposer(min_n=2).propose(tokens, 10) == []


def test_max_n_caps_the_match_length():
    # [1, 2, 3] occurred at 0 (followed by 7); the 2-gram [2, 3] also at 5 (followed by 8).
    tokens = [1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3]
    assert proposer(max_n=3).propose(tokens, 10) == [7, 0, 2]
    assert proposer(max_n=2).propose(tokens, 10) == [8, 1, 2]


def test_draft_length_is_the_smaller_of_k_and_the_limit():
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert proposer(k=3).propose(tokens, 10) == [2, 3, 4]
    assert proposer(k=3).propose(tokens, 2) == [2, 3]
    assert proposer(k=3).propose(tokens, 0) == []
    assert proposer(k=3).propose(tokens, -1) == []


def test_drafts_equal_the_brute_force_definition_on_random_sequences():
    rng = random.Random(0)
    for trial in range(600):
        alphabet = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))]
        k, min_n = rng.randrange(1, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 4)
        limit = rng.randrange(0, 8)
        before = rng.choice([None, rng.randrange(0, len(tokens) + 1)])
        got = proposer(k, min_n, max_n).propose(tokens, limit, before=before)
        assert got == reference(tokens, k, min_n, max_n, limit, before), (trial, tokens, k, min_n, max_n, limit, before)


def test_a_lookup_confined_to_the_prompt():
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 1, 2]  # a prompt of 4, then [1, 2] again in the output
    assert proposer().propose(tokens, 10) == [4, 7, 1]
    assert proposer().propose(tokens, 10, before=4) == [3, 9, 1]
    assert proposer().propose(tokens, 10, before=1) == []  # [2] must end inside the prompt too


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="min <= max"):
        proposer(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        proposer(k=0)


def test_disable_by_batch_size():
    p = proposer(by_batch=4)
    assert p.active(3) and not p.active(4)
    assert proposer().active(1000)


def test_token_array_follows_the_tokens_appended():
    s = decoding_seq([1, 2, 3])
    assert token_array(s).tolist() == [1, 2, 3]
    for t in range(100):  # past the first buffer's 64
        s.tokens.append(t)
        assert token_array(s).tolist() == s.tokens
    assert proposer().propose(token_array(s), 3) == proposer().propose(s.tokens, 3)


# --- acceptance ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampled, draft, kept",
    [
        ([5, 9, 9], [6, 9], 1),  # the first row already differs: its token, nothing more
        ([6, 8, 9], [6, 9], 2),  # the first drafted token kept, then the model's own
        ([6, 9, 4], [6, 9], 3),  # all kept, plus the token after them
        ([3], [], 1),
    ],
)
def test_accepted_count(sampled, draft, kept):
    assert accepted_count(sampled, draft) == kept


def test_rewind_leaves_the_generator_as_the_kept_draws_would():
    g = torch.Generator().manual_seed(11)
    state = g.get_state()
    drawn = [torch.rand(1, generator=g).item() for _ in range(4)]
    rewind(g, state, 2)
    assert torch.rand(1, generator=g).item() == drawn[2]
    rewind(g, state, 0)
    assert torch.rand(1, generator=g).item() == drawn[0]


def test_draft_sizes_follow_each_sequence_record():
    p = proposer(k=5)
    a, b = decoding_seq([1]), decoding_seq([2])
    assert p.size_for(a) == 5
    p.record(a, 5, 2)  # a miss: one shorter
    p.record(a, 4, 0)
    assert p.size_for(a) == 3 and p.size_for(b) == 5
    p.record(a, 3, 3)  # kept whole: two longer, up to num_tokens
    assert p.size_for(a) == 5
    p.record(a, 5, 5)
    assert p.size_for(a) == 5
    for _ in range(6):
        p.record(b, 1, 0)
    assert p.size_for(b) == 1  # never below one
    assert (p.drafts, p.draft_tokens, p.accepted_tokens) == (10, 23, 10)
    p.adaptive = False
    assert p.size_for(b) == 5


def test_the_scheduler_drafts_what_the_record_allows():
    sched = scheduler(k=3)
    s = decoding_seq([5, 6, 7, 8, 9])
    admit_and_prefill(sched, [s])
    s.draft_size = 1
    assert sched.schedule().work[0].draft == [6]


# --- config -----------------------------------------------------------------------------------


def spec_config(**fields):
    return msgspec.convert({"method": "ngram", "num_speculative_tokens": 4, **fields}, SpeculativeConfig)


def test_lookup_sizes_default_to_each_other_or_to_five():
    assert (spec_config().prompt_lookup_min, spec_config().prompt_lookup_max) == (5, 5)
    got = spec_config(prompt_lookup_max=3)
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == (3, 3)
    got = spec_config(prompt_lookup_min=2)
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == (2, 2)
    options = speculative_options(spec_config(prompt_lookup_min=2, prompt_lookup_max=4, disable_by_batch_size=8))
    assert options == NgramOptions(num_tokens=4, min_n=2, max_n=4, disable_by_batch_size=8)
    assert speculative_options(None) is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min (4) is above prompt_lookup_max (2)"),
        ({"method": "eagle"}, "Invalid enum value 'eagle'"),
        ({"num_speculative_tokens": 0}, "Expected `int` >= 1"),
        ({"model": "x"}, '`model` is for method "draft_model"'),
        ({"speculative_model": "x"}, "unknown field `speculative_model`"),
    ],
)
def test_bad_configs_name_their_field(fields, message):
    entry = {"name": "m", "backend": "torch", "path": "x", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, **fields}}
    with pytest.raises(msgspec.ValidationError, match=re.escape(message)) as info:
        msgspec.convert(entry, TorchConfig)
    assert "speculative_config" in str(info.value)


# --- scheduling and rows ----------------------------------------------------------------------


class Grammar:
    """Stands for a structured-outputs constraint: the tokens it forces from here, and how many
    of a draft it would take (``accepting``; None: all of it)."""

    def __init__(self, forced=(), accepting=None) -> None:
        self._forced, self.accepting = list(forced), accepting
        self.checked: list[list[int]] = []

    def forced(self) -> list[int]:
        return list(self._forced)

    def accepts(self, tokens: list[int]) -> int:
        self.checked.append(list(tokens))
        return len(tokens) if self.accepting is None else min(self.accepting, len(tokens))


def decoding_seq(tokens, max_tokens=50, constraint=None) -> Sequence:
    req = EngineRequest("r", list(tokens), SamplingParams(), max_tokens, constraint=constraint)
    seq = Sequence(req, lambda _: None, BS)
    return seq


def scheduler(blocks=64, budget=64, k=3, by_batch=None) -> Scheduler:
    return Scheduler(BlockPool(blocks, BS), max_num_seqs=8, max_batched_tokens=budget, proposer=proposer(k, 1, 2, by_batch))


def admit_and_prefill(sched: Scheduler, seqs, first_token=5):
    """Run the prompts through (no drafts while prefilling) and sample ``first_token`` for each."""
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert all(not w.draft for w in step.work)
    for w in step.work:
        w.seq.num_computed += w.num_new
        w.seq.tokens.append(first_token)


def test_a_decoding_sequence_gets_a_draft_and_its_rows_all_sample():
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9])
    admit_and_prefill(sched, [s])  # tokens: 5 6 7 8 9 5 -> the 5 at 0 was followed by 6 7 8
    step = sched.schedule()
    (w,) = step.work
    assert w.draft == [6, 7, 8] and w.num_new == 4 and w.samples and not w.is_decode
    rows = StepRows.of(step.work, BS)
    assert rows.ids == [5, 6, 7, 8] and rows.positions == [5, 6, 7, 8]
    assert rows.out_rows == [0, 1, 2, 3] and rows.sampling == [0, 1, 2, 3]
    assert rows.slots == [s.block_table[p // BS] * BS + p % BS for p in range(5, 9)]
    assert len(s.block_table) == 3  # room for positions up to 8


def test_drafts_stay_within_max_tokens_and_the_budget():
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9], max_tokens=10)
    admit_and_prefill(sched, [s])
    sched.max_batched_tokens = 3
    assert sched.schedule().work[0].draft == [6, 7]  # the budget: 3 rows
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9], max_tokens=3)
    admit_and_prefill(sched, [s])  # one output token so far: two more at most, one drafted
    assert sched.schedule().work[0].draft == [6]
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9], max_tokens=2)
    admit_and_prefill(sched, [s])
    assert sched.schedule().work[0].draft == []


def test_drafts_take_only_free_memory_and_never_preempt():
    sched = scheduler(blocks=2)
    s = decoding_seq([5, 6, 7, 8, 9, 1, 2])  # 7 tokens + 1 sampled: the two blocks hold 8
    admit_and_prefill(sched, [s])
    step = sched.schedule()
    assert step.work[0].draft == [] and step.work[0].num_new == 1 and not step.preempted
    sched = scheduler(blocks=5)
    a, b = decoding_seq([5, 6, 7, 8, 9, 1]), decoding_seq([3, 5, 2, 8, 1, 9])
    admit_and_prefill(sched, [a, b])  # 6 computed each, in 2 blocks each: one block left
    step = sched.schedule()
    assert not step.preempted and sched.pool.num_free == 0
    # a's draft takes the free block (positions 8 and 9); b's own second block ends at 7.
    assert [(w.seq, w.draft) for w in step.work] == [(a, [6, 7, 8]), (b, [2])]


def test_every_sequence_gets_its_own_token_before_any_draft():
    # Memory: b's own token needs a new block, and the only free one must not go to a's draft.
    sched = scheduler(blocks=5)
    a, b = decoding_seq([5, 6, 7, 8, 9, 1]), decoding_seq([3, 5, 2, 8, 1, 9, 4, 0])
    admit_and_prefill(sched, [a, b])  # a: 7 tokens in 2 blocks; b: 9 tokens, 8 computed, 2 blocks
    step = sched.schedule()
    assert not step.preempted
    # a keeps to its own last block; b drafts into the block its own token took.
    assert {w.seq.id: w.draft for w in step.work} == {a.id: [6], b.id: [2, 8, 1]}
    # Budget: eight sequences, twelve rows: each its token first, drafts from the four left.
    sched = scheduler(budget=200, k=4)
    seqs = [decoding_seq([5, 6, 7, 8, 9, 1, 2, 3]) for _ in range(8)]
    admit_and_prefill(sched, seqs)  # 9 tokens each: a fresh block each for the next
    sched.max_batched_tokens = 12
    step = sched.schedule()
    assert sorted(w.seq.id for w in step.work) == sorted(s.id for s in seqs)
    assert [(w.seq, len(w.draft)) for w in step.work if w.draft] == [(seqs[0], 4)]  # the most important one


def test_drafts_take_fresh_blocks_only_never_cached_ones():
    sched = scheduler(blocks=4)
    s = decoding_seq([5, 6, 7, 8, 9, 1])
    admit_and_prefill(sched, [s])  # 7 tokens in 2 blocks, 2 blocks fresh
    cached = sched.pool.allocate(), sched.pool.allocate()
    for i, block in enumerate(cached):
        sched.pool.register(block, 1000 + i)
        sched.pool.release(block)  # free, but holding a cached prefix
    assert sched.pool.num_free == 2 and sched.pool.num_fresh == 0
    (w,) = sched.schedule().work
    assert w.draft == [6]  # what fits in its own last block
    assert sched.pool.lookup(1000) is not None and sched.pool.lookup(1001) is not None


def test_under_a_grammar_forced_tokens_first_and_drafts_cut_where_it_refuses():
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9], constraint=Grammar())
    admit_and_prefill(sched, [s])
    assert sched.schedule().work[0].draft == [6, 7, 8]  # nothing forced: the n-gram draft, from the prompt
    sched = scheduler()
    s = decoding_seq([1, 2, 3, 9, 8], constraint=Grammar())
    admit_and_prefill(sched, [s], first_token=1)
    s.tokens += [2, 4, 7, 1, 2]  # as if generated: [1, 2] now last occurred in the output
    s.num_computed += 5
    s.grow(sched.pool, 0)
    assert sched.schedule().work[0].draft == [3, 9, 8]  # what followed it in the prompt
    sched = scheduler()
    g = Grammar(accepting=1)
    s = decoding_seq([5, 6, 7, 8, 9], constraint=g)
    admit_and_prefill(sched, [s])
    assert sched.schedule().work[0].draft == [6]  # the grammar refuses 7: the model could not sample it
    assert g.checked == [[6, 7, 8]]
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9], constraint=Grammar(forced=[40, 41, 42, 43, 44]))
    admit_and_prefill(sched, [s])
    (w,) = sched.schedule().work
    assert w.draft == [40, 41, 42] and w.num_new == 4  # forced tokens, within num_speculative_tokens
    sched = scheduler()
    s = decoding_seq([5, 6, 7, 8, 9], max_tokens=3, constraint=Grammar(forced=[40, 41, 42]))
    admit_and_prefill(sched, [s])
    assert sched.schedule().work[0].draft == [40]  # and within max_tokens


def test_no_drafts_under_a_large_batch():
    sched = scheduler(by_batch=2)
    a, b = decoding_seq([5, 6, 7, 8, 9]), decoding_seq([5, 6, 7, 8, 9])
    admit_and_prefill(sched, [a, b])
    assert [w.draft for w in sched.schedule().work] == [[], []]


def test_trim_releases_blocks_that_held_only_rejected_rows():
    pool = BlockPool(8, BS)
    s = decoding_seq(range(6))
    s.grow(pool, 10)  # a draft's rows reached position 9: three blocks
    s.num_computed = 7  # two drafted rows kept
    s.trim(pool)
    assert len(s.block_table) == 2 and pool.num_used == 2
    s.num_computed = 8
    s.trim(pool)
    assert len(s.block_table) == 2


def test_a_step_mixes_decodes_drafts_and_prompts():
    sched = scheduler()
    plain = decoding_seq([1, 2, 3, 4])  # 4 was never seen before: no draft
    drafted = decoding_seq([5, 6, 7, 8, 9])
    admit_and_prefill(sched, [plain, drafted], first_token=5)
    late = decoding_seq([3, 3, 3])
    sched.add(late)
    step = sched.schedule()
    assert [(w.seq, w.num_new, w.draft) for w in step.work] == [
        (plain, 1, []), (drafted, 4, [6, 7, 8]), (late, 3, []),
    ]
    assert isinstance(step.work[0], Scheduled) and step.work[0].is_decode
    rows = StepRows.of(step.work, BS)
    assert rows.out_rows == [0, 1, 2, 3, 4, 7] and rows.sampling == [0, 1, 2, 3, 4, 5]
    assert rows.ids == [5, 5, 6, 7, 8, 3, 3, 3]


# --- predicted outputs --------------------------------------------------------------------------


def predicting_seq(prompt, output, prediction, max_tokens=50) -> Sequence:
    req = EngineRequest("r", list(prompt), SamplingParams(), max_tokens, prediction=list(prediction))
    seq = Sequence(req, lambda _: None, BS)
    seq.tokens += list(output)
    return seq


def test_a_prediction_is_walked_in_order():
    p = proposer(k=3)
    seq = predicting_seq([1, 2], [10], [10, 11, 12, 13, 14])
    assert p.predict(seq, 10) == [11, 12, 13] and seq.prediction_at == 1
    seq.tokens += [11, 12, 99]  # the model took two, then went its own way
    assert p.predict(seq, 10) == []
    seq.tokens += [13]  # and came back
    assert p.predict(seq, 10) == [14]
    assert p.predict(seq, 0) == []


def test_repeated_tokens_align_from_where_the_last_draft_was_taken():
    p = proposer(k=2)
    seq = predicting_seq([9], [5], [5, 1, 5, 2, 5, 3])
    assert p.predict(seq, 10) == [1, 5]  # the first 5
    seq.tokens += [1, 5]
    assert p.predict(seq, 10) == [2, 5]  # [5, 1, 5] ends at 3
    seq.tokens += [2, 5]
    assert p.predict(seq, 10) == [3]  # [5, 2, 5] ends at 5
    assert seq.prediction_at == 5


def test_only_an_n_gram_of_two_or_more_leads_back():
    p = proposer(k=3)
    seq = predicting_seq([1], [7, 8], [7, 8, 9, 1, 7])
    seq.prediction_at = 5  # drafting got to the end
    assert p.predict(seq, 10) == [9, 1, 7]  # [7, 8] occurred before: the answer repeats it
    seq = predicting_seq([1], [4, 7], [7, 8, 9, 1])
    seq.prediction_at = 3
    assert p.predict(seq, 10) == []  # a lone 7 behind the point: no


def test_no_prediction_or_no_match_drafts_nothing():
    p = proposer()
    assert p.predict(decoding_seq([1, 2, 3]), 10) == []
    assert p.predict(predicting_seq([1], [2], []), 10) == []
    assert p.predict(predicting_seq([1], [2], [3, 4]), 10) == []


def test_the_scheduler_drafts_predictions_even_without_lookup():
    predict_only = NgramProposer(NgramOptions(3, 1, 3), lookup=False)
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=64, proposer=predict_only)
    a = predicting_seq([5, 6, 7, 8, 9], [], [5, 20, 21, 22, 23])
    b = decoding_seq([5, 6, 7, 8, 9])  # no prediction: the lookup is off, so no draft
    admit_and_prefill(sched, [a, b])
    work = {w.seq.id: w for w in sched.schedule().work}
    assert (work[a.id].draft, work[a.id].predicted) == ([20, 21, 22], True)
    assert (work[b.id].draft, work[b.id].predicted) == ([], False)


def test_forced_tokens_then_the_prediction_then_the_lookup():
    sched = scheduler()
    s = predicting_seq([5, 6, 7, 8, 9], [], [5, 30, 31])
    s.request.constraint = Grammar(forced=[40])
    admit_and_prefill(sched, [s])
    (w,) = sched.schedule().work
    assert (w.draft, w.predicted) == ([40], False)
    sched = scheduler()
    s = predicting_seq([5, 6, 7, 8, 9], [], [5, 30, 31])
    admit_and_prefill(sched, [s])
    (w,) = sched.schedule().work
    assert (w.draft, w.predicted) == ([30, 31], True)
    sched = scheduler()
    s = predicting_seq([5, 6, 7, 8, 9], [], [1, 2])  # the prediction has no 5: the lookup's draft
    admit_and_prefill(sched, [s])
    (w,) = sched.schedule().work
    assert (w.draft, w.predicted) == ([6, 7, 8], False)


def test_drafts_stop_before_an_end_token_and_fall_through_to_the_next_source():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=64, proposer=proposer(k=3), eos_ids=frozenset({7}))
    s = decoding_seq([5, 6, 7, 8, 9])
    admit_and_prefill(sched, [s])
    assert sched.schedule().work[0].draft == [6]  # 6, then the EOS: the row after 6 samples it anyway
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=64, proposer=proposer(k=3), eos_ids=frozenset({7}))
    req = EngineRequest("r", [5, 6, 7, 8, 9], SamplingParams(), 50, ignore_eos=True, stop_token_ids=frozenset({8}))
    s = Sequence(req, lambda _: None, BS)
    admit_and_prefill(sched, [s])
    assert sched.schedule().work[0].draft == [6, 7]  # EOS ignored; the stop token id is an end
    sched = scheduler()
    s = predicting_seq([5, 6, 7, 8, 9], [], [5, 30, 31])
    s.request.constraint = Grammar(accepting=0)  # refuses the prediction's draft, and the lookup's
    admit_and_prefill(sched, [s])
    (w,) = sched.schedule().work
    assert (w.draft, w.predicted) == ([], False) and s.request.constraint.checked == [[30, 31], [6, 7, 8]]
