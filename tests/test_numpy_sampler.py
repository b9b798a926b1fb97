"""The CPU sampler the llama.cpp backend uses: each knob, seeds, logprobs (what it shares with the
torch sampler: test_sampler_contract.py)."""

import math

import numpy as np
import pytest

from backends.llamacpp.sampler import Sampler
from router.engine import SamplingParams

V = 50
rng = np.random.default_rng(0)
LOGITS = rng.normal(size=V).astype(np.float32) * 3


def draws(params, n=200, logits=LOGITS, prompt=(), **kw):
    s = Sampler(params, V, list(prompt), **kw)
    return [s.sample(logits)[0] for _ in range(n)]


def test_greedy_is_argmax():
    assert set(draws(SamplingParams(temperature=0), 5)) == {int(np.argmax(LOGITS))}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    assert set(draws(SamplingParams(temperature=temperature, top_k=1), 50)) == {int(np.argmax(LOGITS))}


def test_top_k_limits_the_candidates():
    top5 = set(np.argsort(LOGITS)[-5:].tolist())
    assert set(draws(SamplingParams(top_k=5, seed=1), 300)) <= top5


def test_top_p_keeps_the_nucleus():
    probs = np.exp(LOGITS - LOGITS.max())
    probs /= probs.sum()
    order = np.argsort(probs)[::-1]
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5)) + 1].tolist())
    got = set(draws(SamplingParams(top_p=0.5, seed=3), 400))
    assert got <= nucleus and len(got) >= 1


def test_min_p_drops_unlikely_tokens():
    probs = np.exp(LOGITS - LOGITS.max())
    allowed = set(np.nonzero(probs >= 0.3 * probs.max())[0].tolist())
    assert set(draws(SamplingParams(min_p=0.3, seed=5), 300)) <= allowed


def test_logit_bias_forces_and_bans():
    assert set(draws(SamplingParams(temperature=0, logit_bias={7: 100.0}), 3)) == {7}
    best = int(np.argmax(LOGITS))
    assert best not in draws(SamplingParams(temperature=0, logit_bias={best: -100.0}), 3)


def test_min_tokens_suppresses_end_tokens_until_reached():
    logits = np.zeros(V, dtype=np.float32)
    logits[3] = 10  # the "EOS"
    got = draws(SamplingParams(temperature=0), 4, logits, min_tokens=2, suppress_until_min=frozenset({3}))
    assert got[:2] != [3, 3] and 3 not in got[:2] and got[2:] == [3, 3]


def test_logprobs_are_of_the_raw_distribution():
    s = Sampler(SamplingParams(temperature=0, logprobs=3, logit_bias={9: 50.0}), V, [])
    token, lp = s.sample(LOGITS)
    assert token == 9
    lse = math.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(float(LOGITS[9]) - lse, rel=1e-5)
    assert [t for t, _ in lp.top] == np.argsort(LOGITS)[::-1][:3].tolist()
    assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_sampling_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2] + [1e-9] * (V - 3), dtype=np.float32))
    got = draws(SamplingParams(seed=11), 3000, logits)
    freq = [got.count(i) / len(got) for i in range(3)]
    assert freq == pytest.approx([0.5, 0.3, 0.2], abs=0.04)


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 0])
def test_any_64_bit_seed_works_and_reproduces(seed):
    a = draws(SamplingParams(seed=seed), 20)
    assert a == draws(SamplingParams(seed=seed), 20)
