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
