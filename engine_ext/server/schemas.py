"""OpenAI request bodies as the engine accepts them.

Unknown fields are ignored, as OpenAI's SDKs add new ones often; known fields are
validated, and features the engine does not implement are refused with a clear 400
rather than silently ignored (a client asking for n=3 must not get one answer).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine_ext.errors import InvalidRequestError
from engine_ext.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content as one string."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            data["content"] = ""
        return data


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    kv_transfer_params: dict[str, Any] | None = None

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
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

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
        return prompt
