"""Speculative decoding (n-gram drafts) inside the torch engine: the output is the output without
it, token for token, whatever the sampling settings, the weight format or the batch."""

from __future__ import annotations

import asyncio
import json

import pytest

from backends.torch import SpeculativeConfig
from backends.torch.scheduler import Scheduled
from backends.torch.sequence import Sequence
from router.engine import EngineRequest, SamplingParams
from test_torch_engine import PROMPTS, engine_for, generate, run
from test_torch_lora import engine_with
from torch_models import hf_greedy, smollm2_folder, tiny_checkpoint, write_lora

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
    "step. All that glitters is not gold. Actions speak louder than words."
)
COPY = f"<|im_start|>user\nRepeat this text exactly: {TEXT}<|im_end|>\n<|im_start|>assistant\n"
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


@pytest.fixture(scope="module", params=["native", "int4"])
def pair(request):
    """The bundled SmolLM2 twice, without and with drafts: as torch operations (float32) and
    through the one C call (int4)."""
    folder = smollm2_folder()
    base = engine_for(folder, weight_format=request.param)
    spec = engine_for(folder, weight_format=request.param, speculative_config=NGRAM)
    yield base, spec
    run(base.stop())
    run(spec.stop())


def ids_of(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def collect(engine, prompt, max_tokens, ignore_eos=True, **fields):
    """Every step of one request: its tokens, logprobs (None without) and finish."""
    params = {"temperature": 0.0, **{k: v for k, v in fields.items() if k not in ("stop_token_ids", "min_tokens", "constraint")}}
    req = EngineRequest(
        "s", prompt, SamplingParams(**params), max_tokens, ignore_eos=ignore_eos,
        stop_token_ids=frozenset(fields.get("stop_token_ids", ())), min_tokens=fields.get("min_tokens", 0),
        constraint=fields.get("constraint"),
    )
    tokens, logprobs, finish = [], [], None
    async for step in engine.generate(req):
        tokens += step.token_ids
        logprobs += step.logprobs or []
        finish = step.finish_reason
    return tokens, logprobs, finish


def accepted(spec) -> int:
    return spec.stats()["spec_accepted_tokens"]


def test_greedy_output_is_unchanged_alone_and_in_a_batch(pair):
    base, spec = pair
    copy = ids_of(base, COPY)
    want, _ = run(generate(base, copy, 40))
    before, steps = accepted(spec), spec.steps
    got, _ = run(generate(spec, copy, 40))
    assert got == want
    assert accepted(spec) - before >= 10  # the text is copied: most drafts hold
    assert spec.steps - steps <= 30  # 40 tokens in fewer steps
    if base.options.weight_format == "native":
        assert want == hf_greedy(smollm2_folder(), copy, 40)

    others = [ids_of(base, p) for p in PROMPTS[:5]]
    alone = [run(generate(base, ids, 24))[0] for ids in others]

    async def crowded():
        return await asyncio.gather(generate(spec, copy, 40), *(generate(spec, ids, 24) for ids in others))

    outs = [out for out, _ in run(crowded())]
    assert outs == [want, *alone]
    assert spec.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.8, "seed": 7},
        {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 3},
        {"temperature": 0.7, "min_p": 0.05, "seed": 5, "logprobs": 3},
        {"temperature": 0.0, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3},
        {"temperature": 0.0, "logprobs": 2},
    ],
)
def test_sampling_penalties_and_logprobs_are_unchanged(pair, fields):
    base, spec = pair
    copy = ids_of(base, COPY)
    want, want_lp, _ = run(collect(base, copy, 30, **fields))
    before = spec.stats()
    got, got_lp, _ = run(collect(spec, copy, 30, **fields))
    assert got == want
    if "repetition_penalty" not in fields:  # penalized, the answer does not copy: nothing to draft
        assert spec.stats()["spec_drafts"] > before["spec_drafts"]
    assert len(got_lp) == len(want_lp)
    for a, b in zip(got_lp, want_lp):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]

    async def crowded():  # a seeded request's tokens are its own whatever the batch and the drafts
        others = [collect(spec, ids_of(base, p), 20, temperature=1.0) for p in PROMPTS[:3]]
        return await asyncio.gather(collect(spec, copy, 30, **fields), *others)

    assert run(crowded())[0][0] == want


def test_each_drafted_row_samples_as_if_the_draft_before_it_were_generated(pair):
    _, spec = pair
    req = EngineRequest("r", [1, 2, 3], SamplingParams(temperature=0.0, frequency_penalty=1.0), 9, min_tokens=3,
                        stop_token_ids=frozenset({42}))
    seq = Sequence(req, lambda _: None, 16)
    seq.tokens += [4, 5]  # two generated: one more before the end tokens are allowed
    rows = spec.runner._rows(Scheduled(seq, 3, [6, 7]))
    assert [r.output_ids for r in rows] == [[4, 5], [4, 5, 6], [4, 5, 6, 7]]
    assert [42 in r.suppress for r in rows] == [True, False, False]
    assert all(r.prompt_ids == [1, 2, 3] for r in rows)


def test_seeded_sampling_is_its_seeds_where_drafts_were_cut_short(pair):
    base, spec = pair
    copy = ids_of(base, COPY)
    rejected = 0
    for seed in range(6):
        before = spec.stats()
        got = run(collect(spec, copy, 24, temperature=1.0, seed=seed))
        after = spec.stats()
        rejected += (after["spec_draft_tokens"] - before["spec_draft_tokens"]) - (
            after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        )
        assert got == run(collect(base, copy, 24, temperature=1.0, seed=seed))
    assert rejected > 0  # the generators were rewound over rejected rows


def test_blocks_written_by_drafted_steps_serve_later_prompts(pair):
    """A prompt that repeats an earlier request's prompt and output reuses the blocks its drafted
    steps wrote (rejected rows' keys and values must never have reached a cached block)."""
    base, spec = pair
    copy = ids_of(base, COPY)
    first, _ = run(generate(spec, copy, 40))
    follow = copy + first[:36]  # whole blocks of prompt and output, then a token to compute
    want, _ = run(generate(base, follow, 16))
    got, cached = run(generate(spec, follow, 16))
    assert cached >= len(copy) + 16 and got == want


def test_stop_tokens_min_tokens_and_max_tokens_inside_a_draft(pair):
    base, spec = pair
    copy = ids_of(base, COPY)
    out, _ = run(generate(base, copy, 40))
    stop = out[14]
    at = out.index(stop)
    got, _, finish = run(collect(spec, copy, 40, stop_token_ids=[stop]))
    assert (got, finish) == (out[: at + 1], "stop")
    held = run(collect(base, copy, 40, stop_token_ids=[stop], min_tokens=at + 2))
    assert run(collect(spec, copy, 40, stop_token_ids=[stop], min_tokens=at + 2)) == held
    for n in (1, 2, 3, 5, 9):
        assert run(collect(spec, copy, n)) == (out[:n], [], "length")


def test_eos_ends_as_without_drafts(pair):
    base, spec = pair
    copy = ids_of(base, COPY)
    want = run(collect(base, copy, 120, ignore_eos=False))
    assert want[2] == "stop"  # the model ends its copy by itself
    assert run(collect(spec, copy, 120, ignore_eos=False)) == want


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
EXTRACT = (
    "<|im_start|>user\nExtract the person's name, city and age as JSON: Alice Smith is 42 years old "
    "and lives in Paris.<|im_end|>\n<|im_start|>assistant\n"
)


def grammar(engine, kind="json", value=PERSON):
    """A sequence's own matcher for ``value`` (what the structured-outputs plugin gives a request)."""
    from router.constraints import ConstraintSpec, GrammarCompiler

    if not hasattr(engine, "_test_grammars"):
        engine._test_grammars = GrammarCompiler(engine.tokenizer)
    return engine._test_grammars.constraint(ConstraintSpec(kind, value, "structured_outputs"))


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}, {"temperature": 0.7, "top_k": 20, "seed": 4, "logprobs": 2}],
)
def test_sequences_under_a_grammar_are_drafted_with_the_same_output(pair, fields):
    """The grammar's forced tokens (keys, quotes) and n-gram drafts of the values (copied from
    the prompt) are verified under the grammar's mask at each row: the output is the output
    without drafts, and the grammar ends it."""
    base, spec = pair
    prompt = ids_of(base, EXTRACT)
    want = run(collect(base, prompt, 60, constraint=grammar(base), **fields))
    before = spec.stats()
    got = run(collect(spec, prompt, 60, constraint=grammar(spec), **fields))
    after = spec.stats()
    assert got[0] == want[0] and got[2] == want[2] == "stop"
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1]):  # the masked distribution at each row
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert set(json.loads(spec.tokenizer.decode(got[0]))) == {"name", "city", "age"}
    kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert kept >= len(got[0]) // 3  # keys, quotes and copied values came in drafts
    assert after["spec_drafts"] - before["spec_drafts"] < len(got[0])


def test_a_grammar_that_ends_inside_a_draft(pair):
    """A choice whose rest is forced: the grammar completes inside the draft and ends the sequence
    there, as without drafts."""
    base, spec = pair
    prompt = ids_of(base, EXTRACT)
    options = ["Alice Smith lives in Paris", "Bob Jones lives in London"]
    want = run(collect(base, prompt, 30, constraint=grammar(base, "choice", options)))
    got = run(collect(spec, prompt, 30, constraint=grammar(spec, "choice", options)))
    assert got == want and want[2] == "stop"
    assert spec.tokenizer.decode(got[0]) in options


async def predicted(engine, prompt, max_tokens, prediction, **params):
    """One request with a prediction: its tokens and the last step's prediction token counts."""
    req = EngineRequest("p", prompt, SamplingParams(**{"temperature": 0.0, **params}), max_tokens,
                        ignore_eos=True, prediction=prediction)
    tokens, counts = [], None
    async for step in engine.generate(req):
        tokens += step.token_ids
        counts = step.prediction_tokens
    return tokens, counts


def assert_drafts_from_a_prediction_keep_greedys(folder):
    """A prediction of transformers' 24 greedy tokens with a wrong one at 10 (several rows of a
    sequence a step): those tokens, 15 or more of the prediction's kept, in fewer than 12 steps."""
    from test_torch_engine import random_prompts
    from torch_models import hf_greedy

    prompt = random_prompts(5, (30,))[0]
    want = hf_greedy(folder, prompt, 24)
    engine = engine_for(folder)
    try:
        steps = engine.steps
        got, (kept, _) = run(predicted(engine, prompt, 24, want[:10] + [7] + want[11:]))
        assert got == want and kept >= 15 and engine.steps - steps < 12
    finally:
        run(engine.stop())


@pytest.mark.parametrize("fields", [{}, {"temperature": 1.0, "seed": 5}])
def test_predicted_outputs_on_an_engine_with_or_without_speculative_config(pair, fields):
    """A prediction is drafted from by both engines (the one without speculative_config drafts
    from nothing else): the same tokens as without it, and its tokens kept and refused."""
    base, spec = pair
    copy = ids_of(base, COPY)
    want = run(collect(base, copy, 40, **fields))[0]
    right = want[:12] + ids_of(base, " word") + want[12:]  # the answer, but for one word
    wrong = ids_of(base, "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.")
    for engine in (base, spec):
        steps = engine.steps
        got, (kept, refused) = run(predicted(engine, copy, 40, right, **fields))
        assert got == want
        assert kept >= 10 and engine.steps - steps < 35
        got, (kept, refused) = run(predicted(engine, copy, 40, wrong, **fields))
        assert got == want and kept + refused < 10
    assert "spec_drafts" in base.stats()  # counted once predictions were drafted


def test_a_prediction_under_a_grammar(pair):
    base, spec = pair
    prompt = ids_of(base, EXTRACT)
    want = run(collect(base, prompt, 60, constraint=grammar(base)))[0]
    req = EngineRequest("g", prompt, SamplingParams(temperature=0.0), 60, ignore_eos=True,
                        constraint=grammar(base), prediction=want[3:30])

    async def go():
        return [step async for step in base.generate(req)]

    steps = run(go())
    assert [t for s in steps for t in s.token_ids] == want
    assert steps[-1].prediction_tokens[0] > 0


def test_preemption_under_a_tiny_kv_budget_with_drafts(pair):
    base, _ = pair
    if base.options.weight_format != "int4":
        pytest.skip("once is enough: the int4 engines are the faster")
    # 8 blocks of 16 tokens for 4 sequences growing to ~5 blocks each: constant preemption.
    tight = engine_for(smollm2_folder(), weight_format="int4", kv_cache_gb=8 * 16 * 46080 / 2**30, speculative_config=NGRAM)
    try:
        prompts = [ids_of(base, COPY), *(ids_of(base, p) for p in PROMPTS[:3])]
        lengths = [60, 50, 70, 40]

        async def all_at_once(engine):  # the outputs (the cached counts depend on what ran before)
            return [out for out, _ in await asyncio.gather(*(generate(engine, ids, n) for ids, n in zip(prompts, lengths)))]

        squeezed = run(all_at_once(tight))
        assert tight.scheduler.preemptions > 0 and accepted(tight) > 0
        assert squeezed == run(all_at_once(base))
        assert tight.stats()["kv_blocks_used"] == 0
    finally:
        run(tight.stop())


def test_cancelled_requests_leave_no_blocks_in_use(pair):
    _, spec = pair
    copy = ids_of(spec, COPY)

    async def cancel_many():
        async def one(i):
            req = EngineRequest(f"c{i}", copy, SamplingParams(temperature=0.0), 60, ignore_eos=True)
            gen = spec.generate(req)
            async for _ in gen:
                if i % 2:
                    break  # the client goes away after its first token(s)
            await gen.aclose()

        await asyncio.gather(*(one(i) for i in range(16)))

    drafts = spec.stats()["spec_drafts"]
    run(cancel_many())
    stats = spec.stats()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["spec_drafts"] > drafts and stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"]


@pytest.mark.parametrize("weight_format", ["native", "int4"])
def test_lora_rows_with_drafts(tmp_path, weight_format):
    base = tiny_checkpoint(tmp_path / "tiny", "llama")
    adapter = write_lora(tmp_path / "every", base, seed=3)
    plain = engine_with(base, {"every": adapter}, weight_format=weight_format)
    spec = engine_with(base, {"every": adapter}, weight_format=weight_format, speculative_config=NGRAM)
    try:
        prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3  # repeats itself: drafts from the start

        async def both(engine):
            return await asyncio.gather(generate(engine, prompt, 30), generate(engine, prompt, 30, adapter="every"))

        want = run(both(plain))
        assert want[0] != want[1]
        assert run(both(spec)) == want
        assert accepted(spec) > 0
    finally:
        run(plain.stop())
        run(spec.stop())
