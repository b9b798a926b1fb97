"""``include_reasoning`` (vLLM's name): whether a reply carries a thinking model's ``reasoning``.

Only models with a ``reasoning_parser`` in router.toml split reasoning from content
(``router/reasoning.py``); false drops the reasoning from the message and the stream. The
model still thinks: its reasoning tokens are generated and counted in ``completion_tokens``.
"""

from __future__ import annotations

from typing import Any

from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("include_reasoning", bool, True, ("chat",),
                     "Send a thinking model's reasoning in `reasoning` (default true); false drops it."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    if endpoint == "chat":
        params.include_reasoning = request.include_reasoning
