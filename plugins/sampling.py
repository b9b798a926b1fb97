"""Sampling extras beyond the OpenAI set (vLLM's names).

``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``return_token_ids``, ``prompt_logprobs``,
``allowed_token_ids``, ``bad_words``, ``skip_special_tokens`` and ``return_tokens_as_token_ids``. Each one the request actually uses is declared as a capability the model
must have, so a backend that cannot honour it answers 400 instead of ignoring it.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from router.errors import BadRequest
from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("top_k", Annotated[int, Meta(ge=-1)] | None, None,
                     description="Sample from the k most likely tokens; 0 or -1 turns it off."),
        RequestField("min_p", Annotated[float, Meta(ge=0.0, le=1.0)] | None, None,
                     description="Drop tokens less likely than min_p times the most likely one."),
        RequestField("repetition_penalty", Annotated[float, Meta(gt=0.0, le=2.0)] | None, None,
                     description="Divide logits of tokens seen in prompt or output (>1 discourages)."),
        RequestField("min_tokens", Annotated[int, Meta(ge=0)] | None, None,
                     description="Generate at least this many tokens before EOS or stop tokens."),
        RequestField("ignore_eos", bool | None, None,
                     description="Keep generating past the end-of-sequence token."),
        RequestField("stop_token_ids", list[Annotated[int, Meta(ge=0)]] | None, None,
                     description="Token ids that end the sequence (not shown in the output)."),
        RequestField("include_stop_str_in_output", bool | None, None,
                     description="Keep the matched stop string at the end of the output."),
        RequestField("return_token_ids", bool | None, None,
                     description="Also return prompt_token_ids and each choice's token_ids."),
        RequestField("allowed_token_ids", list[Annotated[int, Meta(ge=0)]] | None, None,
                     description="Sample only among these token ids."),
        RequestField("bad_words", list[str] | None, None,
                     description="Words the reply may not contain, as the tokenizer spells them."),
        RequestField("prompt_logprobs", Annotated[int, Meta(ge=0, le=20)] | None, None,
                     description="Also return each prompt token's logprob, rank and this many most "
                                 "likely alternatives (not with stream)."),
        RequestField("skip_special_tokens", bool | None, None,
                     description="Leave control tokens out of the text (default true); false spells them out."),
        RequestField("return_tokens_as_token_ids", bool | None, None,
                     description="Name each token in logprobs `token_id:<id>` (tokens whose text is not "
                                 "unique or not whole UTF-8 can be told apart)."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    s = params.sampling
    if request.top_k not in (None, 0, -1):
        s.top_k = request.top_k
        params.require("top_k", "top_k")
    if request.min_p:
        s.min_p = request.min_p
        params.require("min_p", "min_p")
    if request.repetition_penalty not in (None, 1.0):
        s.repetition_penalty = request.repetition_penalty
        params.require("repetition_penalty", "repetition_penalty")
    if request.min_tokens:
        params.min_tokens = request.min_tokens
        params.require("min_tokens", "min_tokens")
    if request.ignore_eos:
        params.ignore_eos = True
        params.require("ignore_eos", "ignore_eos")
    if request.stop_token_ids:
        params.stop_token_ids = frozenset(request.stop_token_ids)
        params.require("stop_token_ids", "stop_token_ids")
    if request.include_stop_str_in_output:
        params.include_stop_str_in_output = True
    if request.return_token_ids:
        params.return_token_ids = True
    if request.return_tokens_as_token_ids:
        params.return_tokens_as_token_ids = True
    if request.skip_special_tokens is False:
        params.skip_special_tokens = False
        params.require("skip_special_tokens", "skip_special_tokens")
    if request.bad_words:
        params.bad_words = list(request.bad_words)
        params.require("bad_words", "bad_words")
    if request.allowed_token_ids is not None:
        if not request.allowed_token_ids:
            raise BadRequest("allowed_token_ids must name at least one token id.", param="allowed_token_ids")
        s.allowed_token_ids = tuple(sorted(set(request.allowed_token_ids)))
        params.require("allowed_token_ids", "allowed_token_ids")
    if request.prompt_logprobs is not None:
        if request.stream:
            if request.prompt_logprobs:  # 0 is let through and ignored, as vLLM does
                raise BadRequest("prompt_logprobs is not available when stream is true.", param="prompt_logprobs")
            return
        # completions' echo with logprobs may already score the prompt: one pass serves both.
        params.prompt_logprobs = max(params.prompt_logprobs or 0, request.prompt_logprobs)
        params.prompt_logprobs_field = request.prompt_logprobs
        params.require("prompt_logprobs", "prompt_logprobs")
