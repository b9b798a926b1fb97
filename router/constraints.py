"""Constrained decoding: a grammar says which tokens may come next, every step.

A request's constraint (JSON schema, regex, choice, grammar, any JSON object) becomes an
llguidance grammar, compiled once per distinct grammar and model (LRU cache); every sequence gets
its own copy of the compiled matcher. Engines ask :class:`TokenConstraint` for the allowed-token
mask before sampling and feed it the chosen token after; a constraint that is complete ends the
sequence. An engine that drafts tokens (speculative decoding) checks a draft against the grammar
and takes the masks along it without consuming it. llguidance is imported only when a request
uses a constraint.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .engine import Tokenizer
from .errors import BadRequest
from .thinking_gate import ReasoningGate

if TYPE_CHECKING:
    import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match. ``param`` is the request field it came from (for errors)."""

    kind: str
    value: Any
    param: str
    compact: bool = False
    """JSON without any whitespace (``","`` and ``":"``); else ``", "`` and ``": "``. Never free
    whitespace: a small model given the choice can emit newlines until max_tokens."""

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (not yet checked)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        separators = (",", ":") if self.compact else (", ", ": ")
        options = {"whitespace_flexible": False, "item_separator": separators[0], "key_separator": separators[1]}
        try:
            if self.kind == "json":
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                return LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.value)
            if self.kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in self.value)
                return LLMatcher.grammar_from_lark(f"start: {alternatives}")
            if self.kind == "grammar":
                # Lark as is; GBNF (llama.cpp's EBNF, "rule ::= ...") converted to Lark.
                return LLMatcher.grammar_from_lark(any_to_lark(self.value))
        except Exception as exc:  # noqa: BLE001 - user-written schema/grammar text
            raise BadRequest(f"The {self.kind} constraint is invalid: {exc}", param=self.param) from None
        raise BadRequest(f"Unknown constraint kind `{self.kind}`.", param=self.param)

    def closed(self) -> "ConstraintSpec":
        """The same JSON schema with ``additionalProperties: false`` on every object that does
        not say otherwise (vLLM's ``disable_additional_properties``; OpenAI's strict mode)."""
        if self.kind != "json":
            return self
        schema = json.loads(self.value) if isinstance(self.value, str) else self.value
        return ConstraintSpec(self.kind, _close_objects(schema), self.param, self.compact)

    @property
    def key(self) -> tuple:
        value = json.dumps(self.value, sort_keys=True) if not isinstance(self.value, str) else self.value
        return (self.kind, value, self.compact)


@dataclass(frozen=True, slots=True)
class ConstraintPlan:
    """A sequence's constraint as the router hands it to the engine (across the process
    boundary: plain values): what the output must match, and for a thinking model where the
    grammar begins. The engine's side compiles it once per grammar and builds each sequence's
    own matcher (:meth:`build`), so masks are computed where the steps run."""

    spec: ConstraintSpec
    gate: ReasoningGate | None = None

    def build(self, grammars: "GrammarCompiler") -> Any:
        """This sequence's matcher: a :class:`TokenConstraint`, inside an
        :class:`router.thinking_gate.AfterReasoning` when the plan has a gate."""
        inner = grammars.constraint(self.spec)
        return inner if self.gate is None else self.gate.around(inner, grammars.tokenizer.token_bytes)


def _close_objects(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _close_objects(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_close_objects(v) for v in schema]
    return schema


class _TokenTable:
    """Our Tokenizer as llguidance's TokenizerWrapper expects it: every token's bytes (control
    tokens marked with a leading 0xff, so grammars never produce them as text)."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        specials = set()
        for text in tok.special_tokens:
            ids = tok.encode(text, add_special_tokens=False, parse_special=True)
            if len(ids) == 1:
                specials.add(ids[0])
        self.special_token_ids = sorted(specials)
        self.tokens = [
            (b"\xff" if t in specials else b"") + tok.token_bytes(t) for t in range(tok.vocab_size)
        ]
        eos = tok.encode(tok.eos_token, add_special_tokens=False) if tok.eos_token else []
        self.eos_token_id = eos[0] if len(eos) == 1 else min(tok.eos_token_ids, default=0)
        bos = tok.encode(tok.bos_token, add_special_tokens=False) if tok.bos_token else []
        self.bos_token_id = bos[0] if len(bos) == 1 else None

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_special_tokens=False, parse_special=False)


class GrammarCompiler:
    """One model's llguidance tokenizer and its cache of compiled grammars (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and metrics

    def _ll(self) -> Any:
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer, TokenizerWrapper

            self._ll_tokenizer = LLTokenizer(TokenizerWrapper(_TokenTable(self.tokenizer)))
        return self._ll_tokenizer

    def constraint(self, spec: ConstraintSpec) -> "TokenConstraint":
        """A fresh matcher for one sequence; compiles the grammar on first use (400 if it fails)."""
        from llguidance import LLMatcher

        with self._lock:
            template = self._cache.get(spec.key)
            if template is not None:
                self._cache.move_to_end(spec.key)
        if template is None:
            grammar = spec.grammar()
            ll = self._ll()
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll)
            if is_error:
                raise BadRequest(f"The {spec.kind} constraint does not compile: {messages[0]}", param=spec.param)
            template = LLMatcher(ll, grammar, log_level=0)
            if template.is_error():
                raise BadRequest(
                    f"The {spec.kind} constraint does not compile: {template.get_error()}", param=spec.param
                )
            with self._lock:
                self.compiled += 1
                self._cache[spec.key] = template
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return TokenConstraint(template.deep_copy(), self.tokenizer.vocab_size)


class TokenConstraint:
    """One sequence's matcher: the allowed-token mask before each step, the token after."""

    __slots__ = ("_matcher", "_vocab", "_bitmask")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import numpy as np

        self._matcher = matcher
        self._vocab = vocab_size
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self) -> "np.ndarray":
        """Bool mask [vocab]: which tokens may come next."""
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self._vocab].astype(bool)

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)

    # Speculative decoding: a draft is checked and masked without being consumed.

    def accepts(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar would take from here (none is taken)."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def forced(self) -> list[int]:
        """The tokens that spell the text the grammar forces from here (a JSON schema's next key
        and its quotes, say): a draft that needs no lookup. Empty when the next text is free."""
        return self._matcher.compute_ff_tokens()

    def allowed_along(self, draft: list[int]) -> list["np.ndarray"]:
        """The masks before each of ``draft``'s tokens and after its last (``len(draft) + 1``),
        as if the draft had been generated; the matcher is left where it was. ``draft`` must be
        one the grammar accepts whole (:meth:`accepts`). Once the grammar is complete inside the
        draft, the rest of the rows get the complete grammar's mask (end of sequence only)."""
        matcher = self._matcher
        masks = [self.allowed()]
        consumed = 0
        for token in draft:
            # A complete grammar takes an end-of-sequence token without recording it: rolling
            # back a token that was not recorded would undo one that was. (A refused token puts
            # the matcher in its error state for good, which ends the sequence as advance()'s
            # would; :meth:`accepts` keeps refused tokens out of drafts.)
            if matcher.is_stopped() or not matcher.consume_token(token):
                masks.append(masks[-1])
                continue
            consumed += 1
            masks.append(self.allowed())
        if consumed:
            matcher.rollback(consumed)
        return masks

    @property
    def done(self) -> bool:
        """No token but end-of-sequence can follow (or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""
