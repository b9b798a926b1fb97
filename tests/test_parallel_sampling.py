"""n > 1 on the torch engine: a prompt's choices share its prefill through the prefix cache."""

from __future__ import annotations

from types import SimpleNamespace

from router.engine import SamplingParams
from router.params import GenerationParams
from router.serving import Generation
from test_torch_engine import engine_for, run
from torch_models import smollm2_folder


def test_n_choices_compute_their_prompt_about_once():
    engine = engine_for(smollm2_folder(), max_batched_tokens=512)
    prompt_rows = []
    real = engine.runner.run
    engine.runner.run = lambda step: prompt_rows.append(sum(w.num_new for w in step.work if not w.is_decode)) or real(step)
    try:
        text = "<|im_start|>system\n" + "Answer with care and in full sentences. " * 25 + "<|im_end|>\n"
        prompt = engine.tokenizer.encode(text + "<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)
        params = GenerationParams(n=4, sampling=SamplingParams(temperature=1.0, seed=3))
        gen = Generation(SimpleNamespace(engine=engine), [prompt], params, 6, "cmpl-test")

        async def consume():
            async for _ in gen.run():
                pass

        run(consume())
    finally:
        engine.runner.run = real
        run(engine.stop())
    assert all(len(c.token_ids) == 6 for c in gen.choices)
    # The first choice computes the prompt; the three others only its last, partial block (and
    # the last token, which must be computed to sample), not 4 x the prompt.
    tail = len(prompt) % 16 or 16
    assert len(prompt) > 200 and sum(prompt_rows) == len(prompt) + 3 * tail
    assert [c.cached_tokens for c in gen.choices] == [0] + [len(prompt) - tail] * 3
