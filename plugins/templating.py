"""Prompt-building extras (vLLM's names): ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` and chat ``echo``; ``truncate_prompt_tokens`` on both endpoints."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from router.errors import BadRequest
from router.hookspecs import RequestField, hookimpl


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField("add_generation_prompt", bool, True, ("chat",),
                     "Append the assistant header so the model starts a reply (default true)."),
        RequestField("continue_final_message", bool, False, ("chat",),
                     "Continue the last (assistant) message instead of starting a new one."),
        RequestField("chat_template_kwargs", dict[str, Any] | None, None, ("chat",),
                     "Extra variables for the chat template, e.g. enable_thinking."),
        RequestField("echo", bool, False, ("chat",),
                     "Prepend the last message to the reply when it is the assistant's."),
        RequestField("truncate_prompt_tokens", Annotated[int, Meta(ge=-1)] | None, None, ("chat", "completions"),
                     "Keep only the prompt's last k tokens (after the chat template); -1: as many as fit."),
    ]


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    params.truncate_prompt_tokens = request.truncate_prompt_tokens
    if endpoint != "chat":
        return
    if request.continue_final_message and request.add_generation_prompt:
        raise BadRequest(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the final message.",
            param="continue_final_message",
        )
    params.add_generation_prompt = request.add_generation_prompt
    params.continue_final_message = request.continue_final_message
    params.chat_template_kwargs = request.chat_template_kwargs
    params.echo = request.echo
