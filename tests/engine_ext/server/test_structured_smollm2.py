"""The promise of constrained decoding on the default model (SmolLM2-135M-Instruct),
over HTTP with the openai SDK: every json_schema answer of the 50 seeded schemas
(benchmarks/json_schemas.py) validates, and every required or named tool call parses
and its arguments validate against the tool's parameters.

Requests run 8 at a time (batched decode); greedy, so the run is reproducible."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from benchmarks.json_schemas import prompt_for, seeded_schemas
from engine_ext.model_store import DEFAULT_MODEL_NAME
from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine

pytestmark = pytest.mark.slow
CONCURRENCY = 8


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    engine = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20, max_num_seqs=CONCURRENCY),
                       DEFAULT_MODEL_NAME)
    with run_server(engine, DEFAULT_MODEL_NAME) as server:
        yield server


async def _all(srv, bodies: list[dict]) -> list:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with openai.AsyncOpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=600) as client:
        async def one(body: dict):
            async with gate:
                return await client.chat.completions.create(model=DEFAULT_MODEL_NAME, temperature=0, **body)
        return await asyncio.gather(*(one(b) for b in bodies))


def test_every_json_schema_answer_validates(srv):
    schemas = seeded_schemas(50)
    bodies = [{"messages": [{"role": "user", "content": prompt_for(s)}], "max_tokens": 1000,
               "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}}}
              for i, s in enumerate(schemas)]
    answers = asyncio.run(_all(srv, bodies))
    failures = []
    for i, (schema, r) in enumerate(zip(schemas, answers)):
        try:
            assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((i, str(exc)[:200], r.choices[0].message.content[:200]))
    assert not failures, failures


def test_every_required_or_named_tool_call_parses_and_validates(srv):
    schemas = [s for s in seeded_schemas(50) if s.get("type") == "object"][:20]
    bodies, expected = [], []
    for i, schema in enumerate(schemas):
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": schema.get("title", "a tool"),
                                                   "parameters": schema}},
                 {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": f"tool_{i}"}}
        bodies.append({"messages": [{"role": "user", "content": prompt_for(schema)}], "tools": tools,
                       "tool_choice": choice, "max_tokens": 1000})
        expected.append((schema, None if i % 2 else f"tool_{i}"))
    answers = asyncio.run(_all(srv, bodies))
    failures = []
    for (schema, name), r in zip(expected, answers):
        try:
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
            for call in calls:
                assert name is None or call.function.name == name
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, schema if call.function.name != "noop" else {"type": "object"})
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, str(exc)[:300]))
    assert not failures, failures
