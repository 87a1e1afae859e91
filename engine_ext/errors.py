"""The engine's exception hierarchy; the HTTP layer maps each class to one status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory, config or weight file cannot be used."""


class InvalidRequestError(EngineError):
    """A request's parameters are invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the requested completion) does not fit the model's context."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class CapacityError(InvalidRequestError):
    """The request can never fit the KV budget, even alone; waiting would hang forever."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="max_tokens", code="kv_budget_exceeded")


class EngineDeadError(EngineError):
    """The engine loop stopped; no request can complete."""
