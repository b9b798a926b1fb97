"""Structured outputs over HTTP on both local engines: every output parses and validates."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from sse_util import chat_text, parse_events

S = {"type": "string", "maxLength": 20}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5}, "b": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"name": S, "nick": S}, "required": ["name"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99, "minimum": 0}, "y": {"type": "integer", "maximum": 99, "minimum": 0}}, "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "label": S}, "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 10}]}}, "required": ["value"]},
    {"type": "object", "properties": {"kind": {"const": "person"}, "name": S}, "required": ["kind", "name"]},
    {"type": "object", "properties": {"first": S, "last": S, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["first", "last", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"profile": {"type": "object", "properties": {"bio": S, "level": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["bio", "level"]}}, "required": ["profile"]}}, "required": ["user"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "reasons": {"type": "array", "items": S, "maxItems": 2}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "reasons", "confidence"]},
    {"type": "object", "properties": {"order": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"}, "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {"sku": {"enum": ["A1", "B2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"], "additionalProperties": False}}, "status": {"enum": ["new", "paid"]}}, "required": ["id", "lines", "status"], "additionalProperties": False}}, "required": ["order"]},
]
assert len(SCHEMAS) == 20


def _closed(schema):
    """additionalProperties: false on every object (as OpenAI's strict mode requires): without it a
    small model may keep inventing keys until max_tokens."""
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        for v in schema.values():
            _closed(v)
    elif isinstance(schema, list):
        for v in schema:
            _closed(v)
    return schema


SCHEMAS = [_closed(s) for s in SCHEMAS]


def body(model, schema, i, **extra):
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Give me example data number {i} as JSON."}],
        "max_tokens": 300,
        "temperature": 0,
        **extra,
        **({"structured_outputs": {"json": schema}} if i % 2 else
           {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}),
    }


async def _one(client, url, b, stream):
    if not stream:
        r = await client.post(f"{url}/v1/chat/completions", json=b)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"], c["finish_reason"]
    async with client.stream("POST", f"{url}/v1/chat/completions", json={**b, "stream": True}) as r:
        assert r.status_code == 200
        events = parse_events(await r.aread())
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return chat_text(events), finish[0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_twenty_json_schemas_parse_and_validate(base_url, model, stream):
    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(_one(client, base_url, body(model, s, i), stream) for i, s in enumerate(SCHEMAS)))

    for (text, finish), schema in zip(asyncio.run(main()), SCHEMAS):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def post(base_url, b):
    return httpx.post(f"{base_url}/v1/chat/completions", json=b, timeout=120)


def test_regex_choice_and_grammar(base_url, model):
    msg = [{"role": "user", "content": "Pick one."}]
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"regex": "[A-Z][a-z]{2,6} [0-9]{2}"}, "max_tokens": 20})
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", r.json()["choices"][0]["message"]["content"])
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"choice": ["yes", "no", "maybe so"]}, "max_tokens": 20})
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no", "maybe so")
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"grammar": lark}, "max_tokens": 20})
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", r.json()["choices"][0]["message"]["content"])
    gbnf = 'root ::= "colour: " ("red" | "blue")'
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"grammar": gbnf}, "max_tokens": 20})
    assert r.json()["choices"][0]["message"]["content"] in ("colour: red", "colour: blue")
    # Greedy: json_object admits any object, and a sampled 135M model can stay inside one string past
    # max_tokens (CI once drew such a run); the grammar must still end the object and stop.
    r = post(base_url, {"model": model, "messages": msg, "response_format": {"type": "json_object"}, "max_tokens": 100,
                        "temperature": 0})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and isinstance(json.loads(c["message"]["content"]), dict), c
    r = httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": "Answer:", "max_tokens": 10,
                                                      "structured_outputs": {"choice": ["alpha", "beta"]}}, timeout=60)
    assert r.json()["choices"][0]["text"] in ("alpha", "beta")


def test_constraint_errors_are_400s(base_url, model):
    msg = [{"role": "user", "content": "x"}]
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"regex": "([a-z"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex"
    assert "unclosed" in r.json()["error"]["message"]
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"json": {"type": "nonsense"}}})
    assert r.status_code == 400 and "nonsense" in r.json()["error"]["message"]
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.choice"
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {"regex": "a"},
                        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = post(base_url, {"model": model, "messages": msg, "structured_outputs": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": msg, "stream": True, "structured_outputs": {"grammar": "start: ("}}) as r:
        assert r.status_code == 400  # before any byte of the stream


def test_strict_and_disable_additional_properties_close_objects():
    from router.constraints import ConstraintSpec

    spec = ConstraintSpec("json", {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
                                   "additionalProperties": True}, "p").closed()
    assert spec.value["additionalProperties"] is True  # an explicit choice is kept
    assert spec.value["properties"]["a"]["additionalProperties"] is False
    assert ConstraintSpec("regex", "a", "p").closed().value == "a"


def test_open_schema_with_strict_still_terminates(base_url, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    r = post(base_url, {"model": model, "messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 60,
                        "temperature": 0, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "p", "schema": schema, "strict": True}}})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and set(json.loads(c["message"]["content"])) == {"name"}
