"""A thinking model's constraint (router/thinking_gate.py): nothing masked while it reasons, the
grammar from the token that completes the end marker on, and the same answers for a draft as for
the tokens one at a time."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fakes import ByteTokenizer
from router.constraints import ConstraintSpec, GrammarCompiler
from router.thinking_gate import AfterReasoning

tok = ByteTokenizer(["<think>"])
OPENER = tok.special_ids["<think>"]
SPEC = ConstraintSpec("choice", ["yes", "no"], "structured_outputs")


@pytest.fixture(scope="module")
def grammars():
    return GrammarCompiler(tok)


def gate(grammars, opener=None, end=b"</think>", token_bytes=tok.token_bytes):
    return AfterReasoning(grammars.constraint(SPEC), token_bytes, end, opener)


def ids(text):
    return tok.encode(text, add_special_tokens=False)


def feed(g, text):
    for t in ids(text):
        g.advance(t)


def test_nothing_is_masked_while_reasoning_and_the_grammar_sees_none_of_it(grammars):
    g = gate(grammars)
    for t in ids("maybe </think or <think>... </thin"):  # no choice's text, and near misses
        assert g.allowed() is None and g.reasoning and not g.done
        g.advance(t)
    feed(g, "k>")  # the marker, split over tokens however the model spelled it
    assert not g.reasoning
    mask = g.allowed()
    assert mask[ids("y")[0]] and mask[ids("n")[0]] and not mask[ids("m")[0]]
    feed(g, "yes")
    assert g.done and not g.error


def test_bytes_after_the_marker_in_its_own_token_are_not_the_grammars(grammars):
    pieces = {1: b"hm </thi", 2: b"nk>\n"}
    g = gate(grammars, token_bytes=lambda t: pieces.get(t) or tok.token_bytes(t))
    g.advance(1)
    assert g.reasoning
    g.advance(2)
    assert not g.reasoning and not g.done
    feed(g, "no")
    assert g.done


def test_an_opener_makes_the_first_token_decide(grammars):
    g = gate(grammars, opener=OPENER)
    mask = g.allowed()
    assert mask[OPENER] and mask[ids("y")[0]] and not mask[ids("m")[0]]
    g.advance(OPENER)  # the reply opens a block: it reasons
    assert g.reasoning and g.allowed() is None
    feed(g, "hm</think>no")
    assert g.done

    g = gate(grammars, opener=OPENER)
    feed(g, "y")  # the grammar's first token: no reasoning
    assert not g.reasoning and g.allowed()[ids("e")[0]] and not g.allowed()[OPENER]
    feed(g, "es")
    assert g.done


def test_a_reply_that_never_ends_its_reasoning_is_never_done(grammars):
    g = gate(grammars)
    feed(g, "yes no yes" * 5)
    assert g.reasoning and not g.done and g.forced() == []


def same_masks(a, b):
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and
                                                                  np.array_equal(x, y)) for x, y in zip(a, b))


def takes(g, token):
    """Whether ``token`` may come next, by the mask alone (None: any)."""
    mask = g.allowed()
    return mask is None or bool(mask[token])


@pytest.mark.parametrize("opener", [None, OPENER])
def test_a_draft_gets_the_answers_its_tokens_one_at_a_time_would(grammars, opener):
    rng = random.Random(5)
    words = ["hm ", "</think>", "</thi", "nk>", "yes", "no", "y", "x", "<think>"]
    for _ in range(150):
        before = "".join(rng.choice(words) for _ in range(rng.randint(0, 3)))
        draft = ids("".join(rng.choice(words) for _ in range(rng.randint(0, 4))))
        g, stepped = gate(grammars, opener), gate(grammars, opener)
        for t in ids(before):
            for x in (g, stepped):
                if takes(x, t):
                    x.advance(t)
        # One at a time: how many the masks let through, and the mask before each of those.
        masks, taken = [stepped.allowed()], 0
        for t in draft:
            if not takes(stepped, t):
                break
            stepped.advance(t)
            taken += 1
            masks.append(stepped.allowed())
        assert g.accepts(draft) == taken, (before, draft)
        along = g.allowed_along(draft[:taken])
        assert same_masks(along, masks), (before, draft)
        assert g.accepts(draft) == taken  # allowed_along consumed nothing
