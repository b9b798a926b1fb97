"""What a local engine is: token ids in, token ids out.

Everything textual (chat template, tokenizing, detokenizing, stop strings, usage, chunk shapes)
lives in the shared serving pipeline; an engine only schedules and samples. The llama.cpp and torch
backends implement :class:`Engine`; third-party packages can too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """The model's vocabulary, as the serving pipeline needs it."""

    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: frozenset[int]
    """Token ids that end generation (EOS and end-of-turn tokens)."""
    special_tokens: frozenset[str]
    """Texts of control tokens, so that user-written copies can be kept as plain text."""

    def encode(self, text: str, *, add_special_tokens: bool, parse_special: bool = True) -> list[int]:
        """Text to ids. ``parse_special=False`` tokenizes control-token text as ordinary text."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids to text, invalid UTF-8 as U+FFFD; control tokens skipped, or with
        ``skip_special_tokens=False`` spelled out (``<|im_end|>``), for the parsers of formats
        whose markers are control tokens and for vLLM's request option of that name. Callers
        pass the keyword only to keep them, so a tokenizer that never does may omit it."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        ...

    def token_str(self, token_id: int) -> str:
        """The vocabulary's own spelling of a token (e.g. ``Ġhello``), for ``/tokenize``."""
        ...


# What both built-in local engines honour: everything the sampling extras and the structured-
# outputs plugin can ask for.
LOCAL_ENGINE_CAPABILITIES = frozenset(
    {
        "logprobs",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "priority",
        "seed",
        "structured_outputs",
        "prompt_logprobs",
        "allowed_token_ids",
        "skip_special_tokens",
        "cache_salt",
        "bad_words",
        # Served by the shared pipeline over any engine that gives logprobs (router/beam_search.py).
        "use_beam_search",
    }
)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token. Defaults mean "plain sampling from the model"."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: the chosen token's logprob plus the top k
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these (logprobs stay raw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class EngineRequest:
    """One sequence to generate. ``n > 1`` is several EngineRequests."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    constraint: Any = None
    """A :class:`router.constraints.TokenConstraint` (or a thinking model's
    :class:`router.thinking_gate.AfterReasoning`): ask ``allowed()`` before sampling (None: any
    token), call ``advance(token)`` after; finish with "stop" once ``done``."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Plugin-defined parameters (``GenerationParams.extras``) for engines that know them."""
    prompt_logprobs: int | None = None
    """Score the prompt (capability "prompt_logprobs"): every prompt token after the first gets its
    logprob under the model given the tokens before it, and the ``k`` most likely alternatives;
    raw model logprobs, before any sampling setting. None: off."""
    adapter: str | None = None
    """The LoRA adapter to generate with (a name the engine serves); None: the base model."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Capability "bad_words": token sequences the output may not complete (router/bad_words.py:
    before each token, ban what ``banned_tokens`` names)."""
    cache_salt: str | None = None
    """Capability "cache_salt": reuse and leave prefix-cache entries only for requests with the
    same salt (None: only for requests without one)."""
    prediction: list[int] | None = None
    """Token ids the output is expected to mostly repeat (capability "prediction", OpenAI's
    Predicted Outputs): an engine that verifies drafts drafts from them; the output is what it
    would be without."""


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the chosen token and the ``k`` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # prompt logprobs: 1 + how many tokens were more likely than this one


@dataclass(slots=True)
class EngineStep:
    """What one engine step produced for one request."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_token: int | None = None  # the stop_token_ids member that ended it, if any
    cached_tokens: int | None = None  # set on the first step: prompt tokens not recomputed
    prompt_logprobs: list[TokenLogprobs] | None = None
    """On the first step, when the request asked: one entry per prompt token after the first."""
    prediction_tokens: tuple[int, int] | None = None
    """On each step of a request with a prediction, the totals so far: its tokens drafted and
    kept, and drafted and refused (usage's ``accepted_prediction_tokens``,
    ``rejected_prediction_tokens``)."""


def finish_reason(
    request: EngineRequest, token: int, num_output: int, length: int, max_model_len: int, eos_ids: frozenset[int]
) -> tuple[str | None, int | None]:
    """Whether the token just sampled ends the sequence: (finish_reason, stop token id).

    Engines call this after each sampled token; it also advances the request's constraint.
    """
    if request.constraint is not None:
        request.constraint.advance(token)
    if token in request.stop_token_ids:
        return "stop", token
    if token in eos_ids and not request.ignore_eos:
        return "stop", None
    if request.constraint is not None and request.constraint.done:
        return "stop", None  # the grammar is complete: only end-of-sequence could follow
    if num_output >= request.max_tokens or length >= max_model_len:
        return "length", None
    return None, None


class StepQueue:
    """One request's steps as its engine delivers them (a step, or the exception that ends the
    request), read in order up to the step that finishes it; ``finished`` says whether that
    came (else the reader left early: the engine should drop the request)."""

    __slots__ = ("_queue", "finished")

    def __init__(self) -> None:
        self._queue: asyncio.Queue[EngineStep | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: EngineStep | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "StepQueue":
        return self

    async def __anext__(self) -> EngineStep:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item


async def submitted(submit: Callable[[EngineRequest, Callable[[EngineStep | BaseException], None]], Callable[[], None]],
                    request: EngineRequest) -> AsyncIterator[EngineStep]:
    """An engine's ``generate`` made from its ``submit`` (a request handed over with a callback
    for its steps, returning its abort): the steps in order; closing the iterator early aborts."""
    steps = StepQueue()
    abort = submit(request, steps.put)
    try:
        async for step in steps:
            yield step
    finally:
        if not steps.finished:
            abort()


class EngineError(Exception):
    """The engine failed a request after accepting it (reaches the client as an error event)."""


class UnknownAdapter(EngineError):
    """The request names a LoRA adapter the engine does not serve: one unloaded after the
    request found it (it reaches the client as the 404 of a model that does not exist)."""

    def __init__(self, adapter: str) -> None:
        super().__init__(f"this engine serves no LoRA adapter `{adapter}`")
        self.adapter = adapter


@runtime_checkable
class Engine(Protocol):
    """A local inference engine. One per served model."""

    tokenizer: Tokenizer
    chat_template: str | None
    max_model_len: int
    capabilities: frozenset[str]
    """Extras it honours beyond plain sampling: "logprobs", "top_k", "min_p", "seed", ..."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, int]:
        """Current work in sequences: at least ``{"running": n, "waiting": n}``."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        """Stream the request's steps. Closing the iterator early aborts the request and frees
        its memory at once; the last step carries ``finish_reason``."""
        ...
