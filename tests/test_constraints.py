"""Grammar compilation and token masks with a byte-level vocabulary (no model needed)."""

import json

import pytest

from fakes import ByteTokenizer
from router.constraints import ConstraintSpec, GrammarCompiler
from router.errors import BadRequest

tok = ByteTokenizer()


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(tok)


def drive(constraint, text):
    """Feed ``text`` token by token; every token must be allowed when it comes."""
    for t in tok.encode(text, add_special_tokens=False):
        if not constraint.allowed()[t]:
            return False
        constraint.advance(t)
    return True


def test_json_schema_accepts_valid_and_masks_invalid(compiler):
    spec = ConstraintSpec("json", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                   "additionalProperties": False}, "p")
    c = compiler.constraint(spec)
    assert drive(c, '{"n": 42}') and c.done
    c = compiler.constraint(spec)
    assert not drive(c, '{"x": 1}')


def test_compact_separators(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert drive(compiler.constraint(ConstraintSpec("json", schema, "p", compact=True)), '{"a":1}')
    assert not drive(compiler.constraint(ConstraintSpec("json", schema, "p", compact=False)), '{"a":1}')


def test_each_distinct_grammar_compiles_once(compiler):
    before = compiler.compiled
    spec = ConstraintSpec("regex", "[0-9]{3}", "p")
    a, b = compiler.constraint(spec), compiler.constraint(spec)
    assert compiler.compiled == before + 1
    assert drive(a, "123") and a.done
    assert not drive(b, "12a")  # b is its own copy: a's progress did not leak into it


def test_choice_and_schema_as_string(compiler):
    c = compiler.constraint(ConstraintSpec("choice", ["ab", "bc"], "p"))
    assert drive(c, "bc") and c.done
    c = compiler.constraint(ConstraintSpec("json", json.dumps({"type": "boolean"}), "p"))
    assert drive(c, "true") and c.done


def test_control_tokens_are_never_allowed_as_text(compiler):
    c = compiler.constraint(ConstraintSpec("regex", ".*", "p"))
    mask = c.allowed()
    assert not mask[tok.special_ids["<|im_start|>"]]
    assert mask[ord("a")]


@pytest.mark.parametrize("kind,value,needle", [
    ("regex", "([a-z", "unclosed"),
    ("json", {"type": "nonsense"}, "nonsense"),
    ("grammar", "start: (", ""),
    ("json", "{not json", ""),
])
def test_bad_constraints_are_400s_naming_the_field(compiler, kind, value, needle):
    with pytest.raises(BadRequest) as e:
        compiler.constraint(ConstraintSpec(kind, value, f"structured_outputs.{kind}"))
    assert e.value.param == f"structured_outputs.{kind}" and needle in e.value.message


# --- drafts (speculative decoding): checked and masked without being consumed ------------------


def ids(text):
    return tok.encode(text, add_special_tokens=False)


def test_forced_tokens_are_what_the_grammar_allows_no_alternative_to(compiler):
    c = compiler.constraint(ConstraintSpec("regex", "id-(ab|cd)[0-9]", "p"))
    assert tok.decode(c.forced()) == "id-"
    assert drive(c, "id-")
    assert c.forced() == []  # ab or cd: a choice
    assert drive(c, "c")
    assert tok.decode(c.forced()) == "d"


def test_accepts_counts_the_draft_prefix_the_grammar_takes_without_taking_it(compiler):
    c = compiler.constraint(ConstraintSpec("regex", "[0-9]{3}x", "p"))
    assert c.accepts(ids("12a4")) == 2
    assert c.accepts(ids("123x")) == 4
    assert c.accepts(ids("123x9")) == 4  # nothing after the end
    assert c.accepts([]) == 0
    assert drive(c, "987x") and c.done  # the checks consumed nothing


def test_allowed_along_a_draft_is_each_rows_mask_and_leaves_the_matcher_in_place(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    spec = ConstraintSpec("json", schema, "p")
    c = compiler.constraint(spec)
    assert drive(c, '{"a": ')
    draft = ids("12}")
    masks = c.allowed_along(draft)
    walk = compiler.constraint(spec)  # the same grammar driven through the draft for real
    drive(walk, '{"a": ')
    for i, token in enumerate(draft):
        assert (masks[i] == walk.allowed()).all()
        walk.advance(token)
    assert walk.done and masks[3][sorted(tok.eos_token_ids)].any() and not masks[3][ord("3")]
    assert masks[1][ord("3")] and not masks[0][ord("}")]  # after a digit, more digits or the end
    assert (c.allowed() == masks[0]).all() and not c.done  # still before the draft
    assert drive(c, "7}") and c.done
    assert c.allowed_along([])[0].shape == masks[0].shape


def test_a_draft_that_completes_the_grammar_then_ends_leaves_it_in_place(compiler):
    """llguidance takes an end-of-sequence token after a complete grammar without recording it:
    rolling the draft back must undo only what was consumed."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    c = compiler.constraint(ConstraintSpec("json", schema, "p"))
    assert drive(c, '{"a": ')
    before = c.allowed()
    eos = min(tok.eos_token_ids)
    draft = ids("12}") + [eos]
    assert c.accepts(draft) == 4
    masks = c.allowed_along(draft)
    assert len(masks) == 5 and (masks[4] == masks[3]).all() and masks[3][eos]
    assert (c.allowed() == before).all() and not c.done
    assert drive(c, "7}") and c.done and not c.error
