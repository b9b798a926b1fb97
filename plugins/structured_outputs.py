"""Structured outputs: vLLM's ``structured_outputs`` field and OpenAI's ``response_format``.

``structured_outputs`` takes exactly one of ``json`` (a JSON schema, as an object or a string),
``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or llama.cpp's GBNF) and
``json_object: true``; ``disable_additional_properties`` (and ``response_format``'s
``strict: true``) closes every object schema to the keys it lists. JSON comes with ``", "`` and ``": "`` separators and no other whitespace
(``disable_any_whitespace`` drops the spaces too). ``response_format``
``json_object`` and ``json_schema`` mean the same as ``json_object`` and ``json``. More than one
constraint at a time is a 400; so is a schema or grammar that does not compile (with the
compiler's message). Local engines enforce the constraint token by token (llguidance masks);
remote deployments get the fields forwarded when they list them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from router.constraints import KINDS, ConstraintSpec
from router.errors import BadRequest
from router.hookspecs import RequestField, hookimpl


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


@hookimpl
def request_fields() -> list[RequestField]:
    return [
        RequestField(
            "structured_outputs",
            StructuredOutputs | None,
            None,
            description="Constrain the output: json (schema), regex, choice, grammar or json_object.",
        )
    ]


def _specs(request: Any) -> list[ConstraintSpec]:
    specs = []
    so = request.structured_outputs
    if so is not None:
        for kind in KINDS:
            value = getattr(so, kind)
            if value is not None and value is not False:
                spec = ConstraintSpec(kind, value, f"structured_outputs.{kind}", so.disable_any_whitespace)
                specs.append(spec.closed() if so.disable_additional_properties else spec)
        if not specs:
            raise BadRequest(
                f"structured_outputs needs one of: {', '.join(KINDS)}.", param="structured_outputs"
            )
    fmt = getattr(request, "response_format", None)
    kind = type(fmt).__struct_config__.tag if fmt is not None else "text"
    if kind == "json_object":
        specs.append(ConstraintSpec("json_object", True, "response_format"))
    elif kind == "json_schema":
        schema = fmt.json_schema.schema_
        spec = ConstraintSpec("json", schema if schema is not None else {}, "response_format")
        specs.append(spec.closed() if fmt.json_schema.strict else spec)
    return specs


@hookimpl
def prepare_request(request: Any, model: Any, params: Any, endpoint: str) -> None:
    specs = _specs(request)
    if not specs:
        return
    if len(specs) > 1:
        raise BadRequest(
            f"Only one output constraint at a time; got `{specs[0].param}` and `{specs[1].param}`.",
            param=specs[1].param,
        )
    params.constraint = specs[0]
    params.require("structured_outputs", specs[0].param.split(".")[0])
