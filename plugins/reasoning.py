"""``include_reasoning`` (vLLM's name): whether a reply carries a thinking model's ``reasoning``;
``reasoning_effort`` (OpenAI's): how hard the model should think.

Only models with a ``reasoning_parser`` in router.toml split reasoning from content
(``router/reasoning.py``); false drops the reasoning from the message and the stream. The
model still thinks: its reasoning tokens are generated and counted in ``completion_tokens``.

``reasoning_effort`` reaches the chat template as the variable of that name (gpt-oss's template
writes it into its system message as ``Reasoning: low``); a ``reasoning_effort`` in
``chat_template_kwargs`` wins. Templates that do not read it ignore it, as vLLM's do.
"""

from __future__ import annotations

from typing import Any, Literal

from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("include_reasoning", bool, True, ("chat",),
                     "Send a thinking model's reasoning in `reasoning` (default true); false drops it."),
        RequestField("reasoning_effort", Literal["low", "medium", "high"] | None, None, ("chat",),
                     "How much a thinking model should reason, for templates that take it (gpt-oss's)."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    if endpoint == "chat":
        params.include_reasoning = request.include_reasoning
        params.reasoning_effort = request.reasoning_effort
