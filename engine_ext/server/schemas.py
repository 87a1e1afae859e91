"""OpenAI request bodies as the engine accepts them.

Unknown fields are ignored, as OpenAI's SDKs add new ones often; known fields are
validated, and features the engine does not implement are refused with a clear 400
rather than silently ignored (a client asking for n=3 must not get one answer).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool,
                      StrictStr, Tag, WithJsonSchema, model_validator)

from engine_ext.errors import InvalidRequestError
from engine_ext.sampling import SamplingParams
from kvrelay.wire.salt import SALT_SCHEMA, check_salt
from kvrelay.json_values import INT64_MAX, INT64_MIN, UNENCODABLE, encodable, first_misfit

INT32_MAX = 2**31 - 1


def _utf8(text: str) -> str:
    if not encodable(text):
        raise ValueError(UNENCODABLE)
    return text


def _utf8_json(value: Any) -> Any:
    misfit = first_misfit(value)
    if misfit is not None:
        raise ValueError(misfit.message)
    return value


# Every string a request carries reaches the tokenizer, a hash or a JSON response: each
# must have a UTF-8 form. Every number must fit what the engine computes with (torch's
# int64 seeds, int32 counts and token ids), checked here, before the engine thread.
Text = Annotated[str, AfterValidator(_utf8)]
Json = Annotated[Any, AfterValidator(_utf8_json)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_utf8_json)]

# Schemas are walked recursively (engine_ext/structured/grammar.py, and llguidance's
# compiler); real ones nest a few levels. Deeper than this is refused, not a stack overflow.
MAX_SCHEMA_DEPTH = 64


def _shallow(schema: dict[str, Any]) -> dict[str, Any]:
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON Schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return schema


JsonSchema = Annotated[dict[str, Any], AfterValidator(_utf8_json), AfterValidator(_shallow)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# vLLM's field: whom cached KV is shared with (checked by check_salt, for its message).
CacheSalt = Annotated[StrictStr, AfterValidator(check_salt), WithJsonSchema(SALT_SCHEMA)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


# Content parts other than text: the served models read text only. Named here so the 400
# says so, instead of pydantic listing every way the part failed to be text.
UNSUPPORTED_PARTS = frozenset({"image_url", "input_audio", "file", "image", "audio", "video_url", "refusal"})


def _text_parts(parts: Any) -> Any:
    if isinstance(parts, list):
        for i, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in UNSUPPORTED_PARTS:
                raise ValueError(f"content[{i}]: {kind} parts are not supported: the served model reads text only")
    return parts


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.:-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Json]  # unused, but checked like every field a request carries

    name: ToolName
    description: Text | None = None
    parameters: JsonSchema | None = None  # None: no arguments
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Json]

    type: Literal["function"]  # the only kind a chat completion takes
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: ToolName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    json_schema: JsonSchema = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


# Tagged by class name, which error bodies leave out of `param` (kvrelay/wire/errors.py):
# tagged by "json_schema" the param would read response_format.json_schema.json_schema.schema.
_FORMAT_TAGS = {"text": "TextFormat", "json_object": "JsonObjectFormat", "json_schema": "JsonSchemaFormat"}
ResponseFormat = Annotated[Annotated[TextFormat, Tag("TextFormat")] | Annotated[JsonObjectFormat, Tag("JsonObjectFormat")]
                           | Annotated[JsonSchemaFormat, Tag("JsonSchemaFormat")], Discriminator(
    _format_tag, custom_error_type="invalid_response_format",
    custom_error_message="response_format must be an object whose type is text, json_object or json_schema")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Json]

    name: Text
    arguments: Text


class ToolCall(BaseModel):
    """A tool call an earlier answer made, as an assistant message sends it back."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Json]

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Json]  # other fields reach the chat template: checked too

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], BeforeValidator(_text_parts)] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # typed: the gateway links sessions on their ids
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content as one string, and a
        tool call's arguments as an object where they are one (HF templates apply
        `tojson` to them; a JSON string would be encoded twice)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            data["content"] = ""
        for call in data.get("tool_calls", ()):
            call["function"]["arguments"] = _arguments_object(call["function"]["arguments"])
        return data


def _arguments_object(arguments: str) -> Any:
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text
    max_tokens: TokenCount | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    kv_transfer_params: JsonObject | None = None
    cache_salt: CacheSalt | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequestError("presence and frequency penalties are not supported",
                                      param="presence_penalty" if self.presence_penalty else "frequency_penalty")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # None: the client did not say. OpenAI's default lets the model make several calls;
    # a grammar allows several only when the client asked (engine_ext/server/shaping.py).
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequestError("each tool needs a distinct function name", param="tools")
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not names:
                raise InvalidRequestError("tool_choice needs tools to choose from", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(f"no tool named {choice.function.name!r} among the request's tools",
                                      param="tool_choice")

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    echo: bool = False
    suffix: Text | None = None

    def prompt_input(self) -> str | list[int]:
        """The single prompt, as text or token ids; batches are refused."""
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        # Pydantic validated one kind of list: past the batch check, a list is token ids
        # (its element types are not something mypy narrows a union of lists by).
        return cast("str | list[int]", prompt)
