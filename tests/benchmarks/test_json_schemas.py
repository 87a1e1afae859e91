"""The seeded schemas of `kvrelay bench grammars`: deterministic, distinct, valid and satisfiable."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from benchmarks.json_schemas import example_instance, prompt_for, seeded_schemas

SCHEMAS = seeded_schemas()
VALIDATOR = jsonschema.Draft202012Validator


def _subschemas(schema: dict) -> Iterator[dict]:
    yield schema
    for key in ("properties", "$defs"):
        for sub in schema.get(key, {}).values():
            yield from _subschemas(sub)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            yield from _subschemas(sub)
    if isinstance(schema.get("items"), dict):
        yield from _subschemas(schema["items"])


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    return VALIDATOR(schema, format_checker=VALIDATOR.FORMAT_CHECKER)


def test_the_same_seed_gives_the_same_schemas_and_another_seed_others():
    assert seeded_schemas(50, 0) == SCHEMAS
    assert seeded_schemas(10, 0) == SCHEMAS[:10]
    assert seeded_schemas(50, 1) != SCHEMAS


def test_fifty_distinct_schemas():
    assert len(SCHEMAS) == 50
    assert len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == 50


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_each_schema_is_valid_draft_2020_12_and_satisfiable(index):
    schema = SCHEMAS[index]
    VALIDATOR.check_schema(schema)
    for full in (False, True):
        _validator(schema).validate(example_instance(schema, full=full))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_the_validation_is_not_vacuous(index):
    """Dropping a required property, or a wrong type, fails: the instances above are checked for real."""
    schema = SCHEMAS[index]
    instance = example_instance(schema, full=True)
    required = schema.get("required") or schema.get("oneOf", schema.get("anyOf", [{}]))[0].get("required")
    broken = {k: v for k, v in instance.items() if k != required[0]}
    assert not _validator(schema).is_valid(broken)
    assert not _validator(schema).is_valid([instance])


def test_the_set_covers_what_agent_apps_send():
    text = json.dumps(SCHEMAS)
    for keyword in ('"$ref"', '"$defs"', '"oneOf"', '"anyOf"', '"const"', '"enum"', '"pattern"', '"format": "date"',
                    '"format": "email"', '"minItems"', '"maxItems"', '"additionalProperties": false',
                    '"minimum"', '"maximum"', '"boolean"', '"number"', '"integer"', '["string", "null"]',
                    '{"type": "null"}'):
        assert keyword in text, keyword
    assert max(_depth(example_instance(s, full=True)) for s in SCHEMAS) >= 3  # object in object in object


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return max(map(_depth, value), default=0)
    return 0


def test_every_string_is_bounded():
    for schema in SCHEMAS:
        for sub in _subschemas(schema):
            kinds = sub.get("type") if isinstance(sub.get("type"), list) else [sub.get("type")]
            if "string" in kinds:
                assert {"maxLength", "enum", "const", "pattern", "format"} & set(sub), sub
                if "maxLength" in sub and "format" not in sub:
                    assert 8 <= sub["maxLength"] <= 40, sub


def test_prompt_for_asks_for_the_object_and_names_its_fields():
    for schema in SCHEMAS:
        prompt = prompt_for(schema)
        assert "JSON object" in prompt and schema["description"] in prompt
        fields = schema.get("properties") or schema["oneOf" if "oneOf" in schema else "anyOf"][0]["properties"]
        assert all(name in prompt for name in fields)
