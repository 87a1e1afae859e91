"""Tools and structured output through the engine's HTTP API, with the official openai
SDK, on seeded tiny models: ChatML without a tools branch (the generic format) and a
Hermes-style template (tests/data/templates/hermes.jinja).

Random weights make these strict tests of the grammar: whatever the model prefers, a
required call must parse and a json_schema answer must validate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import make_engine

MODEL = "tiny-llama"
TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
REPORT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["ok", "n", "tags"]}


@pytest.fixture(scope="module")
def long_llama_dir(tiny_model_dir) -> Path:
    """The tiny Llama with room for a tools prompt (its tokenizer spends a token on every few characters)."""
    return tiny_model_dir("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def srv(long_llama_dir, run_server):
    with run_server(make_engine(long_llama_dir, num_blocks=160, name=MODEL), MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def hermes_srv(long_llama_dir, run_server, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("hermes_llama")
    shutil.copytree(long_llama_dir, model_dir, dirs_exist_ok=True)
    (model_dir / "chat_template.jinja").write_text((TEMPLATES / "hermes.jinja").read_text())
    with run_server(make_engine(model_dir, num_blocks=160, name=MODEL), MODEL) as server:
        yield server


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def _check_calls(calls) -> None:
    assert calls, "a required call must be made"
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("server", ["srv", "hermes_srv"])
@pytest.mark.parametrize("seed", range(4))
def test_a_required_call_always_parses_and_matches_its_schema(request, server, seed):
    with _client(request.getfixturevalue(server)) as client:
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("server", ["srv", "hermes_srv"])
def test_a_named_function_is_the_one_called_and_streams_as_deltas(request, server):
    srv = request.getfixturevalue(server)
    named = {"type": "function", "function": {"name": "add"}}
    with _client(srv) as client:
        whole = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=named,
                                               max_tokens=300, temperature=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=named,
                                                     max_tokens=300, temperature=0, stream=True))
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["add"]
    _check_calls(whole.choices[0].message.tool_calls)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "add"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_generic_auto_calls_on_the_users_turn_and_answers_after_the_result(srv):
    with _client(srv) as client:
        first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300, temperature=0)
        call = first.choices[0].message.tool_calls[0]
        history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Rain, 7 C"}]
        second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=60,
                                                temperature=0)
    _check_calls(first.choices[0].message.tool_calls)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    assert answer.message.content is not None


def test_tool_choice_none_renders_no_tools(srv):
    with _client(srv) as client:
        plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
        none = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none",
                                              max_tokens=4, temperature=0)
        auto = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_a_hermes_template_renders_the_tools_into_the_prompt(hermes_srv):
    with _client(hermes_srv) as client:
        plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
        tools = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=2, temperature=0)
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_json_schema_answers_validate(srv, stream, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    with _client(srv) as client:
        r = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt, max_tokens=150,
                                           temperature=1.0, seed=seed, stream=stream)
        if stream:
            chunks = list(r)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(content), REPORT)


def test_json_object_answers_are_objects(srv):
    with _client(srv) as client:
        r = client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"},
                                           max_tokens=150, temperature=0)
    if r.choices[0].finish_reason == "stop":  # free-form objects may run to max_tokens on random weights
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"d": {"type": "string", "format": "bogus"}}}}}}, "response_format", "bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "response_format", "missing"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "constrained"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "bad", "strict": True, "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "bogus"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters", "bogus"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "gone", "parameters": {
        "type": "object", "properties": {"d": {"$ref": "#/$defs/missing"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters", "missing"),
    ({"tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop", "cut it short"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content", "image_url parts are not supported"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_cannot_be_served_is_a_400_naming_the_field(srv, body, param, words, stream):
    payload = {"model": MODEL, "messages": USER, "max_tokens": 4, "stream": stream, **body}
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert words in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_a_generic_call_cut_by_max_tokens_shows_none_of_the_formats_json(srv, stream):
    with _client(srv) as client:
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=6, temperature=0, stream=stream)
        if stream:
            chunks = list(r)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
            finish = chunks[-1].choices[0].finish_reason
        else:
            content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, \
                r.choices[0].finish_reason
    assert finish == "length" and not content and not calls


@pytest.mark.parametrize("server", ["srv", "hermes_srv"])
def test_a_function_may_be_named_like_a_mode(request, server):
    """"auto" and "required" are valid function names: naming one forces that call."""
    tools = [{"type": "function", "function": {"name": "auto", "parameters": ADD}}, TOOLS[0]]
    with _client(request.getfixturevalue(server)) as client:
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=300, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "auto"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["auto"]


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        '{"items": ' * 100 + "{}" + "}" * 100)}}}, "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"items": ' * 100 + "{}" + "}" * 100)}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "true"}}]}, "tools.0.function.strict"),
])
def test_schemas_too_deep_and_flags_of_the_wrong_type_are_400s(srv, body, param):
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_call_arguments_nested_past_the_parser_are_text_not_a_500(srv):
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "[" * 100_000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
