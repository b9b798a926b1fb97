"""Block pool, prefix cache and scheduler: pure bookkeeping, no model."""

from __future__ import annotations

import pytest

from backends.torch.kv_cache import BlockPool
from backends.torch.scheduler import Scheduler
from backends.torch.sequence import Sequence, Status
from router.engine import EngineRequest, SamplingParams

BS = 4


def seq(tokens, priority=0, arrival=0.0, max_tokens=8) -> Sequence:
    req = EngineRequest("r", list(tokens), SamplingParams(), max_tokens, priority=priority, arrival=arrival)
    return Sequence(req, lambda _: None, BS)


def run_step(sched: Scheduler, token: int = 7):
    """Pretend the model ran: advance computed counts and append a token to sampling seqs."""
    step = sched.schedule()
    for w in step.work:
        samples = w.samples
        w.seq.num_computed += w.num_new
        if samples:
            w.seq.tokens.append(token)
        w.seq.register_full_blocks(sched.pool)
    return step


# --- block pool ---------------------------------------------------------------------------


def test_allocate_release_and_count():
    pool = BlockPool(3, BS)
    a, b = pool.allocate(), pool.allocate()
    assert pool.num_used == 2 and pool.num_free == 1
    pool.release(a)
    pool.release(b)
    assert pool.num_used == 0


def test_exhaustion_raises():
    pool = BlockPool(1, BS)
    pool.allocate()
    with pytest.raises(MemoryError):
        pool.allocate()


def test_registered_block_is_found_and_shared_and_evicted_last_used_first():
    pool = BlockPool(2, BS)
    a = pool.allocate()
    pool.register(a, 111)
    pool.release(a)
    assert pool.num_free == 2 and pool.lookup(111) == a
    pool.share(a)
    assert pool.refs(a) == 1 and pool.num_free == 1
    pool.release(a)
    b = pool.allocate()  # the fresh block goes first
    assert b != a and pool.lookup(111) == a
    c = pool.allocate()  # now the cached one is evicted
    assert c == a and pool.lookup(111) is None


def test_prefix_caching_off():
    pool = BlockPool(2, BS, prefix_caching=False)
    a = pool.allocate()
    pool.register(a, 5)
    assert pool.lookup(5) is None


# --- sequences and the prefix cache -------------------------------------------------------


def test_prefix_hits_share_full_blocks_only_and_leave_one_token():
    pool = BlockPool(16, BS)
    s1 = seq(range(10))
    s1.grow(pool, 10)
    s1.num_computed = 10
    s1.register_full_blocks(pool)  # blocks [0..3], [4..7] full; [8, 9] not
    s2 = seq(list(range(8)) + [99, 98, 97])
    assert s2.take_prefix_hits(pool) == 8
    assert s2.block_table == s1.block_table[:2]
    # the same prompt exactly: the last full block is recomputed so that there is a token to run
    s3 = seq(range(8))
    assert s3.take_prefix_hits(pool) == 4


def test_chain_hash_depends_on_everything_before():
    pool = BlockPool(16, BS)
    s1 = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    s1.grow(pool, 9)
    s1.num_computed = 9
    s1.register_full_blocks(pool)
    other = seq([0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first
    assert other.take_prefix_hits(pool) == 0


# --- scheduler ----------------------------------------------------------------------------


def test_chunked_prefill_within_token_budget_then_decode():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=6)
    s = seq(range(14))
    sched.add(s)
    chunks = [run_step(sched).work[0].num_new for _ in range(3)]
    assert chunks == [6, 6, 2] and s.num_output == 1
    step = run_step(sched)
    assert step.work[0].num_new == 1 and step.work[0].is_decode


def test_budget_shared_decode_first():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=8)
    a = seq(range(3), arrival=0)
    sched.add(a)
    run_step(sched)  # a prefilled, sampled
    b = seq(range(20), arrival=1)
    sched.add(b)
    step = sched.schedule()
    assert [(w.seq is a, w.num_new) for w in step.work] == [(True, 1), (False, 7)]


def test_priority_orders_admission():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=1, max_batched_tokens=64)
    late_urgent = seq(range(3), priority=-10, arrival=5)
    early = seq(range(3), priority=0, arrival=1)
    sched.add(early)
    sched.add(late_urgent)
    step = sched.schedule()
    assert [w.seq for w in step.work] == [late_urgent]


def test_max_num_seqs():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=2, max_batched_tokens=64)
    for i in range(4):
        sched.add(seq(range(3), arrival=i))
    assert len(sched.schedule().work) == 2 and sched.num_waiting == 2


def test_preemption_frees_blocks_and_requeues_least_important():
    pool = BlockPool(4, BS, prefix_caching=False)  # 16 slots
    sched = Scheduler(pool, max_num_seqs=4, max_batched_tokens=64)
    a = seq(range(7), arrival=0)  # 2 blocks
    b = seq(range(7), arrival=1)  # 2 blocks
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert pool.num_free == 0 and a.num_output == b.num_output == 1
    run_step(sched)  # positions 7: still in the second block
    assert pool.num_free == 0 and a.num_output == b.num_output == 2
    run_step(sched)  # position 8 needs a third block: b (later arrival) is preempted
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0
    assert a.status is Status.RUNNING and len(a.block_table) == 3
    assert b.num_output == 2  # its generated tokens are kept and will be recomputed


def test_preempted_sequence_comes_back_through_its_cached_blocks():
    pool = BlockPool(4, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_batched_tokens=64)
    a, b = seq(range(7), arrival=0), seq(range(100, 107), arrival=1)
    sched.add(a)
    sched.add(b)
    for _ in range(2):
        run_step(sched)
    step = run_step(sched)
    assert b in step.preempted and b.status is Status.WAITING
    sched.finish(a)
    step = sched.schedule()
    # b's first block (its oldest, released last) survived in the prefix cache
    assert [(w.seq, w.num_new) for w in step.work] == [(b, 5)] and b.num_computed == 4


def test_sequence_that_cannot_fit_yields_to_more_important():
    pool = BlockPool(3, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_batched_tokens=64)
    urgent = seq(range(3), priority=-1, arrival=1)
    normal = seq(range(7), priority=0, arrival=0)
    sched.add(normal)
    sched.add(urgent)
    run_step(sched)
    assert urgent.status is Status.RUNNING


def test_finish_frees_everything():
    pool = BlockPool(16, BS)
    sched = Scheduler(pool, max_num_seqs=4, max_batched_tokens=64)
    ss = [seq(range(9), arrival=i) for i in range(3)]
    for s in ss:
        sched.add(s)
    run_step(sched)
    for s in ss:
        sched.finish(s)
    assert pool.num_used == 0 and not sched.running


def test_aborted_waiting_sequences_are_skipped():
    sched = Scheduler(BlockPool(16, BS), max_num_seqs=4, max_batched_tokens=64)
    s = seq(range(3))
    s.aborted = True
    sched.add(s)
    assert sched.schedule().work == [] and not sched.has_work()


# --- prompt logprobs -------------------------------------------------------------------------


def scoring_seq(tokens, arrival=0.0) -> Sequence:
    req = EngineRequest("r", list(tokens), SamplingParams(), 8, arrival=arrival, prompt_logprobs=0)
    return Sequence(req, lambda _: None, BS)


def run_scored_step(sched: Scheduler):
    """run_step, also recording an entry for every row that scores a prompt token."""
    from backends.torch.scheduler import StepRows
    from router.engine import TokenLogprobs

    step = sched.schedule()
    if step.work:
        rows = StepRows.of(step.work, BS)
        for _, j, p in rows.scored:
            seq = step.work[j].seq
            assert p == len(seq.prompt_logprobs)  # in order, each position once
            seq.prompt_logprobs.append(TokenLogprobs(-1.0, []))
    for w in step.work:
        samples = w.samples
        w.seq.num_computed += w.num_new
        if samples:
            w.seq.tokens.append(7)
        w.seq.register_full_blocks(sched.pool)
    return step


def test_scored_prompt_rows_are_capped_per_step():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=64, scored_rows=5)
    s = scoring_seq(range(14))  # 13 positions score the token after them
    sched.add(s)
    chunks = [run_scored_step(sched).work[0].num_new for _ in range(3)]
    assert chunks == [5, 5, 4] and s.num_output == 1 and len(s.prompt_logprobs) == 13


def test_scoring_sequences_share_the_cap_and_others_do_not_count():
    sched = Scheduler(BlockPool(64, BS), max_num_seqs=8, max_batched_tokens=64, scored_rows=5)
    plain = seq(range(20), arrival=0)
    a, b = scoring_seq(range(9), arrival=1), scoring_seq(range(30, 39), arrival=2)
    for s in (plain, a, b):
        sched.add(s)
    step = run_scored_step(sched)
    assert [(w.seq, w.num_new) for w in step.work] == [(plain, 20), (a, 5)]  # b waits for rows
    step = run_scored_step(sched)
    assert [(w.seq, w.num_new) for w in step.work] == [(plain, 1), (a, 4), (b, 2)]  # a scores 3 of its 4
    while not (a.num_output and b.num_output):
        run_scored_step(sched)
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == 8


def test_a_scoring_sequence_takes_no_prefix_hit_past_its_scores():
    pool = BlockPool(64, BS)
    sched = Scheduler(pool, max_num_seqs=8, max_batched_tokens=64)
    first = seq(range(12))
    sched.add(first)
    run_step(sched)  # its 3 blocks are now cached (2 full ones registered)
    s = scoring_seq(range(12))
    assert s.take_prefix_hits(pool) == 0
    s.release(pool)
    s.prompt_logprobs.extend([None] * 9)  # as if preempted after scoring 9 positions
    assert s.take_prefix_hits(pool) == 8  # two whole blocks of scored positions
