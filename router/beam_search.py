"""Beam search (vLLM's ``use_beam_search``) over any local engine, one token per engine request.

The beam width ``w`` is the request's ``n``. Each step asks the engine for one token of every
live beam (the prompt plus the beam's tokens) with the ``2w`` most likely next tokens'
logprobs; a beam extended by one of them is a candidate, scored by its summed logprob. A
candidate that ends in an end token (EOS unless ``ignore_eos``, or a ``stop_token_ids`` member;
neither before ``min_tokens``) is complete and set aside; the ``w`` best others are the next
step's beams. After ``max_tokens`` steps, or once no beam is left, the complete and the live
beams are ranked by vLLM's score, ``cum_logprob / length ** length_penalty`` (``length``: the
prompt's tokens and the beam's, a final end token not counted), and the ``w`` best are the
choices, best first.

The logprobs are the model's raw ones, so temperature, top_p, top_k, min_p and seed change
nothing, as in vLLM. ``bad_words`` drop the candidates they forbid. (``allowed_token_ids`` is
refused: the engines rank alternatives before that mask, so the best allowed candidates would
not be among them.)
A step's requests run at once, so the torch engine batches them and finds their shared prefix in
its prefix cache; llama.cpp runs them in turn, reusing the KV their prompts share with the one
before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Awaitable, TypeVar

from .bad_words import banned_tokens
from .engine import EngineError, EngineRequest, EngineStep, SamplingParams, TokenLogprobs

T = TypeVar("T")


async def all_or_none(coros: list[Awaitable[T]]) -> list[T]:
    """Run ``coros`` at once and return their results; when one fails (or the caller is
    cancelled), the others are cancelled rather than left running."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


@dataclass(slots=True)
class Beam:
    """A hypothesis: its tokens (an end token last if it is complete), each one's logprobs
    entry from the step that chose it, and their summed logprob."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop": it ends in an end token
    stop_token: int | None = None  # the stop_token_ids member it ends in

    def score(self, prompt_length: int, length_penalty: float) -> float:
        length = prompt_length + len(self.tokens) - (self.finish_reason == "stop")
        return self.cum_logprob / length**length_penalty


@dataclass(slots=True)
class BeamSearch:
    """One prompt's search; :meth:`run` returns its best beams and the first engine step (for
    its ``cached_tokens`` and ``prompt_logprobs``)."""

    engine: Any
    request: EngineRequest  # the prompt and what every step's requests carry
    width: int
    length_penalty: float
    eos_ids: frozenset[int]
    logprobs: int | None = None  # the alternatives each returned token's entry keeps

    async def run(self) -> tuple[list[Beam], EngineStep]:
        req = self.request
        prompt = req.prompt_ids
        beams, complete = [Beam()], []
        first: EngineStep | None = None
        for t in range(req.max_tokens):
            steps = await self._step(beams, t)
            if first is None:
                first = steps[0]
            candidates: list[Beam] = []
            for beam, step in zip(beams, steps):
                candidates += self._extend(beam, step, complete)
            candidates.sort(key=lambda b: -b.cum_logprob)  # stable: ties keep beam, then rank, order
            beams = candidates[: self.width]
            # A complete beam's score is final: only the best `width` can ever be returned.
            complete.sort(key=lambda b: -b.score(len(prompt), self.length_penalty))
            del complete[self.width :]
            if not beams:
                break
        assert first is not None  # max_tokens >= 1
        ranked = sorted(complete + beams, key=lambda b: -b.score(len(prompt), self.length_penalty))
        return ranked[: self.width], first

    async def _step(self, beams: list[Beam], t: int) -> list[EngineStep]:
        """One token for each beam, from requests running at once."""
        req = self.request
        sampling = SamplingParams(temperature=0.0, logprobs=max(2 * self.width, self.logprobs or 0))

        async def one(i: int, beam: Beam) -> EngineStep:
            request = EngineRequest(
                request_id=f"{req.request_id}-{t}-{i}",
                prompt_ids=req.prompt_ids + beam.tokens,
                sampling=sampling,
                max_tokens=1,
                ignore_eos=True,  # an end token is a candidate like any other (see _extend)
                priority=req.priority,
                arrival=req.arrival,
                extras=req.extras,
                adapter=req.adapter,
                cache_salt=req.cache_salt,
                prompt_logprobs=req.prompt_logprobs if t == 0 else None,
            )
            steps = [step async for step in self.engine.generate(request)]
            if len(steps) != 1 or len(steps[0].token_ids) != 1 or not steps[0].logprobs:
                raise EngineError("the engine did not give one token with its logprobs for a beam search step")
            return steps[0]

        return await all_or_none([one(i, beam) for i, beam in enumerate(beams)])

    def _extend(self, beam: Beam, step: EngineStep, complete: list[Beam]) -> list[Beam]:
        """The live candidates of ``beam`` after ``step``; complete ones go to ``complete``."""
        req = self.request
        entry = step.logprobs[0]
        options = dict(entry.top)
        options.setdefault(step.token_ids[0], entry.logprob)
        banned = banned_tokens(req.bad_words, beam.tokens) if req.bad_words else frozenset()
        top = entry.top[: self.logprobs or 0]
        ends_allowed = len(beam.tokens) >= req.min_tokens
        out = []
        for token, logprob in sorted(options.items(), key=lambda item: -item[1]):
            if token in banned:
                continue
            stop_token = token if token in req.stop_token_ids else None
            ends = stop_token is not None or (token in self.eos_ids and not req.ignore_eos)
            if ends and not ends_allowed:
                continue
            child = Beam(beam.tokens + [token], beam.logprobs + [TokenLogprobs(logprob, top)],
                         beam.cum_logprob + logprob, "stop" if ends else None, stop_token)
            (complete if ends else out).append(child)
        return out
