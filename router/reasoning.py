"""Reasoning parsers: a thinking model's ``<think> ... </think>`` text as ``reasoning``, the rest
as ``content``.

vLLM's ``--reasoning-parser``, here a local model's ``reasoning_parser`` in router.toml. The
response's message then has a ``reasoning`` field (what vLLM calls it; it was
``reasoning_content``), and stream deltas carry ``reasoning`` while the model thinks and
``content`` after. Tool calls are looked for in the content only (stop strings in the whole
text, before this split).

Three formats. Two write ``<think>`` and ``</think>`` as text (in Qwen3's and DeepSeek-R1's
vocabularies they are added tokens that are not control tokens, so the detokenizer keeps them):

- ``deepseek_r1``: the output is reasoning until ``</think>``. R1's template opens the block in
  the prompt, older ones let the model write ``<think>`` itself (dropped). No ``</think>`` by
  the end: all of it was reasoning (cut off by ``max_tokens``).
- ``qwen3``: reasoning only inside a block the model opens (``<think>`` first in its output), or
  one the prompt opens (Qwen3's thinking-only models end their prompt with ``<think>``). With
  ``enable_thinking: false`` Qwen3's template closes an empty block in the prompt, and the
  output is content.

The third, ``mistral`` (the models whose vocabularies have ``[THINK]`` as a control token: recent
Magistral releases, Ministral 3's reasoning models), reads as ``qwen3`` does with
``[THINK]`` and ``[/THINK]``, control tokens in Mistral's vocabularies (``reads_control_tokens``:
the detokenizer spells them out for it), as vLLM's ``mistral`` reasoning parser does.

``seed_oss`` reads as ``qwen3`` does with ``<seed:think>`` and ``</seed:think>`` (Seed-OSS).

The template's layout is not part of either field: whitespace right after ``<think>`` and
``</think>`` and right before ``</think>`` is dropped. A parser is one choice's state, fed text
piece by piece, split anywhere; any split gives the same two texts as the whole at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .tools.markers import partial_marker

OPEN, CLOSE = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningDelta:
    """What one piece of model text turned into: reasoning and content to send now (and, from a
    parser that reads calls too, as harmony's does, tool-call deltas)."""

    reasoning: str = ""
    content: str = ""
    calls: list[Any] = field(default_factory=list)


class ReplySplitter:
    """One choice's reply being split as it streams: text pieces in, :class:`ReasoningDelta` out.

    A subclass implements :meth:`_feed`: consume as much of ``self._buf`` as it can decide (all
    of it when ``final``), adding what it found to ``out``.
    """

    reads_control_tokens: ClassVar[bool] = False
    """Whether the text read must spell out control tokens (``<think>`` is not one)."""
    calls: ClassVar[tuple[Any, ...]] = ()
    """Tool calls found (none, unless the format's calls are read here too, as harmony's are)."""

    def __init__(self) -> None:
        self._buf = ""
        self._finished = False
        self.reasoning_parts: list[str] = []

    @property
    def reasoning(self) -> str | None:
        """All reasoning so far; None when there was none."""
        return "".join(self.reasoning_parts) or None

    def push(self, text: str) -> ReasoningDelta:
        """Feed the next piece of model text; return what can be sent now."""
        out = ReasoningDelta()
        if text and not self._finished:
            self._buf += text
            self._feed(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        """End of generation: release what was held back (a marker's possible beginning)."""
        out = ReasoningDelta()
        if not self._finished:
            self._finished = True
            self._feed(out, final=True)
            self._buf = ""
        return out

    @property
    def thinking(self) -> bool:
        """The text read so far ends inside reasoning (usage counts the tokens read then)."""
        raise NotImplementedError

    def _feed(self, out: ReasoningDelta, final: bool) -> None:
        raise NotImplementedError


class ReasoningParser(ReplySplitter):
    """Splits one generation's text into reasoning and content (see the module docstring).

    ``prompt_opens``: the prompt ends inside an open ``<think>`` block. A subclass says where
    text goes when the output does not open a block itself (:attr:`starts_thinking`).
    """

    name: ClassVar[str]
    starts_thinking: ClassVar[bool]
    """Whether an output that opens no block is reasoning (until ``</think>``)."""
    open_marker: ClassVar[str] = OPEN
    close_marker: ClassVar[str] = CLOSE

    def __init__(self, prompt_opens: bool) -> None:
        super().__init__()
        # "start": the output may still open a block; then "reasoning" until CLOSE; "content".
        self._mode = "start"
        self._otherwise = "reasoning" if prompt_opens or self.starts_thinking else "content"
        self._trim = False  # whitespace at the start of the part being read is layout

    @property
    def thinking(self) -> bool:
        return self._mode == "reasoning" or (self._mode == "start" and self._otherwise == "reasoning")

    def _feed(self, out: ReasoningDelta, final: bool) -> None:
        while True:
            if self._mode == "start":
                head, opener = self._buf.lstrip(), self.open_marker
                if head.startswith(opener):
                    self._buf, self._mode, self._trim = head[len(opener) :], "reasoning", True
                elif not final and opener.startswith(head):
                    return  # nothing yet, or the beginning of <think>: wait
                else:
                    self._mode = self._otherwise
                    self._trim = self._mode == "reasoning"
                continue
            if self._trim:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return
                self._trim = False
            if self._mode == "content":
                out.content += self._buf
                self._buf = ""
                return
            closer = self.close_marker
            at = self._buf.find(closer)
            if at >= 0:
                self._reason(out, self._buf[:at].rstrip())
                self._buf, self._mode, self._trim = self._buf[at + len(closer) :], "content", True
                continue
            if final:
                self._reason(out, self._buf.rstrip())
                self._buf = ""
                return
            # Hold back what may begin </think>, and whitespace that may turn out to precede it.
            safe = self._buf[: len(self._buf) - partial_marker(self._buf, closer)].rstrip()
            self._reason(out, safe)
            self._buf = self._buf[len(safe) :]
            return

    def _reason(self, out: ReasoningDelta, text: str) -> None:
        if text:
            out.reasoning += text
            self.reasoning_parts.append(text)


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1 and QwQ: reasoning first, whether or not the output opens the block."""

    name = "deepseek_r1"
    starts_thinking = True


class Qwen3Parser(ReasoningParser):
    """Qwen3: reasoning only inside a block the output or the prompt opens."""

    name = "qwen3"
    starts_thinking = False


class MistralParser(ReasoningParser):
    """Mistral's reasoning models with ``[THINK]`` control tokens: Qwen3's reading of their blocks
    (Magistral's first releases wrote ``<think>`` as text: ``qwen3`` reads those)."""

    name = "mistral"
    starts_thinking = False
    open_marker, close_marker = "[THINK]", "[/THINK]"
    reads_control_tokens = True


class SeedOssParser(ReasoningParser):
    """Seed-OSS: Qwen3's reading of ``<seed:think>`` ... ``</seed:think>`` blocks (its
    ``<seed:cot_budget_reflect>`` notes inside them are reasoning), the markers spelled out
    should the vocabulary have them as control tokens."""

    name = "seed_oss"
    starts_thinking = False
    open_marker, close_marker = "<seed:think>", "</seed:think>"
    reads_control_tokens = True


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, MistralParser, SeedOssParser)
}
"""Reasoning formats by the name a model's ``reasoning_parser`` gives."""


def prompt_opens_thinking(prompt_tail: str, opener: str = OPEN) -> bool:
    """Whether a prompt whose last characters are ``prompt_tail`` leaves a block open (``opener``:
    the format's marker, ``<think>`` unless it says otherwise)."""
    return prompt_tail.rstrip().endswith(opener)
