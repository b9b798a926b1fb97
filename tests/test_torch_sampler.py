"""The torch engine's batched sampler: each knob (as the numpy sampler), seeds, logprobs, batches
(what it shares with the numpy sampler: test_sampler_contract.py)."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.llamacpp.sampler import Sampler  # noqa: E402
from backends.torch import sampler as sampler_mod  # noqa: E402
from backends.torch.sampler import BatchSampler, RowSampling  # noqa: E402
from router.engine import SamplingParams  # noqa: E402

V = 50
rng = np.random.default_rng(0)
LOGITS = rng.normal(size=V).astype(np.float32) * 3
BEST = int(np.argmax(LOGITS))


def gen(seed):
    return None if seed is None else torch.Generator().manual_seed(seed)


def row(params, out=(), prompt=(), generator=None, **kw):
    return RowSampling(params, generator, list(out), list(prompt), **kw)


def as_batch(logits, n=1):
    return torch.as_tensor(np.asarray(logits, dtype=np.float32)).reshape(1, -1).repeat(n, 1)


def draws(params, n=200, logits=LOGITS, prompt=(), min_tokens=0, suppress=frozenset(), vocab=V):
    """``n`` steps of one sequence, generator and output carried across steps as the engine does."""
    s = BatchSampler(vocab, "cpu", seed=0)
    g = gen(params.seed)
    out: list[int] = []
    lg = as_batch(logits)
    for _ in range(n):
        r = row(params, out, prompt, g, suppress=suppress if len(out) < min_tokens else frozenset())
        out.append(s.sample(lg, [r])[0][0])
    return out


def batch_draws(params, n=3000, logits=LOGITS, vocab=V, seed=0, **kw):
    """One step of ``n`` identical unseeded rows: ``n`` draws from the shared generator."""
    s = BatchSampler(vocab, "cpu", seed=seed)
    return s.sample(as_batch(logits, n), [row(params, **kw) for _ in range(n)])[0]


def softmax(x):
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


# -- the numpy sampler's cases -------------------------------------------------------------------


def test_greedy_is_argmax():
    assert set(draws(SamplingParams(temperature=0), 5)) == {BEST}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    assert set(draws(SamplingParams(temperature=temperature, top_k=1), 50)) == {BEST}


def test_top_k_limits_the_candidates():
    top5 = set(np.argsort(LOGITS)[-5:].tolist())
    got = set(batch_draws(SamplingParams(top_k=5), 500))
    assert got == top5  # only those, and (500 draws) every one of them


def test_top_k_at_or_beyond_the_vocabulary_is_off():
    assert len(set(batch_draws(SamplingParams(top_k=V, temperature=3.0), 2000))) > 30
    assert len(set(batch_draws(SamplingParams(top_k=-1, temperature=3.0), 2000))) > 30


def test_top_p_keeps_the_nucleus():
    probs = softmax(LOGITS)
    order = np.argsort(probs)[::-1]
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5)) + 1].tolist())
    got = set(batch_draws(SamplingParams(top_p=0.5), 2000))
    assert got == nucleus


def test_min_p_drops_unlikely_tokens():
    probs = np.exp(LOGITS - LOGITS.max())
    allowed = set(np.nonzero(probs >= 0.3 * probs.max())[0].tolist())
    assert set(batch_draws(SamplingParams(min_p=0.3), 2000)) == allowed


def test_min_p_top_k_top_p_together_match_the_numpy_order():
    p = SamplingParams(temperature=1.5, min_p=0.02, top_k=12, top_p=0.8)
    x = LOGITS / 1.5
    probs = np.exp(x - x.max())
    probs[probs < 0.02 * probs.max()] = 0
    probs[probs < np.partition(probs, -12)[-12]] = 0
    kept = set(np.nonzero(Sampler._nucleus(probs, 0.8))[0].tolist())
    assert set(batch_draws(p, 4000)) == kept


def test_temperature_near_zero_is_greedy():
    assert set(batch_draws(SamplingParams(temperature=1e-4), 200)) == {BEST}


def test_logit_bias_forces_and_bans():
    assert set(draws(SamplingParams(temperature=0, logit_bias={7: 100.0}), 3)) == {7}
    assert BEST not in draws(SamplingParams(temperature=0, logit_bias={BEST: -100.0}), 3)
    assert BEST not in batch_draws(SamplingParams(temperature=0.3, logit_bias={BEST: -100.0}), 500)
    assert set(batch_draws(SamplingParams(logit_bias={7: 100.0}), 100)) == {7}


def test_min_tokens_suppresses_end_tokens_until_reached():
    logits = np.zeros(V, dtype=np.float32)
    logits[3] = 10  # the "EOS"
    got = draws(SamplingParams(temperature=0), 4, logits, min_tokens=2, suppress=frozenset({3}))
    assert 3 not in got[:2] and got[2:] == [3, 3]


def test_suppressed_ids_are_never_sampled():
    banned = frozenset(np.argsort(LOGITS)[-3:].tolist())
    got = set(batch_draws(SamplingParams(temperature=2.0), 2000, suppress=banned))
    assert got and not got & banned


def test_out_of_vocabulary_ids_are_ignored():
    logits = np.concatenate([LOGITS, np.full(6, 100.0, dtype=np.float32)])
    p = SamplingParams(temperature=0, logit_bias={V + 2: 5.0}, repetition_penalty=1.3)
    r = row(p, out=[V + 1], prompt=[V + 3], suppress=frozenset({V + 4}))
    assert BatchSampler(V, "cpu").sample(as_batch(logits), [r])[0] == [BEST]


def test_repetition_penalty_counts_the_output_too():
    logits = np.zeros(V, dtype=np.float32)
    logits[0], logits[1], logits[2] = 1.0, 0.9, 0.8
    assert draws(SamplingParams(temperature=0, repetition_penalty=1.5), 3, logits) == [0, 1, 2]


def test_logprobs_are_of_the_raw_distribution():
    r = row(SamplingParams(temperature=0, logprobs=3, logit_bias={9: 50.0}))
    (token,), (lp,) = BatchSampler(V, "cpu").sample(as_batch(LOGITS), [r])
    assert token == 9
    lse = math.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(float(LOGITS[9]) - lse, rel=1e-5)
    assert [t for t, _ in lp.top] == np.argsort(LOGITS)[::-1][:3].tolist()
    assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert lp.top[0][1] == pytest.approx(float(LOGITS.max()) - lse, rel=1e-5)


def test_sampling_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2] + [1e-9] * (V - 3), dtype=np.float32))
    got = batch_draws(SamplingParams(), 3000, logits)
    assert [got.count(i) / 3000 for i in range(3)] == pytest.approx([0.5, 0.3, 0.2], abs=0.04)
    seeded = draws(SamplingParams(seed=11), 3000, logits)
    assert [seeded.count(i) / 3000 for i in range(3)] == pytest.approx([0.5, 0.3, 0.2], abs=0.04)


def test_temperature_reshapes_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2] + [1e-12] * (V - 3), dtype=np.float32))
    got = batch_draws(SamplingParams(temperature=2.0), 4000, logits)
    want = np.sqrt([0.5, 0.3, 0.2])
    want = want / want.sum()  # the 1e-12 tail is ~1e-6 each at T=2: negligible
    assert [got.count(i) / 4000 for i in range(3)] == pytest.approx(want.tolist(), abs=0.04)


# -- batches ---------------------------------------------------------------------------------------


def other_rows(step):
    """A changing crowd around the row under test: seeded, unseeded, greedy, every feature."""
    crowd = [
        row(SamplingParams(temperature=0.8, seed=7 + step), generator=gen(7 + step)),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(top_p=0.7, logprobs=2)),
        row(SamplingParams(temperature=0, presence_penalty=0.5), out=[1, 2, 2]),
        row(SamplingParams(top_k=4, min_p=0.1), generator=gen(100)),
        row(SamplingParams(temperature=1.3, repetition_penalty=1.2), prompt=[3, 4]),
    ]
    return crowd[: 3 + step % 4]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1234),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.01, seed=99),
        SamplingParams(temperature=1.1, frequency_penalty=0.3, logprobs=1, seed=5),
    ],
)
def test_seeded_row_ignores_its_batch(params):
    vocab = 1000
    step_logits = torch.from_numpy(np.random.default_rng(3).normal(size=(30, vocab)).astype(np.float32) * 2)

    def run(in_crowd):
        s = BatchSampler(vocab, "cpu", seed=int(in_crowd))
        g, out = gen(params.seed), []
        for step in range(30):
            me = row(params, out, prompt=[1, 2, 3], generator=g)
            rows = [me]
            if in_crowd:
                rows = other_rows(step)
                rows.insert(3, me)
            logits = step_logits[step].repeat(len(rows), 1)
            logits += torch.randn(logits.shape) * (torch.arange(len(rows)) != rows.index(me)).unsqueeze(1)
            out.append(s.sample(logits, rows)[0][rows.index(me)])
        return out

    alone = run(False)
    assert alone == run(True)
    assert len(set(alone)) > 5  # really sampled


def test_generators_advance_one_draw_per_sampled_step_and_not_when_greedy():
    s = BatchSampler(V, "cpu", seed=0)
    g_sampled, g_greedy, mirror = gen(5), gen(6), gen(5)
    untouched = g_greedy.get_state().clone()
    rows = [row(SamplingParams(seed=5), generator=g_sampled), row(SamplingParams(temperature=0, seed=6), generator=g_greedy)]
    s.sample(as_batch(LOGITS, 2), rows)
    torch.rand(1, generator=mirror)
    assert torch.equal(g_sampled.get_state(), mirror.get_state())
    assert torch.equal(g_greedy.get_state(), untouched)


def test_engine_seed_reproduces_unseeded_rows():
    p = SamplingParams(temperature=1.0)
    assert batch_draws(p, 200, seed=3) == batch_draws(p, 200, seed=3)
    assert batch_draws(p, 200, seed=3) != batch_draws(p, 200, seed=4)


def test_rows_with_different_top_k_in_one_batch():
    s = BatchSampler(V, "cpu", seed=0)
    rows = [row(SamplingParams(top_k=2 if i % 2 else 10, temperature=5.0)) for i in range(2000)]
    got = s.sample(as_batch(LOGITS, 2000), rows)[0]
    order = np.argsort(LOGITS)[::-1]
    assert set(got[1::2]) == set(order[:2].tolist())
    assert set(got[0::2]) == set(order[:10].tolist())


def test_rows_with_different_top_p_and_min_p_in_one_batch():
    s = BatchSampler(V, "cpu", seed=0)
    kinds = [SamplingParams(top_p=0.3), SamplingParams(top_p=0.95), SamplingParams(min_p=0.5), SamplingParams()]
    rows = [row(kinds[i % 4]) for i in range(4000)]
    got = s.sample(as_batch(LOGITS, 4000), rows)[0]
    probs = np.exp(LOGITS - LOGITS.max())
    for j, p in enumerate(kinds):
        if p.top_p < 1:
            want = set(np.nonzero(Sampler._nucleus(probs.copy(), p.top_p))[0].tolist())
        else:
            want = set(np.nonzero(probs >= p.min_p * probs.max())[0].tolist())
        assert set(got[j::4]) <= want
    assert len(set(got[1::4])) > len(set(got[0::4]))


def test_allowed_mask_restricts_only_its_row():
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[4, 9, 20]] = True
    s = BatchSampler(V, "cpu", seed=0)
    rows = [row(SamplingParams(temperature=0), allowed=allowed), row(SamplingParams(temperature=0))]
    rows += [row(SamplingParams(temperature=3.0), allowed=allowed) for _ in range(500)]
    got = s.sample(as_batch(LOGITS, len(rows)), rows)[0]
    assert got[0] == max([4, 9, 20], key=lambda t: LOGITS[t])
    assert got[1] == BEST
    assert set(got[2:]) == {4, 9, 20}


def test_row_with_every_token_masked_stays_in_range():
    nothing = torch.zeros(V, dtype=torch.bool)
    s = BatchSampler(V, "cpu", seed=0)
    rows = [row(SamplingParams(temperature=t, top_p=0.9), allowed=nothing) for t in (0.0, 1.0)]
    assert all(0 <= t < V for t in s.sample(as_batch(LOGITS, 2), rows)[0])


def test_mixed_batch_rows_match_each_row_alone():
    vocab = 500
    rs = np.random.default_rng(7)
    allowed = torch.from_numpy(rs.random(vocab) < 0.2)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=4),
        SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.4, logprobs=0),
        SamplingParams(temperature=0, repetition_penalty=1.4, logit_bias={11: 3.0, 12: -50.0}),
        SamplingParams(temperature=0.9, top_p=0.8, seed=21, logprobs=2),
        SamplingParams(temperature=1.2, top_k=30, min_p=0.05, seed=22, frequency_penalty=0.5),
        SamplingParams(temperature=1.0),  # unseeded: only checked for range and logprob
        SamplingParams(top_k=1, temperature=0.7, logprobs=1),
    ]
    extras = [{}, {}, {}, {}, {"suppress": frozenset({1, 2, 3})}, {"allowed": allowed}, {}, {}]
    prompt = rs.integers(0, vocab, size=40).tolist()
    state = [(gen(p.seed), []) for p in kinds]
    alone_state = [(gen(p.seed), []) for p in kinds]
    s_batch, s_alone = BatchSampler(vocab, "cpu", seed=1), BatchSampler(vocab, "cpu", seed=2)
    for _ in range(12):
        logits = torch.from_numpy(rs.normal(size=(len(kinds), vocab)).astype(np.float32) * 3)
        rows = [row(p, out, prompt, g, **kw) for p, (g, out), kw in zip(kinds, state, extras)]
        tokens, lps = s_batch.sample(logits, rows)
        for i, (p, kw) in enumerate(zip(kinds, extras)):
            g, out = alone_state[i]
            (t,), (lp,) = s_alone.sample(logits[i : i + 1].clone(), [row(p, out, prompt, g, **kw)])
            raw_lp = torch.log_softmax(logits[i].double(), -1)
            assert 0 <= tokens[i] < vocab
            if p.greedy or p.seed is not None:
                assert tokens[i] == t, (i, p)
            if p.logprobs is None:
                assert lps[i] is None and lp is None
            else:
                assert lps[i].logprob == pytest.approx(float(raw_lp[tokens[i]]), abs=1e-4)
                assert len(lps[i].top) == p.logprobs
                if p.greedy or p.seed is not None:
                    assert lps[i].logprob == pytest.approx(lp.logprob, abs=1e-5)
                    assert [v for _, v in lps[i].top] == pytest.approx([v for _, v in lp.top], abs=1e-5)
            out.append(t)
            state[i][1].append(tokens[i])
        assert 12 not in tokens[3:4] and not {1, 2, 3} & {tokens[4]} and bool(allowed[tokens[5]])


def test_padded_logit_columns_are_never_chosen():
    pad = np.full(14, 1e4, dtype=np.float32)
    logits = as_batch(np.concatenate([LOGITS, pad]), 6)
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, logprobs=5)),
        row(SamplingParams(temperature=2.0)),
        row(SamplingParams(top_p=0.99, seed=3), generator=gen(3)),
        row(SamplingParams(top_k=60, temperature=5.0, logprobs=V + 10)),
        row(SamplingParams(temperature=0, frequency_penalty=1.0), out=[BEST]),
    ]
    s = BatchSampler(V, "cpu", seed=0)
    for _ in range(20):
        tokens, lps = s.sample(logits, rows)
        assert all(0 <= t < V for t in tokens)
        assert tokens[0] == BEST
        assert all(t < V for lp in lps if lp for t, _ in lp.top)
    assert len(lps[4].top) == V


def test_greedy_fast_path_returns_python_ints():
    s = BatchSampler(V, "cpu")
    logits = torch.from_numpy(np.random.default_rng(1).normal(size=(5, V + 3)).astype(np.float32))
    tokens, lps = s.sample(logits, [row(SamplingParams(temperature=0)) for _ in range(5)])
    assert tokens == logits[:, :V].argmax(-1).tolist()
    assert all(type(t) is int for t in tokens) and lps == [None] * 5


def test_bf16_logits():
    logits = as_batch(LOGITS, 4).to(torch.bfloat16)
    as_f32 = logits[0].float().numpy()
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, logprobs=2, presence_penalty=0.1), out=[0]),
        row(SamplingParams(top_p=0.9, seed=1), generator=gen(1)),
        row(SamplingParams(top_k=3)),
    ]
    tokens, lps = BatchSampler(V, "cpu", seed=0).sample(logits, rows)
    assert tokens[0] == int(np.argmax(as_f32))
    assert all(type(t) is int and 0 <= t < V for t in tokens)
    assert tokens[3] in set(np.argsort(as_f32)[-3:].tolist())
    raw_lp = torch.log_softmax(torch.from_numpy(as_f32).double(), -1)
    assert lps[1].logprob == pytest.approx(float(raw_lp[tokens[1]]), abs=1e-5)


def test_empty_batch_and_bad_shapes():
    s = BatchSampler(V, "cpu")
    assert s.sample(torch.zeros(0, V), []) == ([], [])
    with pytest.raises(ValueError):
        s.sample(torch.zeros(2, V - 1), [row(SamplingParams()), row(SamplingParams())])
    with pytest.raises(ValueError):
        s.sample(torch.zeros(1, V), [row(SamplingParams()), row(SamplingParams())])


@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_penalties_and_bias_equals_the_numpy_sampler(seed):
    rs = np.random.default_rng(seed)
    vocab = 300
    params = SamplingParams(
        temperature=0,
        presence_penalty=float(rs.uniform(0, 1)),
        frequency_penalty=float(rs.uniform(0, 1)),
        repetition_penalty=float(rs.uniform(1, 1.6)),
        logit_bias={int(t): float(rs.uniform(-5, 5)) for t in rs.integers(0, vocab, size=8)},
        logprobs=3,
    )
    prompt = rs.integers(0, vocab, size=30).tolist()
    ref = Sampler(params, vocab, prompt, min_tokens=3, suppress_until_min=frozenset({0, 1}))
    s = BatchSampler(vocab, "cpu")
    out: list[int] = []
    for _ in range(25):
        # few distinct values, so the penalties keep deciding the argmax
        logits = (rs.integers(0, 6, size=vocab) * 0.5).astype(np.float32)
        want, want_lp = ref.sample(logits)
        r = row(params, out, prompt, suppress=frozenset({0, 1}) if len(out) < 3 else frozenset())
        (got,), (got_lp,) = s.sample(as_batch(logits), [r])
        assert got == want
        assert got_lp.logprob == pytest.approx(want_lp.logprob, abs=1e-5)
        assert [v for _, v in got_lp.top] == pytest.approx([v for _, v in want_lp.top], abs=1e-5)
        out.append(got)


# -- the nucleus search, probes and fallbacks ------------------------------------------------------


@pytest.mark.parametrize(("vocab", "scale", "top_p"), [(100, 3.0, 0.9), (2000, 0.05, 0.5), (6000, 0.01, 0.9), (3000, 2.0, 0.999)])
def test_nucleus_cut_equals_the_numpy_nucleus(vocab, scale, top_p):
    rs = np.random.default_rng(vocab)
    probs = np.exp(rs.normal(size=(4, vocab)) * scale).astype(np.float32)
    probs /= probs.max(axis=1, keepdims=True)
    cut = sampler_mod._nucleus_cut(torch.from_numpy(probs.copy()), torch.full((4,), top_p))
    for i in range(4):
        want = set(np.nonzero(Sampler._nucleus(probs[i].copy(), top_p))[0].tolist())
        got = set(np.nonzero(probs[i] >= cut[i].item())[0].tolist())
        assert got == want


def test_wide_nucleus_is_sampled_beyond_the_probes():
    vocab = 2000
    logits = -np.arange(vocab, dtype=np.float32) * 0.001  # near-flat: the nucleus is ~1000 wide
    got = batch_draws(SamplingParams(top_p=0.5), 1500, logits, vocab=vocab)
    order = np.argsort(logits)[::-1]
    mass = np.cumsum(softmax(logits)[order])
    width = int(np.searchsorted(mass, 0.5)) + 1
    assert width > 512 and max(got) < width and max(got) > 512


def test_nucleus_ends_at_the_first_token_reaching_top_p():
    probs = torch.tensor([[1.0, 0.5, 0.25, 0.125, 0.125]])  # mass 0.5, 0.75, 0.875, ...
    assert sampler_mod._nucleus_cut(probs, torch.tensor([0.75])).tolist() == [0.5]
    assert np.nonzero(Sampler._nucleus(probs[0].numpy().copy(), 0.75))[0].tolist() == [0, 1]


def test_tokens_tied_at_the_top_k_or_top_p_cut_are_all_kept():
    logits = np.full(V, -5.0, dtype=np.float32)
    logits[[3, 8, 21]] = 2.0
    ref = Sampler(SamplingParams(top_k=2, seed=1), V, [])
    assert {ref.sample(logits)[0] for _ in range(300)} == {3, 8, 21}  # the numpy sampler too
    assert set(batch_draws(SamplingParams(top_k=2), 600, logits)) == {3, 8, 21}
    # numpy would keep one of the three (whichever its sort puts first); ties are kept here
    assert set(batch_draws(SamplingParams(top_p=0.2), 600, logits)) == {3, 8, 21}


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_engine_seed_range_is_any_64_bit_integer(seed):
    # the runner folds request seeds into torch's range the same way
    g = torch.Generator().manual_seed(seed % (2**63))
    assert isinstance(torch.rand(1, generator=g).item(), float)
