"""What both engines' samplers must agree on, checked on each with the same cases: the numpy
sampler (llama.cpp backend) and the batched torch sampler (torch engine), each driven step by step
as its engine drives it (the ``draws`` of its own test module)."""

import numpy as np
import pytest

pytest.importorskip("torch")

from router.engine import SamplingParams  # noqa: E402
from test_numpy_sampler import draws as numpy_draws  # noqa: E402
from test_torch_sampler import draws as torch_draws  # noqa: E402

V = 50
each_sampler = pytest.mark.parametrize("draws", [numpy_draws, torch_draws], ids=["numpy", "torch"])


@each_sampler
def test_same_seed_same_tokens_different_seed_differs(draws):
    a = draws(SamplingParams(temperature=1.0, seed=42), 50)
    b = draws(SamplingParams(temperature=1.0, seed=42), 50)
    c = draws(SamplingParams(temperature=1.0, seed=43), 50)
    assert a == b and a != c


@each_sampler
def test_frequency_and_presence_penalties_push_away_repeats(draws):
    logits = np.zeros(V, dtype=np.float32)
    logits[0], logits[1] = 1.0, 0.9
    assert draws(SamplingParams(temperature=0), 3, logits) == [0, 0, 0]
    # both seen once: equal penalty, so the better one comes back
    assert draws(SamplingParams(temperature=0, presence_penalty=0.5), 3, logits) == [0, 1, 0]
    assert draws(SamplingParams(temperature=0, frequency_penalty=0.2), 4, logits) == [0, 1, 0, 1]


@each_sampler
def test_repetition_penalty_counts_the_prompt(draws):
    logits = np.zeros(V, dtype=np.float32)
    logits[0], logits[1] = 1.0, 0.9
    assert draws(SamplingParams(temperature=0, repetition_penalty=1.5), 1, logits, prompt=[0]) == [1]
    # negative logits are pushed further down, not up
    logits2 = -np.ones(V, dtype=np.float32)
    logits2[5] = -0.9
    assert draws(SamplingParams(temperature=0, repetition_penalty=2.0), 1, logits2, prompt=[5, 6]) != [5]
