"""Prompt logprobs on the llama.cpp engine, against a plain ``llama_cpp.Llama`` that keeps every
position's logits, and the engine's KV reuse and sampled output around scored requests."""

from __future__ import annotations

import asyncio

import llama_cpp
import numpy as np
import pytest

from backends.llamacpp.engine import LlamaCppEngine
from router.config import resolve_path
from router.engine import EngineRequest, SamplingParams
from server import GGUF

MODEL = str(resolve_path(GGUF))
N_CTX = 256
THREADS = 2
# Engine against reference: measured max |difference| 0.0 on this host (the rows came out
# bit-identical for prompts of 2 to 100 tokens, n_batch 8 and 512, lone remainders included).
# llama.cpp picks its CPU kernels by instruction set and batch size, so leave a little room; an
# off-by-one position or a penalised row is off by whole units, far beyond this.
TOL = 1e-3

TEXT = (
    "The quick brown fox jumps over the lazy dog. Then the dog chased the fox around the big old "
    "barn until the sun went down and everyone went home to sleep."
)
CHAT = "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n"


def make_engine(n_batch: int) -> LlamaCppEngine:
    engine = LlamaCppEngine(
        MODEL, n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, n_batch=n_batch
    )
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(512)
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture(scope="module")
def small_batch_engine():
    engine = make_engine(8)
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture(scope="module")
def reference():
    """Each prompt position's raw logprobs ([len, vocab], float64) from one plain evaluation."""
    llm = llama_cpp.Llama(
        model_path=MODEL, n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS,
        logits_all=True, verbose=False,
    )

    def logprobs(ids: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        x = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        m = x.max(axis=1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))

    yield logprobs
    llm.close()


def ids_of(engine: LlamaCppEngine, text: str, n: int | None = None) -> list[int]:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert n is None or len(ids) >= n
    return ids[:n]


def steps_of(engine: LlamaCppEngine, prompt: list[int], *, k: int | None, max_tokens: int = 4) -> list:
    """Every EngineStep of one greedy request."""
    req = EngineRequest(
        "t", prompt, SamplingParams(temperature=0.0), max_tokens, ignore_eos=True, prompt_logprobs=k
    )

    async def collect():
        return [step async for step in engine.generate(req)]

    return asyncio.run(collect())


def output(steps: list) -> tuple[list[int], int | None]:
    return [t for s in steps for t in s.token_ids], steps[0].cached_tokens


def check_against_reference(entries: list, prompt: list[int], ref: np.ndarray, k: int) -> None:
    """Entry i is prompt[i + 1]'s logprob after prompt[:i + 1]; its top k are the reference's
    k best up to near-ties (an id may swap with one within TOL of the k-th best)."""
    assert len(entries) == len(prompt) - 1
    for i, entry in enumerate(entries):
        row = ref[i]
        assert entry.logprob == pytest.approx(row[prompt[i + 1]], abs=TOL), i
        kth_best = np.sort(row)[-k]
        assert len(entry.top) == k
        for token, lp in entry.top:
            assert lp == pytest.approx(row[token], abs=TOL), (i, token)
            assert row[token] >= kth_best - TOL, (i, token)


def test_prompt_logprobs_match_a_plain_llama_with_all_logits(engine, reference):
    prompt = ids_of(engine, TEXT, 12)
    steps = steps_of(engine, prompt, k=5)
    check_against_reference(steps[0].prompt_logprobs, prompt, reference(prompt), 5)


def test_shape_first_step_only_and_top_k(engine):
    prompt = ids_of(engine, TEXT, 12)
    plain = steps_of(engine, prompt, k=None, max_tokens=5)
    assert all(s.prompt_logprobs is None for s in plain)

    none = steps_of(engine, prompt, k=0, max_tokens=5)
    assert len(none) == 5
    assert len(none[0].prompt_logprobs) == len(prompt) - 1
    assert all(s.prompt_logprobs is None for s in none[1:])
    assert all(e.top == [] for e in none[0].prompt_logprobs)

    three = steps_of(engine, prompt, k=3, max_tokens=5)[0].prompt_logprobs
    assert len(three) == len(prompt) - 1
    for e0, e3, nxt in zip(none[0].prompt_logprobs, three, prompt[1:]):
        assert e3.logprob == e0.logprob  # same rows whatever k
        assert len(e3.top) == 3
        lps = [lp for _, lp in e3.top]
        assert lps == sorted(lps, reverse=True)
        assert e3.logprob <= lps[0] + 1e-12
        assert all(lp <= 0.0 for lp in lps)
        if nxt in {t for t, _ in e3.top}:
            assert dict(e3.top)[nxt] == e3.logprob

    assert steps_of(engine, prompt[:1], k=2)[0].prompt_logprobs == []


def test_same_greedy_output_with_and_without_prompt_logprobs(engine):
    prompt = ids_of(engine, CHAT)
    other = prompt[:10] + ids_of(engine, " Tell me a joke about cats.")  # shares 10 tokens
    n = 16

    steps_of(engine, other, k=None)
    fresh, fresh_cached = output(steps_of(engine, prompt, k=None, max_tokens=n))
    assert fresh_cached == 10  # the shared prefix came from the cache

    again, again_cached = output(steps_of(engine, prompt, k=None, max_tokens=n))
    assert again_cached == len(prompt) - 1

    steps_of(engine, other, k=None)
    scored_steps = steps_of(engine, prompt, k=2, max_tokens=n)
    scored, scored_cached = output(scored_steps)
    assert scored_cached == 0  # every position needs its logits: nothing reused
    assert len(scored_steps[0].prompt_logprobs) == len(prompt) - 1

    after_scored, _ = output(steps_of(engine, prompt, k=1, max_tokens=n))
    assert fresh == again == scored == after_scored


def test_a_plain_request_after_a_scored_one_reuses_its_prompt(engine):
    prompt = ids_of(engine, TEXT, 20)
    scored, _ = output(steps_of(engine, prompt, k=1))
    longer = prompt + ids_of(engine, " The end.")
    plain_steps = steps_of(engine, longer, k=None)
    assert plain_steps[0].cached_tokens == len(prompt)
    assert plain_steps[0].prompt_logprobs is None
    # llama-cpp-python's own bookkeeping agrees with the engine's record of the context.
    cached = engine._cached
    assert engine._llm.n_tokens >= len(cached)
    assert list(engine._llm.input_ids[: len(cached)]) == cached
    # the same prompt scored again still gives the same answer as when it was first scored
    assert output(steps_of(engine, prompt, k=1))[0] == scored


@pytest.mark.parametrize("length", [30, 26])  # 29 = 8+8+8+5; 25 = 8+8+8+1, a lone remainder
def test_prompt_longer_than_n_batch(small_batch_engine, reference, length):
    prompt = ids_of(small_batch_engine, TEXT, length)
    steps = steps_of(small_batch_engine, prompt, k=3)
    check_against_reference(steps[0].prompt_logprobs, prompt, reference(prompt), 3)
    assert steps[0].cached_tokens == 0
