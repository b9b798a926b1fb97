"""``use_beam_search`` and ``length_penalty`` (vLLM's names) on both endpoints.

The request's ``n`` choices are then the ``n`` best beams of a beam search of width ``n``, best
first, ranked by ``cum_logprob / length ** length_penalty`` (router/beam_search.py). As in vLLM
the search scores the model's raw logprobs, so sampling options (temperature, top_p, top_k,
min_p, seed) change nothing. Options that would change a sampled answer and that beam search
cannot honour (penalties, logit_bias, allowed_token_ids, an output constraint, a prediction) are
a 400 naming the field; a stream sends each choice's text once the search ends. Without
``use_beam_search``, ``length_penalty`` is accepted and means nothing, as in vLLM (whose
requests always carry it).
"""

from __future__ import annotations

from typing import Any

from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("use_beam_search", bool | None, None,
                     description="Return the n best beams of a beam search of width n instead of n samples."),
        RequestField("length_penalty", float | None, None,
                     description="Beam search ranks beams by cum_logprob / length ** length_penalty (default 1)."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    if request.use_beam_search:
        params.beam_search = True
        params.require("use_beam_search", "use_beam_search")
        if request.length_penalty is not None:
            params.length_penalty = request.length_penalty
