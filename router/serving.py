"""The serving pipeline shared by every local engine.

template -> token ids -> engine.generate -> incremental detokenizer -> stop strings -> chunks.
Usage accounting, stop handling and stream shape are written once here, so every engine
answers the same way. The first byte of a stream is only produced after every check that
can fail with a 400 has passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import msgspec
from msgspec import UNSET

from . import sse
from .bad_words import bad_words_ids
from .constraints import ConstraintPlan
from .detokenizer import IncrementalDetokenizer
from .engine import EngineError, EngineRequest, EngineStep, SamplingParams, Tokenizer, UnknownAdapter
from .errors import APIError, BadRequest, ModelNotFound, ServerError, Unavailable
from .params import GenerationParams
from .prompts import build_chat_prompt, check_length, completion_prompts, truncate_prompt
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    PromptLogprob,
    PromptLogprobs,
    Delta,
    DeltaToolCall,
    DeltaToolCallFunction,
    DetokenizeResponse,
    PromptTokensDetails,
    ResponseMessage,
    ResponseToolCall,
    ResponseToolCallFunction,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .stops import StopChecker
from .workers.client import WorkerLost

if TYPE_CHECKING:
    from .backend import LocalBackend

log = logging.getLogger("router.serving")

_json = msgspec.json.Encoder()
# JSON has no -inf; vLLM reports impossible tokens at this floor too.
_LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Choice:
    """One sequence being generated: its text so far and how it ended."""

    index: int
    prompt_index: int
    detok: IncrementalDetokenizer
    stops: StopChecker
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, Any]] = field(default_factory=list)
    sent_logprobs: int = 0
    sent_ids: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None  # the engine's TokenLogprobs of prompt tokens 1..P-1
    prediction_tokens: tuple[int, int] = (0, 0)  # prediction tokens kept, refused (EngineStep)
    end_ids: frozenset[int] = frozenset()  # the tokenizer's EOS ids: a "stop" on one hides it
    tools: Any = None  # a router.tools ToolParser when the request has tools
    reasoning: Any = None  # a ReasoningParser (or harmony.HarmonyParser) when the model has one
    reasoning_field: bool = False  # the model has a reasoning parser: the message has the field
    show_reasoning: bool = True  # the request's include_reasoning
    reasoning_delta: str = ""
    """The reasoning text the last step gave, to send now (empty when not shown)."""
    reasoning_tokens: int = 0  # usage's completion_tokens_details.reasoning_tokens
    content: list[str] = field(default_factory=list)
    """Everything sent as message content (text outside tool calls and reasoning), in order."""

    def absorb(self, step: EngineStep) -> tuple[str, list[Any]]:
        """Take one engine step; return the content text and tool-call deltas to send now (and
        keep its reasoning text in :attr:`reasoning_delta`)."""
        had = len(self.token_ids)
        text = self._text(step)
        calls: list[Any] = []
        if self.reasoning is not None:
            # A step's tokens are reasoning when it began or ended inside the reasoning (so the
            # markers that open and close it count too).
            thinking = self.reasoning.thinking
            split = self.reasoning.push(text)
            if thinking or self.reasoning.thinking:
                self.reasoning_tokens += len(self.token_ids) - had
            if self.finished:
                end = self.reasoning.finish()
                split.reasoning, split.content = split.reasoning + end.reasoning, split.content + end.content
                split.calls += end.calls
            text, calls = split.content, split.calls
            self.reasoning_delta = split.reasoning if self.show_reasoning else ""
        if self.tools is not None:
            parsed = self.tools.push(text)
            text, calls = parsed.content, calls + parsed.calls
            if self.finished:
                end = self.tools.finish()
                text, calls = text + end.content, calls + end.calls
        if self.finished and self.finish_reason == "stop" and self.tool_calls:
            self.finish_reason = "tool_calls"
        if text:
            self.content.append(text)
        return text, calls

    @property
    def tool_calls(self) -> Sequence[Any]:
        """The calls read so far (router.tools ToolCall), by the tool parser or by a reasoning
        parser that reads them itself (harmony's)."""
        if self.tools is not None:
            return self.tools.calls
        return self.reasoning.calls if self.reasoning is not None else []

    def _text(self, step: EngineStep) -> str:
        ids, logprobs = step.token_ids, step.logprobs
        if step.cached_tokens is not None:
            self.cached_tokens = step.cached_tokens
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs
        before = self.prediction_tokens[0]
        if step.prediction_tokens is not None:
            self.prediction_tokens = step.prediction_tokens
        text_ids = ids
        if step.finish_reason == "stop" and ids and (step.stop_token is not None or ids[-1] in self.end_ids):
            # A stop token or EOS ends the sequence without being shown (also where control
            # tokens are spelled out).
            text_ids = text_ids[:-1]
        if len(text_ids) > 1 and self.stops.watching:
            # Several tokens in one step (speculative decoding): those after the one that
            # completes a stop string are not part of the answer, its token ids or its usage.
            out = ""
            for i, token in enumerate(text_ids):
                out += self.stops.push(self.detok.push([token]))
                if self.stops.stopped_by is not None:
                    ids, logprobs = ids[: i + 1], logprobs[: i + 1] if logprobs else logprobs
                    # A step's kept draft tokens are its first: only those up to here count.
                    kept, refused = self.prediction_tokens
                    self.prediction_tokens = (before + min(kept - before, i + 1), refused)
                    break
        else:
            out = self.stops.push(self.detok.push(text_ids))
        self.token_ids.extend(ids)
        if logprobs:
            self.logprobs.extend(zip(ids, logprobs))
        if self.stops.stopped_by is not None:
            self.finish_reason, self.stop_reason = "stop", self.stops.stopped_by
        elif step.finish_reason is not None:
            out += self.stops.flush()
            self.finish_reason, self.stop_reason = step.finish_reason, step.stop_token
        return out

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_token_ids(self) -> list[int]:
        """Token ids not yet reported (``return_token_ids`` in a stream)."""
        out = self.token_ids[self.sent_ids :]
        self.sent_ids = len(self.token_ids)
        return out

    def take_logprobs(self) -> list[tuple[int, Any]]:
        """Logprob entries not yet sent (tokens whose text was held back come later)."""
        out = self.logprobs[self.sent_logprobs :]
        self.sent_logprobs = len(self.logprobs)
        return out


@dataclass(slots=True)
class Generation:
    """The engine requests of one HTTP request (prompts x n) and their choices."""

    backend: "LocalBackend"
    prompts: list[list[int]]
    params: GenerationParams
    max_tokens: int
    request_id: str
    constraints: list[Any] | None = None  # one TokenConstraint per choice
    choices: list[Choice] = field(default_factory=list)
    prediction: list[int] | None = None  # the prediction's token ids (Predicted Outputs)
    bad_words: tuple[tuple[int, ...], ...] = ()  # the token sequences params.bad_words forbid

    def __post_init__(self) -> None:
        tok = self.backend.engine.tokenizer
        n = self.params.n
        if self.params.beam_search:
            _check_beam_search(self.params)
        if self.params.bad_words:
            self.bad_words = bad_words_ids(tok, self.params.bad_words)
        if self.params.prediction is not None:
            # No answer outgrows the context, so no more of a prediction is ever drafted from;
            # the text is cut first, to tokenize little (SmolLM2's longest token spells 81
            # characters: 256 a token leaves room).
            limit = self.backend.engine.max_model_len
            ids = tok.encode(self.params.prediction[: 256 * limit], add_special_tokens=False, parse_special=False)
            self.prediction = ids[:limit]
        for p, prompt in enumerate(self.prompts):
            for i in range(n):
                self.choices.append(
                    Choice(
                        index=p * n + i,
                        prompt_index=p,
                        detok=IncrementalDetokenizer(tok, prompt, self.params.skip_special_tokens),
                        stops=StopChecker(self.params.stop, self.params.include_stop_str_in_output),
                        end_ids=tok.eos_token_ids,
                    )
                )

    def _engine_request(self, choice: Choice) -> EngineRequest:
        params = self.params
        sampling = params.sampling
        if sampling.seed is not None and choice.index:
            # Each choice its own stream of randomness, all reproducible from the one seed.
            sampling = _with_seed(sampling, sampling.seed + choice.index)
        return EngineRequest(
            request_id=f"{self.request_id}-{choice.index}",
            prompt_ids=self.prompts[choice.prompt_index],
            sampling=sampling,
            max_tokens=self.max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=params.stop_token_ids,
            bad_words=self.bad_words,
            ignore_eos=params.ignore_eos,
            priority=params.priority,
            cache_salt=params.cache_salt,
            constraint=self.constraints[choice.index] if self.constraints else None,
            extras=params.extras,
            adapter=params.adapter,
            # One choice per prompt scores it; the others read its scores (prompt_scores).
            prompt_logprobs=params.prompt_logprobs if self._leads(choice) else None,
            prediction=self.prediction,
        )

    def _leads(self, choice: Choice) -> bool:
        """Whether ``choice`` is its prompt's first (choices run prompt by prompt, n each)."""
        return choice.index % self.params.n == 0

    def prompt_scores(self, prompt_index: int) -> list[Any] | None:
        """The engine's prompt logprobs of prompt ``prompt_index`` (from its first choice)."""
        return self.choices[prompt_index * self.params.n].prompt_logprobs

    async def run(self) -> AsyncIterator[tuple[Choice, str, list[Any]]]:
        """Yield (choice, content text, tool-call deltas) whenever a choice has something new
        (its reasoning text too, in ``choice.reasoning_delta``) or has finished."""
        engine = self.backend.engine
        if self.params.beam_search:
            async for item in self._run_beam_search():
                yield item
            return
        if len(self.choices) == 1:
            choice = self.choices[0]
            async with aclosing(engine.generate(self._engine_request(choice))) as steps:
                async for step in steps:
                    text, calls = choice.absorb(step)
                    if text or calls or choice.reasoning_delta or choice.finished:
                        self._report(choice, text or choice.reasoning_delta or bool(calls))
                        yield choice, text, calls
                    if choice.finished:
                        return
            _check_finished(choice)
            return
        queue: asyncio.Queue[tuple[Choice, EngineStep | BaseException | None]] = asyncio.Queue()
        # A prompt's other choices start once its first has its first token: by then the
        # engine has the prompt's KV in its prefix cache, so they compute it once between them,
        # not n times over (as vLLM forks a prompt's sequences after its prefill).
        prefilled = {p: asyncio.Event() for p in range(len(self.prompts))}

        async def pump(choice: Choice) -> None:
            leads = self._leads(choice)
            try:
                if not leads:
                    await prefilled[choice.prompt_index].wait()
                async with aclosing(engine.generate(self._engine_request(choice))) as steps:
                    async for step in steps:
                        await queue.put((choice, step))
                        if leads:
                            prefilled[choice.prompt_index].set()
                        if step.finish_reason is not None:
                            return
                await queue.put((choice, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((choice, exc))
            finally:
                if leads:
                    prefilled[choice.prompt_index].set()  # whatever happened, the others go on

        tasks = {choice.index: asyncio.create_task(pump(choice)) for choice in self.choices}
        try:
            pending = len(self.choices)
            while pending:
                choice, item = await queue.get()
                if choice.finished:
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    _check_finished(choice)
                text, calls = choice.absorb(item)
                if text or calls or choice.reasoning_delta or choice.finished:
                    self._report(choice, text or choice.reasoning_delta or bool(calls))
                    yield choice, text, calls
                if choice.finished:
                    pending -= 1
                    tasks[choice.index].cancel()  # a stop string: the engine may stop now
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _run_beam_search(self) -> AsyncIterator[tuple[Choice, str, list[Any]]]:
        """Each prompt's beam search (all at once); then each choice takes its beam whole, as
        one step of all its tokens."""
        from .beam_search import BeamSearch, all_or_none

        n, tok = self.params.n, self.backend.engine.tokenizer
        searches = [
            BeamSearch(self.backend.engine, self._engine_request(self.choices[p * n]), n, self.params.length_penalty,
                       frozenset() if self.params.ignore_eos else tok.eos_token_ids, self.params.sampling.logprobs)
            for p in range(len(self.prompts))
        ]
        results = await all_or_none([s.run() for s in searches])
        for choice in self.choices:
            beams, first = results[choice.prompt_index]
            rank = choice.index % n
            if rank >= len(beams):  # bad_words left fewer than n candidates
                raise EngineError(f"beam search found {len(beams)} beam(s) for n = {n}")
            beam = beams[rank]
            step = EngineStep(
                beam.tokens,
                beam.logprobs if self.params.sampling.logprobs is not None else None,
                beam.finish_reason or "length",
                beam.stop_token,
                first.cached_tokens,
                first.prompt_logprobs if rank == 0 else None,
            )
            text, calls = choice.absorb(step)
            self._report(choice, text or choice.reasoning_delta or bool(calls))
            yield choice, text, calls

    def _report(self, choice: Choice, text: str | bool) -> None:
        record = self.params.record
        if record is not None:
            if text:
                record.event(text if isinstance(text, str) else "")
            if choice.finished:
                record.finished(choice.finish_reason)

    def report_usage(self) -> Usage:
        """The usage so far, also handed to the request's record (metrics, log line)."""
        usage = self.usage()
        if self.params.record is not None:
            details = usage.prompt_tokens_details
            self.params.record.usage(
                usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else 0
            )
        return usage

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        n = self.params.n
        cached = sum(self.choices[p * n].cached_tokens for p in range(len(self.prompts)))
        usage = Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        if self.prediction is not None or any(c.reasoning is not None for c in self.choices):
            usage.completion_tokens_details = CompletionTokensDetails(
                reasoning_tokens=sum(c.reasoning_tokens for c in self.choices),
                accepted_prediction_tokens=sum(c.prediction_tokens[0] for c in self.choices),
                rejected_prediction_tokens=sum(c.prediction_tokens[1] for c in self.choices),
            )
        return usage


async def _constraints(backend: "LocalBackend", params: GenerationParams, count: int) -> list[Any] | None:
    """Each choice's constraint, as a plan the engine's side builds a matcher from. The grammar
    is compiled where the engine runs, here, before any byte of a stream (a bad one is a 400
    naming its field)."""
    spec = params.constraint
    if spec is None:
        return None
    await backend.engine.check_constraint(spec)
    return [ConstraintPlan(spec)] * count


def _check_beam_search(params: GenerationParams) -> None:
    """Refuse, by field, what a beam search cannot honour (router/beam_search.py)."""
    s = params.sampling
    refused = [
        ("presence_penalty", s.presence_penalty != 0.0),
        ("frequency_penalty", s.frequency_penalty != 0.0),
        ("repetition_penalty", s.repetition_penalty != 1.0),
        ("logit_bias", bool(s.logit_bias)),
        # The engines rank a step's alternatives before this mask: the allowed ones would be missed.
        ("allowed_token_ids", s.allowed_token_ids is not None),
        ("prediction", params.prediction is not None),
    ]
    if params.constraint is not None:  # structured outputs, a forced tool call: named by its field
        refused.append((params.constraint.param, True))
    for name, used in refused:
        if used:
            raise BadRequest(f"{name} cannot be combined with use_beam_search.", param=name)


def engine_failure(exc: EngineError) -> APIError:
    """What the client sees of an engine's failure: a 500, except for an adapter unloaded after
    the request found it (a model that no longer exists: 404) and a worker process that ended
    under it (503: the model loads again on the next request)."""
    if isinstance(exc, UnknownAdapter):
        return ModelNotFound(exc.adapter)
    if isinstance(exc, WorkerLost):
        return Unavailable(f"{exc}; try again.", code="model_unavailable", headers={"Retry-After": "1"})
    return ServerError(f"The engine failed: {exc}")


def _failed(gen: Generation) -> None:
    gen.report_usage()
    if gen.params.record is not None:
        gen.params.record.finished("error")


def _check_finished(choice: Choice) -> None:
    if not choice.finished:
        raise EngineError("the engine ended the sequence without a finish reason")


def _with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    out = SamplingParams(**{k: getattr(sampling, k) for k in SamplingParams.__slots__})
    out.seed = seed
    return out


# --- shared request checks -------------------------------------------------------------------


def _check_logit_bias(params: GenerationParams, tokenizer: Tokenizer) -> None:
    bias = params.sampling.logit_bias
    if not bias:
        return
    for token in bias:
        if not 0 <= token < tokenizer.vocab_size:
            raise BadRequest(
                f"logit_bias names token id {token}, outside the vocabulary "
                f"(0 to {tokenizer.vocab_size - 1}).",
                param="logit_bias",
            )


def _check_allowed_ids(params: GenerationParams, tokenizer: Tokenizer) -> None:
    """``allowed_token_ids`` must leave something to sample at every step: ids in the vocabulary,
    not all of them held back by ``min_tokens``, and no grammar that could want another token."""
    allowed = params.sampling.allowed_token_ids
    if allowed is None:
        return
    if allowed[-1] >= tokenizer.vocab_size:  # sorted
        raise BadRequest(
            f"allowed_token_ids names token id {allowed[-1]}, outside the vocabulary "
            f"(0 to {tokenizer.vocab_size - 1}).",
            param="allowed_token_ids",
        )
    if params.constraint is not None or params.tools:
        raise BadRequest(
            "allowed_token_ids cannot be combined with structured outputs or tools.", param="allowed_token_ids"
        )
    ending = tokenizer.eos_token_ids | params.stop_token_ids
    if params.min_tokens and not params.ignore_eos and set(allowed) <= ending:
        raise BadRequest(
            "allowed_token_ids holds only end tokens, which min_tokens forbids at first.", param="allowed_token_ids"
        )


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --- chat -------------------------------------------------------------------------------------


def chat_prompt(backend: "LocalBackend", request: Any, params: GenerationParams, parser: Any) -> list[int]:
    """The token ids a chat request's messages become (before any truncation)."""
    return build_chat_prompt(
        backend.template,
        backend.engine.tokenizer,
        request.messages,
        tools=params.tools,
        add_generation_prompt=params.add_generation_prompt,
        continue_final_message=params.continue_final_message,
        template_kwargs=_template_kwargs(params),
        tool_format=backend.config.tool_parser if parser is not None else None,
    )


def count_chat_prompt(backend: "LocalBackend", request: Any, params: GenerationParams) -> int:
    """How many tokens a chat request's prompt takes: what its usage reports as prompt tokens."""
    return len(chat_prompt(backend, request, params, _tool_parser(backend, params)))


async def chat(backend: "LocalBackend", request: Any, params: GenerationParams) -> bytes | AsyncIterator[bytes]:
    engine = backend.engine
    tok = engine.tokenizer
    parser = _tool_parser(backend, params)
    prompt = chat_prompt(backend, request, params, parser)
    prompt = truncate_prompt(prompt, params.truncate_prompt_tokens, params.max_tokens, engine.max_model_len)
    if params.fit_max_tokens and params.max_tokens is not None:
        # Anthropic's clients send large fixed budgets: what the context leaves is the most.
        params.max_tokens = min(params.max_tokens, max(engine.max_model_len - len(prompt), 0)) or None
    max_tokens = check_length(len(prompt), params.max_tokens, engine.max_model_len, "messages")
    if params.max_tokens is None and params.max_tokens_cap is not None:
        max_tokens = min(max_tokens, params.max_tokens_cap)
    _check_logit_bias(params, tok)
    _check_allowed_ids(params, tok)
    constraints = await _constraints(backend, params, params.n)
    thinking = _reasoning_parser(backend, params, prompt)
    if constraints is not None and thinking is not None:
        constraints = _after_reasoning(constraints, thinking, params, tok)
    formats = [f for f in (parser, thinking.func if thinking is not None else None) if f is not None]
    if any(f.reads_control_tokens for f in formats):
        params.skip_special_tokens = False  # the format's markers are control tokens
    gen = Generation(backend, [prompt], params, max_tokens, _request_id("chatcmpl"), constraints)
    for c in gen.choices:
        if parser is not None and (thinking is None or thinking.func is not parser):
            c.tools = parser(params.tools)
        c.reasoning_field, c.show_reasoning = backend.config.reasoning_parser is not None, params.include_reasoning
        if thinking is not None:
            c.reasoning = thinking()
    echo = _chat_echo(request) if params.echo else ""
    model = request.model
    created = int(time.time())
    if params.stream:
        return _chat_stream(gen, model, created, echo)
    try:
        async for _ in gen.run():
            pass
    except EngineError as exc:
        raise engine_failure(exc) from None
    choices = [
        ChatChoice(
            index=c.index,
            message=_message(echo + c.text, c),
            logprobs=_chat_logprobs(tok, c.logprobs, params.return_tokens_as_token_ids)
            if params.sampling.logprobs is not None
            else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            **({"token_ids": c.token_ids} if params.return_token_ids else {}),
        )
        for c in gen.choices
    ]
    body = ChatCompletion(
        id=gen.request_id,
        created=created,
        model=model,
        choices=choices,
        usage=gen.report_usage(),
        prompt_token_ids=prompt if params.return_token_ids else UNSET,
        prompt_logprobs=UNSET
        if params.prompt_logprobs_field is None
        else _prompt_logprob_entries(tok, prompt, gen.prompt_scores(0), params.prompt_logprobs_field),
    )
    return _json.encode(body)


def _template_kwargs(params: GenerationParams) -> dict[str, Any] | None:
    if params.reasoning_effort is None:
        return params.chat_template_kwargs
    return {"reasoning_effort": params.reasoning_effort, **(params.chat_template_kwargs or {})}


def _tool_parser(backend: "LocalBackend", params: GenerationParams) -> Any:
    """The model's tool parser class when the request has tools; with tool_choice "required" or a
    named function, also the grammar that makes the output a well-formed call."""
    if not params.tools:
        return None
    name = backend.config.tool_parser
    if name is None:
        raise BadRequest(
            f"Model `{params.adapter or backend.name}` has no tool_parser configured, so it cannot take tools.",
            param="tools",
        )
    from .constraints import ConstraintSpec
    from .harmony import HarmonyParser
    from .tools import get_parser

    # Harmony's calls are read by the same parser as its reasoning (see _reasoning_parser).
    parser = HarmonyParser if name == "openai" else get_parser(name)
    if params.tool_choice not in (None, "auto", "none"):
        if params.constraint is not None:
            raise BadRequest(
                "tool_choice `required` or a named function cannot be combined with another output constraint.",
                param="tool_choice",
            )
        forced = None if params.tool_choice == "required" else params.tool_choice
        # A named function means one call to it; "required" may call several when allowed.
        from .tools.grammar import control_markers

        try:
            grammar = parser.grammar(params.tools, forced, params.parallel_tool_calls and forced is None,
                                     control_markers(backend.engine.tokenizer))
        except ValueError as exc:
            raise BadRequest(str(exc), param="tool_choice") from None
        params.constraint = ConstraintSpec("grammar", grammar, "tool_choice")
    return parser


def _reasoning_parser(backend: "LocalBackend", params: GenerationParams, prompt: list[int]) -> Any:
    """The model's reasoning parser for this request's choices, a ``partial`` that makes one per
    choice, or None when the model has none."""
    name = backend.config.reasoning_parser
    if name is None:
        return None
    from .harmony import HarmonyParser

    if name == HarmonyParser.name:
        return partial(HarmonyParser, params.tools)
    from .reasoning import PARSERS

    parser = PARSERS[name]
    return partial(parser, _prompt_opens_thinking(backend.engine.tokenizer, prompt, parser))


def _prompt_opens_thinking(tok: Tokenizer, prompt: list[int], parser: Any) -> bool:
    from .reasoning import prompt_opens_thinking

    # The last few tokens are enough to see whether the template ends the prompt with <think>
    # (spelled out where the format's markers are control tokens, as Mistral's [THINK] is).
    tail = tok.decode(prompt[-8:], skip_special_tokens=False) if parser.reads_control_tokens else tok.decode(prompt[-8:])
    return prompt_opens_thinking(tail, parser.open_marker)


def _after_reasoning(constraints: list[Any], thinking: partial, params: GenerationParams,
                     tok: Tokenizer) -> list[Any]:
    """The constraints a thinking model's choices get: each begins once the reasoning has ended
    (router/thinking_gate.py), as vLLM's do. Not harmony's forced call, whose grammar holds the
    analysis message and then writes the call's own header; nor where a Qwen3 reply would have to open its block with a ``<think>``
    that is not one token (the grammar then governs from the first token, all of it content).

    ``thinking``: what :func:`_reasoning_parser` returned; a think-block parser's one argument
    says whether the prompt leaves a block open."""
    from .harmony import HarmonyParser
    from .thinking_gate import ReasoningGate

    parser, opener = thinking.func, None
    if parser is HarmonyParser:
        if params.constraint.param == "tool_choice":
            return constraints
        end = HarmonyParser.answer_marker
    else:
        end = parser.close_marker.encode()
        (prompt_opens,) = thinking.args
        if not parser.starts_thinking and not prompt_opens:
            ids = tok.encode(parser.open_marker, add_special_tokens=False, parse_special=True)
            if len(ids) != 1:
                return constraints
            opener = ids[0]
    gate = ReasoningGate.of(end, opener)
    return [replace(c, gate=gate) for c in constraints]


def _message(content: str, choice: Choice) -> ResponseMessage:
    reasoning: Any = UNSET
    if choice.reasoning_field:
        reasoning = choice.reasoning.reasoning if choice.reasoning is not None and choice.show_reasoning else None
        if reasoning is not None and not content:
            content = None  # the reply ended while the model was still thinking (vLLM's shape)
    found = choice.tool_calls
    if not found:
        return ResponseMessage(role="assistant", content=content, reasoning=reasoning)
    calls = [ResponseToolCall(id=c.id, function=ResponseToolCallFunction(c.name, c.arguments)) for c in found]
    return ResponseMessage(role="assistant", content=content or None, tool_calls=calls, reasoning=reasoning)


def _delta_calls(calls: list[Any]) -> list[DeltaToolCall]:
    out = []
    for d in calls:
        if d.id is not None:
            out.append(DeltaToolCall(index=d.index, id=d.id, type="function",
                                     function=DeltaToolCallFunction(name=d.name, arguments=d.arguments)))
        else:
            out.append(DeltaToolCall(index=d.index, function=DeltaToolCallFunction(arguments=d.arguments)))
    return out


def _chat_echo(request: Any) -> str:
    """vLLM's chat ``echo``: the reply repeats the last message when it is the assistant's."""
    last = request.messages[-1]
    if isinstance(last, AssistantMessage) and isinstance(last.content, str):
        return last.content
    return ""


async def _chat_stream(
    gen: Generation, model: str, created: int, echo: str
) -> AsyncIterator[bytes]:
    params = gen.params
    tok = gen.backend.engine.tokenizer
    want_logprobs = params.sampling.logprobs is not None

    def chunk(choices: list[ChunkChoice], usage: Any = UNSET, **extra: Any) -> bytes:
        return sse.event(
            _json.encode(
                ChatCompletionChunk(
                    id=gen.request_id, created=created, model=model, choices=choices, usage=usage, **extra
                )
            )
        )

    def running_usage() -> Any:
        return gen.usage() if params.continuous_usage else UNSET

    try:
        for c in gen.choices:
            yield chunk(
                [ChunkChoice(index=c.index, delta=Delta(role="assistant", content=""))],
                running_usage(),
                **({"prompt_token_ids": gen.prompts[0]} if params.return_token_ids else {}),
            )
            if echo:
                yield chunk([ChunkChoice(index=c.index, delta=Delta(content=echo))], running_usage())
        async for c, text, calls in gen.run():
            entries = c.take_logprobs() if want_logprobs else None
            extra: dict[str, Any] = {}
            if c.finished:
                extra["stop_reason"] = c.stop_reason
            if params.return_token_ids:
                extra["token_ids"] = c.take_token_ids()
            delta = Delta()
            if c.reasoning_delta:
                delta.reasoning = c.reasoning_delta
            if text:
                delta.content = text
            if calls:
                delta.tool_calls = _delta_calls(calls)
            yield chunk(
                [
                    ChunkChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=_chat_logprobs(tok, entries, params.return_tokens_as_token_ids) if want_logprobs else None,
                        finish_reason=c.finish_reason,
                        **extra,
                    )
                ],
                running_usage(),
            )
        usage = gen.report_usage()
        if params.include_usage:
            yield chunk([], usage)
    except APIError as exc:
        _failed(gen)
        yield sse.event(exc.to_json())
    except EngineError as exc:
        _failed(gen)
        yield sse.event(engine_failure(exc).to_json())
    except Exception:  # noqa: BLE001 - a stream can only end with an error event now
        _failed(gen)
        log.exception("stream %s failed", gen.request_id)
        yield sse.event(ServerError("Internal error while generating.").to_json())
    yield sse.DONE


def _clamp(lp: float) -> float:
    return lp if lp > _LOGPROB_FLOOR else _LOGPROB_FLOOR


def _chat_logprobs(tok: Tokenizer, entries: Sequence[tuple[int, Any]] | None, as_ids: bool = False) -> ChoiceLogprobs:
    """``logprobs.content``; with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``) each token
    named ``token_id:<id>``, its ``bytes`` still the token's own."""
    content = []
    for token_id, lp in entries or ():
        b = tok.token_bytes(token_id)
        top = []
        for alt_id, alt_lp in lp.top:
            ab = tok.token_bytes(alt_id)
            top.append(TopLogprob(_name(alt_id, ab, as_ids), _clamp(alt_lp), list(ab)))
        content.append(TokenLogprob(_name(token_id, b, as_ids), _clamp(lp.logprob), list(b), top))
    return ChoiceLogprobs(content=content)


def _name(token_id: int, data: bytes, as_ids: bool) -> str:
    """How logprobs name a token: its text (a partial UTF-8 character as U+FFFD), or with
    ``as_ids`` ``token_id:<id>``, which no two tokens share."""
    return f"token_id:{token_id}" if as_ids else data.decode("utf-8", "replace")


# --- completions ------------------------------------------------------------------------------


async def complete(backend: "LocalBackend", request: Any, params: GenerationParams) -> bytes | AsyncIterator[bytes]:
    engine = backend.engine
    tok = engine.tokenizer
    if request.suffix:
        raise BadRequest("suffix is not supported.", param="suffix")
    if request.best_of is not None and request.best_of != params.n:
        raise BadRequest("best_of must equal n when given.", param="best_of")
    # Remote upstreams score prompts themselves; a local engine must be able to.
    if _lists_prompt(params) and "prompt_logprobs" not in backend.capabilities:
        raise BadRequest(
            f"Model `{request.model}` cannot score its prompt: echo with logprobs is not supported.",
            param="echo",
            code="unsupported_parameter",
        )
    prompts = completion_prompts(request.prompt, tok)
    max_tokens = params.max_tokens if params.max_tokens is not None else min(16, params.max_tokens_cap or 16)
    whole = prompts
    prompts = [truncate_prompt(ids, params.truncate_prompt_tokens, max_tokens, engine.max_model_len) for ids in whole]
    for ids in prompts:
        check_length(len(ids), max_tokens, engine.max_model_len, "prompt")
    _check_logit_bias(params, tok)
    _check_allowed_ids(params, tok)
    constraints = await _constraints(backend, params, len(prompts) * params.n)
    gen = Generation(backend, prompts, params, max_tokens, _request_id("cmpl"), constraints)
    echoes = [""] * len(prompts)
    if params.echo:
        raw = request.prompt
        if isinstance(raw, str):
            echoes = [raw]
        elif isinstance(raw[0], str):
            echoes = list(raw)
        else:
            echoes = [tok.decode(ids) for ids in prompts]
        # A truncated prompt echoes what the model saw.
        echoes = [e if cut is ids else tok.decode(cut) for e, cut, ids in zip(echoes, prompts, whole)]
    model = request.model
    created = int(time.time())
    if params.stream:
        return _completion_stream(gen, model, created, echoes)
    try:
        async for _ in gen.run():
            pass
    except EngineError as exc:
        raise engine_failure(exc) from None
    choices = []
    for c in gen.choices:
        echo = echoes[c.prompt_index]
        logprobs = None
        if params.sampling.logprobs is not None:
            as_ids = params.return_tokens_as_token_ids
            if _lists_prompt(params):
                prompt_ids = gen.prompts[c.prompt_index]
                prompt_lp = _prompt_logprobs(
                    tok, prompt_ids, gen.prompt_scores(c.prompt_index), params.sampling.logprobs, as_ids
                )
                generated = _completion_logprobs(tok, c.logprobs, _text_length(tok, prompt_ids), as_ids=as_ids)
                logprobs = _joined(prompt_lp, generated)
            else:
                logprobs = _completion_logprobs(tok, c.logprobs, len(echo), as_ids=as_ids)
        choices.append(
            CompletionChoice(
                index=c.index,
                text=echo + c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                **(
                    {"token_ids": c.token_ids, "prompt_token_ids": gen.prompts[c.prompt_index]}
                    if params.return_token_ids
                    else {}
                ),
                **(
                    {"prompt_logprobs": _prompt_logprob_entries(
                        tok, gen.prompts[c.prompt_index], gen.prompt_scores(c.prompt_index), params.prompt_logprobs_field
                    )}
                    if params.prompt_logprobs_field is not None
                    else {}
                ),
            )
        )
    body = Completion(id=gen.request_id, created=created, model=model, choices=choices, usage=gen.report_usage())
    return _json.encode(body)


async def _completion_stream(
    gen: Generation, model: str, created: int, echoes: list[str]
) -> AsyncIterator[bytes]:
    params = gen.params
    tok = gen.backend.engine.tokenizer
    want_logprobs = params.sampling.logprobs is not None
    offsets = {c.index: len(echoes[c.prompt_index]) for c in gen.choices}
    # With the prompt's logprobs the echo waits for them (they come with the first token), and
    # goes out in the choice's first chunk, before its first text, as vLLM sends it.
    unechoed = {c.index for c in gen.choices} if _lists_prompt(params) else set()

    def chunk(choices: list[CompletionChoice], usage: Any = UNSET) -> bytes:
        return sse.event(
            _json.encode(Completion(id=gen.request_id, created=created, model=model, choices=choices, usage=usage))
        )

    def running_usage() -> Any:
        return gen.usage() if params.continuous_usage else UNSET

    try:
        for c in gen.choices:
            echo = echoes[c.prompt_index]
            if echo and c.index not in unechoed:
                yield chunk([CompletionChoice(index=c.index, text=echo, logprobs=None, finish_reason=None)])
        async for c, text, _ in gen.run():
            prompt = None
            if c.index in unechoed:
                unechoed.discard(c.index)
                text = echoes[c.prompt_index] + text
                prompt = _prompt_logprobs(
                    tok, gen.prompts[c.prompt_index], gen.prompt_scores(c.prompt_index), params.sampling.logprobs,
                    params.return_tokens_as_token_ids,
                )
                offsets[c.index] = _text_length(tok, gen.prompts[c.prompt_index])
            logprobs = None
            if want_logprobs:
                entries = c.take_logprobs()
                logprobs = _completion_logprobs(tok, entries, offsets[c.index], as_ids=params.return_tokens_as_token_ids)
                offsets[c.index] += _text_length(tok, [token_id for token_id, _ in entries])
            if prompt is not None:
                logprobs = _joined(prompt, logprobs) if logprobs is not None else prompt
            extra: dict[str, Any] = {}
            if params.return_token_ids:
                extra["token_ids"] = c.take_token_ids()
            yield chunk(
                [
                    CompletionChoice(
                        index=c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason if c.finished else UNSET,
                        **extra,
                    )
                ],
                running_usage(),
            )
        usage = gen.report_usage()
        if params.include_usage:
            yield chunk([], usage)
    except APIError as exc:
        _failed(gen)
        yield sse.event(exc.to_json())
    except EngineError as exc:
        _failed(gen)
        yield sse.event(engine_failure(exc).to_json())
    except Exception:  # noqa: BLE001
        _failed(gen)
        log.exception("stream %s failed", gen.request_id)
        yield sse.event(ServerError("Internal error while generating.").to_json())
    yield sse.DONE


def _completion_logprobs(
    tok: Tokenizer, entries: Sequence[tuple[int, Any]], offset: int, k: int | None = None, as_ids: bool = False
) -> CompletionLogprobs:
    """The legacy logprobs object. ``top_logprobs`` holds the token itself and the ``k`` most
    likely ones (up to k + 1 entries: OpenAI's "always the sampled token", as vLLM does; ``k``
    None: every alternative the entry has). With ``as_ids`` tokens are named ``token_id:<id>``;
    offsets still count the tokens' texts."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, lp in entries:
        data = tok.token_bytes(token_id)
        name = _name(token_id, data, as_ids)
        offsets.append(offset)
        offset += len(data.decode("utf-8", "replace"))
        tokens.append(name)
        token_logprobs.append(_clamp(lp.logprob))
        alts: dict[str, float] = {name: _clamp(lp.logprob)}
        for alt_id, alt_lp in lp.top[:k]:
            alts.setdefault(_name(alt_id, tok.token_bytes(alt_id), as_ids), _clamp(alt_lp))
        top.append(alts)
    return CompletionLogprobs(text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top)


def _prompt_logprobs(
    tok: Tokenizer, prompt_ids: list[int], entries: Sequence[Any] | None, k: int | None, as_ids: bool = False
) -> CompletionLogprobs:
    """``echo`` with ``logprobs``: an entry per prompt token, offsets from the start of the
    echoed text; the first token's logprob and alternatives are null (nothing precedes it)."""
    first = _token_text(tok, prompt_ids[0])
    rest = _completion_logprobs(tok, list(zip(prompt_ids[1:], entries or ())), len(first), k, as_ids)
    name = _name(prompt_ids[0], tok.token_bytes(prompt_ids[0]), as_ids)
    return _joined(CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[name], top_logprobs=[None]), rest)


def _prompt_logprob_entries(
    tok: Tokenizer, prompt_ids: list[int], entries: Sequence[Any] | None, k: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: null for the first token, then per token a map from token id
    to logprob, rank and text: the prompt's token first, then the ``k`` most likely (ranks 1..k)."""
    out: PromptLogprobs = [None]
    for token_id, lp in zip(prompt_ids[1:], entries or ()):
        entry = {str(token_id): PromptLogprob(_clamp(lp.logprob), lp.rank, _token_text(tok, token_id))}
        for rank, (alt_id, alt_lp) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(alt_id), PromptLogprob(_clamp(alt_lp), rank, _token_text(tok, alt_id)))
        out.append(entry)
    return out


def _token_text(tok: Tokenizer, token_id: int) -> str:
    """A token's text as the legacy logprobs show it (a partial UTF-8 character as U+FFFD)."""
    return tok.token_bytes(token_id).decode("utf-8", "replace")


def _lists_prompt(params: GenerationParams) -> bool:
    """Completions' ``echo`` with ``logprobs``: the logprobs list the prompt's tokens first."""
    return params.echo and params.sampling.logprobs is not None


def _text_length(tok: Tokenizer, ids: Sequence[int]) -> int:
    """How far the offsets move over these tokens: where the next token's text starts. With the
    prompt's tokens listed, offsets count token texts (a BOS token's included), as vLLM counts
    them, so they can run past the echoed prompt string."""
    return sum(len(_token_text(tok, t)) for t in ids)


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


# --- tokenize ---------------------------------------------------------------------------------


def tokenize(backend: "LocalBackend", request: Any) -> bytes:
    """``/tokenize``: the ids a chat or completions request with the same input would use."""
    tok = backend.engine.tokenizer
    if (request.prompt is None) == (request.messages is None):
        raise BadRequest("Send exactly one of `prompt` and `messages`.", param="prompt")
    if request.messages is not None:
        if request.continue_final_message and request.add_generation_prompt:
            raise BadRequest(
                "continue_final_message and add_generation_prompt cannot both be true.",
                param="continue_final_message",
            )
        ids = build_chat_prompt(
            backend.template,
            tok,
            request.messages,
            tools=[msgspec.to_builtins(t) for t in request.tools] if request.tools else None,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
            tool_format=backend.config.tool_parser,
        )
        if request.add_special_tokens:
            ids = tok.encode("", add_special_tokens=True) + ids
    else:
        add = True if request.add_special_tokens is None else request.add_special_tokens
        ids = tok.encode(request.prompt, add_special_tokens=add)
    return _json.encode(
        TokenizeResponse(
            count=len(ids),
            max_model_len=backend.max_model_len,
            tokens=ids,
            token_strs=[tok.token_str(t) for t in ids] if request.return_token_strs else None,
        )
    )


def detokenize(backend: "LocalBackend", request: Any) -> bytes:
    tok = backend.engine.tokenizer
    bad = next((t for t in request.tokens if t >= tok.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            f"Token id {bad} is out of the vocabulary (0 to {tok.vocab_size - 1}).", param="tokens"
        )
    return _json.encode(DetokenizeResponse(prompt=tok.decode(request.tokens)))
