"""What one request asks the serving pipeline for, after every plugin has had its say.

The frontend fills a :class:`GenerationParams` from the core OpenAI fields; then each plugin's
``prepare_request`` hook turns its own fields into entries here. Backends read only this object,
never the wire request, except the remote backend, which forwards the request itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .engine import SamplingParams
from .errors import BadRequest


@dataclass(slots=True)
class GenerationParams:
    """Everything the pipeline needs to serve one request."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    max_tokens: int | None = None
    max_tokens_cap: int | None = None
    """The model's ``max_tokens_limit``: the most a request may generate when it names no max."""
    fit_max_tokens: bool = False
    """A ``max_tokens`` beyond what the context leaves is lowered to it (Anthropic's door), not a 400."""
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    bad_words: list[str] = field(default_factory=list)
    """Words the reply may not contain, as the tokenizer spells them (router/bad_words.py)."""
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    """Share prefix-cache entries only with requests carrying the same salt (plugin cache_salt)."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (-1: as many as fit); see prompts.truncate_prompt."""
    prompt_logprobs: int | None = None
    """Score the prompt, with this many alternatives per token (the most any use below needs)."""
    prompt_logprobs_field: int | None = None
    """Return vLLM's ``prompt_logprobs`` field with this many alternatives per token (asked for
    by that extra, or by completions' ``echo`` with ``logprobs``, as vLLM does)."""
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    """Name each token in logprobs ``token_id:<id>`` instead of by its text."""
    skip_special_tokens: bool = True
    """Leave control tokens out of the text (false: spell them out, ``<|im_end|>``). A format
    whose markers are control tokens (harmony, Mistral's calls) keeps them whatever this says."""
    # chat templating
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    """Send a thinking model's reasoning (models with a ``reasoning_parser``)."""
    reasoning_effort: str | None = None
    """The template variable ``reasoning_effort`` unless ``chat_template_kwargs`` sets it."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    """None or "auto", "required", or the name of the function that must be called."""
    parallel_tool_calls: bool = True
    constraint: Any = None
    """A :class:`router.constraints.ConstraintSpec` the output must match (structured outputs)."""
    prediction: str | None = None
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat."""
    beam_search: bool = False
    """vLLM's ``use_beam_search``: the ``n`` choices are the best beams (router/beam_search.py)."""
    length_penalty: float = 1.0
    """Beam search ranks a beam by ``cum_logprob / length ** length_penalty``."""
    adapter: str | None = None
    """The LoRA adapter the request's model name stands for (see backend.AdapterModel); None:
    the base model."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Engine parameters a plugin defines for engines that know them (passed through as is)."""
    record: Any = None
    """The request's :class:`router.telemetry.RequestRecord`: backends report events to it."""
    requires: dict[str, str] = field(default_factory=dict)
    """Capability -> the request field that needs it; checked against the model's capabilities."""

    def require(self, capability: str, param: str) -> None:
        """Declare that this request needs ``capability`` of the model because of ``param``."""
        self.requires.setdefault(capability, param)

    def check_capabilities(self, model: str, backend: str, capabilities: frozenset[str]) -> None:
        for capability, param in self.requires.items():
            if capability not in capabilities:
                raise BadRequest(
                    f"Model `{model}` (backend `{backend}`) cannot honour `{param}`.",
                    param=param,
                    code="unsupported_parameter",
                )
