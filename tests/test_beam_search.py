"""Beam search (router/beam_search.py) against models given as tables of next-token
distributions: a search as wide as the tree is an exhaustive one, a search of width 1 is greedy,
the classic case where greedy loses, and what ends or bans a beam."""

from __future__ import annotations

import asyncio
import math
import random
from typing import AsyncIterator, Callable

import numpy as np
import pytest

from router.beam_search import BeamSearch
from router.engine import EngineRequest, EngineStep, SamplingParams, TokenLogprobs

Model = Callable[[tuple[int, ...]], dict[int, float]]
"""Generated tokens so far -> next token -> probability."""


class TableEngine:
    """Answers each request with its greedy token and the top-k raw logprobs of ``model``."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.requests: list[EngineRequest] = []
        self.prompt_length = 3

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        self.requests.append(request)
        await asyncio.sleep(0)
        logprobs = {t: math.log(p) for t, p in self.model(tuple(request.prompt_ids[self.prompt_length :])).items()}
        order = sorted(logprobs, key=lambda t: -logprobs[t])
        token = order[0]
        top = [(t, logprobs[t]) for t in order[: request.sampling.logprobs]]
        yield EngineStep([token], [TokenLogprobs(logprobs[token], top)], "length", None, 2)


def search(model: Model, width: int, max_tokens: int, *, length_penalty: float = 1.0, eos=frozenset(),
           logprobs: int | None = None, **request) -> tuple[list, TableEngine]:
    engine = TableEngine(model)
    req = EngineRequest("r", [7, 8, 9], SamplingParams(), max_tokens, **request)
    beams, first = asyncio.run(BeamSearch(engine, req, width, length_penalty, eos, logprobs).run())
    assert first.cached_tokens == 2
    return beams, engine


def random_model(vocab: int, seed: int) -> Model:
    """A fixed random distribution over ``vocab`` tokens after each prefix."""
    def model(prefix: tuple[int, ...]) -> dict[int, float]:
        rng = np.random.default_rng([seed, *prefix, len(prefix)])
        p = rng.dirichlet(np.ones(vocab) * 0.7)
        return {t: float(p[t]) for t in range(vocab)}

    return model


def exhaustive(model: Model, vocab: int, max_tokens: int, eos: frozenset[int], length_penalty: float):
    """Every sequence a search can return: those ending in EOS early, and all of full length;
    each with its summed logprob and vLLM's score (the prompt's 3 tokens counted)."""
    out = []

    def walk(prefix, cum):
        for t, p in model(prefix).items():
            seq, c = prefix + (t,), cum + math.log(p)
            if t in eos:
                out.append((seq, c, c / (3 + len(prefix)) ** length_penalty))
            elif len(seq) == max_tokens:
                out.append((seq, c, c / (3 + len(seq)) ** length_penalty))
            else:
                walk(seq, c)

    walk((), 0.0)
    return sorted(out, key=lambda x: -x[2])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_a_search_as_wide_as_the_tree_returns_the_best_sequences_of_all(seed, length_penalty):
    vocab, max_tokens = 3, 3
    model, eos = random_model(vocab, seed), frozenset({2})
    # Width 9 keeps every live sequence (2, then 4, then 8: EOS ends the others), so the search
    # sees the whole tree: its best 9 are the 9 best of every sequence.
    beams, _ = search(model, 9, max_tokens, length_penalty=length_penalty, eos=eos)
    reference = exhaustive(model, vocab, max_tokens, eos, length_penalty)
    assert [tuple(b.tokens) for b in beams] == [seq for seq, _, _ in reference[:9]]
    for beam, (seq, cum, score) in zip(beams, reference):
        assert beam.cum_logprob == pytest.approx(cum)
        assert beam.score(3, length_penalty) == pytest.approx(score)
        assert beam.finish_reason == ("stop" if seq[-1] in eos else None)


@pytest.mark.parametrize("seed", range(5))
def test_width_one_is_greedy(seed):
    model = random_model(5, seed)
    beams, engine = search(model, 1, 6)
    prefix: tuple[int, ...] = ()
    for _ in range(6):
        options = model(prefix)
        prefix += (max(options, key=options.get),)
    assert [tuple(b.tokens) for b in beams] == [prefix]
    assert len(engine.requests) == 6 and all(r.max_tokens == 1 for r in engine.requests)


def classic(prefix):
    """Greedy takes 1 (0.6) then the best of three (0.4): 0.24. Token 0 (0.4) leads to 3 (0.9):
    0.36, found by a beam of width 2."""
    table = {(): {1: 0.6, 0: 0.4}, (1,): {4: 0.3, 5: 0.3, 6: 0.4}, (0,): {3: 0.9, 4: 0.1}}
    return table.get(prefix, {7: 1.0})


def test_two_beams_find_what_greedy_misses_and_each_step_asks_for_2w_alternatives():
    beams, engine = search(classic, 2, 2, logprobs=1)
    assert [b.tokens for b in beams] == [[0, 3], [1, 6]]
    assert [b.cum_logprob for b in beams] == pytest.approx([math.log(0.36), math.log(0.24)])
    assert [b.finish_reason for b in beams] == [None, None]
    # Each returned token's entry: its own logprob and the alternatives the request asked for.
    assert beams[0].logprobs[1].logprob == pytest.approx(math.log(0.9))
    assert [t for t, _ in beams[0].logprobs[1].top] == [3]
    # One request at step 0, one per beam at step 1, each for one token with 2w = 4 alternatives.
    prompts = [r.prompt_ids for r in engine.requests]
    assert prompts == [[7, 8, 9], [7, 8, 9, 1], [7, 8, 9, 0]]
    assert {(r.max_tokens, r.sampling.logprobs, r.sampling.temperature, r.ignore_eos) for r in engine.requests} == {
        (1, 4, 0.0, True)}


def ending(prefix):
    """EOS (9) is likely at once; otherwise a long, likely run of 1s."""
    return {(): {9: 0.5, 1: 0.5}}.get(prefix, {1: 0.95, 9: 0.05})


def test_end_tokens_complete_a_beam_and_the_length_penalty_ranks_them():
    eos = frozenset({9})
    beams, _ = search(ending, 2, 4, eos=eos, length_penalty=0.0)  # no penalty: the likeliest sum
    assert [b.tokens for b in beams] == [[9], [1, 1, 1, 1]]
    assert beams[0].finish_reason == "stop" and beams[1].finish_reason is None
    beams, _ = search(ending, 2, 4, eos=eos, length_penalty=1.0)  # per token: the long one wins
    assert [b.tokens for b in beams] == [[1, 1, 1, 1], [9]]
    # ignore_eos (no end ids): 9 is a token like any other.
    beams, _ = search(ending, 2, 2, length_penalty=0.0)
    assert all(b.finish_reason is None and len(b.tokens) == 2 for b in beams)


def test_min_tokens_stop_token_ids_and_bad_words():
    eos = frozenset({9})
    beams, _ = search(ending, 2, 3, eos=eos, length_penalty=0.0, min_tokens=2)
    assert all(9 not in b.tokens[:2] for b in beams) and [b.tokens for b in beams][0] == [1, 1, 1]
    # A stop token id completes a beam as EOS does, and is named.
    beams, _ = search(ending, 2, 3, length_penalty=0.0, stop_token_ids=frozenset({9}))
    assert beams[0].tokens == [9] and beams[0].finish_reason == "stop" and beams[0].stop_token == 9
    # bad_words: the sequence 0 3 may not appear, so the classic search keeps 0 4 instead.
    beams, _ = search(classic, 2, 2, bad_words=((0, 3),))
    assert [b.tokens for b in beams] == [[1, 6], [1, 4]]


def test_a_failed_step_cancels_the_other_beams_requests():
    started, cancelled = [], []

    class Failing(TableEngine):
        async def generate(self, request):
            if len(request.prompt_ids) == 3:  # step 0 as usual: beams 1 and 0
                async for step in super().generate(request):
                    yield step
                return
            started.append(request.prompt_ids[-1])
            await asyncio.sleep(0)
            if request.prompt_ids[-1] == 0:
                raise RuntimeError("boom")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(request.prompt_ids[-1])
                raise
            yield  # pragma: no cover

    req = EngineRequest("r", [7, 8, 9], SamplingParams(), 2)
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(BeamSearch(Failing(classic), req, 2, 1.0, frozenset()).run())
    assert sorted(started) == [0, 1] and cancelled == [1]


def test_random_models_keep_beams_sorted_and_scores_consistent():
    rng = random.Random(0)
    for _ in range(30):
        vocab, width, max_tokens = rng.randint(2, 6), rng.randint(1, 4), rng.randint(1, 5)
        penalty = rng.choice([0.0, 0.5, 1.0, 2.0])
        eos = frozenset({0})
        beams, _ = search(random_model(vocab, rng.randrange(1000)), width, max_tokens, eos=eos, length_penalty=penalty)
        scores = [b.score(3, penalty) for b in beams]
        assert scores == sorted(scores, reverse=True)
        assert 1 <= len(beams) <= width
        for b in beams:
            assert b.cum_logprob == pytest.approx(sum(e.logprob for e in b.logprobs))
            assert (b.finish_reason == "stop") == (b.tokens[-1] in eos)
            assert len(b.tokens) == max_tokens or b.finish_reason == "stop"
