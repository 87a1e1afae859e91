"""The OpenAI Responses API request, translated into a chat completions request.

Agent SDKs (the OpenAI Agents SDK, LangChain with `use_responses_api=True`) speak
`POST /v1/responses`; the engine serves chat completions. Rather than a second
generation path, a Responses request becomes a chat request here, and the answer is
shaped back (kvrelay/openai_responses_output.py, kvrelay/openai_responses_stream.py);
input items are translated in kvrelay/openai_responses_input.py. The gateway reads the same
translation as its chat-shaped view of the body (records, limits, structure
inference), so the message indices of its plans match what the engine builds.

Unknown fields are accepted (the SDKs add new ones often); known ones are validated;
what the engine cannot honour (images, files, reasoning, built-in tools, background
runs, truncation that drops items, logprobs) is refused naming the field, as a 400,
rather than silently ignored. The gateway translates leniently (`strict=False`): it may
front upstreams that do support those, so it skips what it cannot read and leaves
refusals to the upstream. Torch-free: the gateway imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from kvrelay.json_values import INT64_MAX, INT64_MIN, first_misfit
from kvrelay.openai_responses_input import ResponsesRequestError, chat_messages, history_offset
from kvrelay.wire.salt import SALT_FIELD, SALT_SCHEMA

__all__ = ["REQUEST_SCHEMA", "ResponsesRequest", "ResponsesRequestError", "chat_messages", "check_supported",
           "history_offset", "parse_request", "to_chat", "translate_tool_choice", "translate_tools",
           "validation_error"]

INT32_MAX = 2**31 - 1
TOOL_CHOICE_MODES = ("none", "auto", "required")
# Included outputs the engine cannot produce; other `include` entries name outputs of
# items or tools it never produces, so asking for them changes nothing.
UNPRODUCIBLE_INCLUDES = frozenset({"message.output_text.logprobs"})
# Top-level features with no counterpart here: refused whenever set (not null).
_UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "prompt": "prompt templates are not supported; send the input itself",
    "moderation": "moderation is not supported",
}

_NULLABLE_TEXT = {"anyOf": [{"type": "string"}, {"type": "null"}]}
# The request body as the engine's and the gateway's OpenAPI documents declare it: the
# fields read here, others passed (additionalProperties).
REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["model", "input"], "additionalProperties": True,
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": _NULLABLE_TEXT, "previous_response_id": _NULLABLE_TEXT,
        "tools": {"type": "array", "items": {"type": "object"}},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "stream": {"type": "boolean"}, "store": {"type": "boolean"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "kv_transfer_params": {"type": "object"}, SALT_FIELD: SALT_SCHEMA,
    },
}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class FunctionTool(_Open):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a style hint: accepted, no effect


class ReasoningConfig(_Open):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Open):
    """The fields of `POST /v1/responses` that the translation reads or refuses."""

    model: Annotated[str, Field(min_length=1)]
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    tools: list[Any] | None = None  # each checked by translate_tools, to name the bad one
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None  # extension, as on chat
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # engine extension
    ignore_eos: bool | None = None  # engine extension
    stop: str | list[str] | None = None  # engine extension, as on chat
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None  # bounds built-in tools: none here
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's, checked with the chat body it becomes


def parse_request(body: Any) -> ResponsesRequest:
    """The validated request; raises ResponsesRequestError naming the field."""
    if not isinstance(body, dict):
        raise ResponsesRequestError("the request body must be a JSON object")
    if (misfit := first_misfit(body)) is not None:
        raise ResponsesRequestError(misfit.message, misfit.path)
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def check_supported(req: ResponsesRequest) -> None:
    """Refuse what the engine would otherwise silently get wrong."""
    extra = req.model_extra or {}
    for field, why in _UNSUPPORTED_FIELDS.items():
        if extra.get(field) is not None:
            raise ResponsesRequestError(why, field)
    if extra.get("context_management"):
        raise ResponsesRequestError("context management (compaction) is not supported", "context_management")
    if isinstance(options := extra.get("prompt_cache_options"), dict) and options.get("prewarm"):
        raise ResponsesRequestError("prewarming is not supported", "prompt_cache_options.prewarm")
    if req.background:
        raise ResponsesRequestError("background responses are not supported", "background")
    if req.truncation == "auto":
        raise ResponsesRequestError("truncation 'auto' is not supported: input items are never dropped",
                                    "truncation")
    if req.reasoning is not None:
        for field in ("effort", "summary", "generate_summary"):
            value = getattr(req.reasoning, field)
            if value is not None and not (field == "effort" and value == "none"):
                raise ResponsesRequestError("the served models do not reason", f"reasoning.{field}")
    for i, entry in enumerate(req.include or ()):
        if entry in UNPRODUCIBLE_INCLUDES:
            raise ResponsesRequestError(f"'{entry}' is not supported", f"include[{i}]")
    if req.top_logprobs:
        raise ResponsesRequestError("logprobs are not supported", "top_logprobs")


def to_chat(req: ResponsesRequest, history: Sequence[dict[str, Any]] = (), strict: bool = True) -> dict[str, Any]:
    """The chat completions body for `req`, with `history` (an earlier conversation, in
    chat messages) after the instructions' system message and before the input."""
    if strict:
        check_supported(req)
    tools = translate_tools(req.tools, strict)
    body: dict[str, Any] = {"model": req.model,
                            "messages": chat_messages(req.input, req.instructions, strict, history),
                            "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = translate_tool_choice(req.tool_choice, tools, strict)
    if req.text is not None and req.text.format is not None:
        body["response_format"] = response_format(req.text.format)
    optional = {"parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "top_k": req.top_k,
                "ignore_eos": req.ignore_eos, "stop": req.stop, "kv_transfer_params": req.kv_transfer_params,
                "cache_salt": req.cache_salt}
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def translate_tools(tools: list[Any] | None, strict: bool = True) -> list[dict[str, Any]]:
    """Function tools in chat form ({type, function: {...}}); other kinds are refused."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if strict or not isinstance(tool, dict):
                raise ResponsesRequestError(f"tools[{i}].type: {kind!r} tools are not supported (function tools are)",
                                            f"tools[{i}].type")
            continue
        try:
            spec = FunctionTool.model_validate(tool)
        except ValidationError as exc:
            raise validation_error(exc, f"tools[{i}]") from exc
        function = {"name": spec.name, "description": spec.description, "parameters": spec.parameters,
                    "strict": spec.strict}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def translate_tool_choice(choice: str | dict[str, Any], tools: list[dict[str, Any]],
                          strict: bool = True) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise ResponsesRequestError("tool_choice: must be none, auto, required or a function", "tool_choice")
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        if not strict:
            return "auto"
        raise ResponsesRequestError("tool_choice: only none, auto, required and {type: function, name} are "
                                    "supported", "tool_choice")
    if strict and name not in {tool["function"]["name"] for tool in tools}:
        raise ResponsesRequestError(f"tool_choice.name: no function tool is named {name!r}", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def validation_error(exc: ValidationError, prefix: str = "") -> ResponsesRequestError:
    """The first error of a pydantic validation, with its field spelt `input[2].content`."""
    first = exc.errors()[0]
    param = prefix
    for part in first.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif not any(c in part for c in "[](),") and part not in ("str", "int", "float", "bool", "list", "dict"):
            param += f".{part}" if param else part
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return ResponsesRequestError(f"{param}: {message}" if param else message, param or None)
