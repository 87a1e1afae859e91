"""OpenAI-style error bodies, shared by the engine's server and the gateway.

Every error either app returns has the shape {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from http import HTTPStatus
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """The body of every error response (documented in the OpenAPI schemas)."""
    error: OpenAIErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route: each status with the OpenAI error body."""
    return {status: {"model": OpenAIError, "description": _phrase(status)} for status in statuses}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def install_request_error_handlers(app: FastAPI) -> None:
    """400 for invalid JSON or request shape; OpenAI bodies for every HTTPException, and
    a 500 OpenAI body for any other exception a route lets through."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = _most_telling(exc.errors())
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        param = ".".join(loc) or None
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return error_response(400, f"{param}: {message}" if param else message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else _phrase(exc.status_code)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, detail, type_)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the exception after this answer: the client gets an OpenAI body
        # that names no internals, the log the traceback.
        return error_response(500, "the server failed to handle the request", "server_error", code="internal_error")


# Pydantic reports a failed union once per member, each under a tag naming the member's
# type ("str", "list[TextPart]", "function-after[...]"): never a field of an OpenAI body.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "constrained-int"})
_MISMATCH_TYPES = frozenset({"string_unicode", "int_parsing", "float_parsing", "bool_parsing", "literal_error",
                             "model_attributes_type", "missing"})


def _is_union_tag(part: object) -> bool:
    """A member's tag: a type name, or a model class name (CamelCase: never a field of
    an OpenAI body, whose fields are snake_case)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[](),")
                                      or (part[:1].isupper() and part.isalnum()))


def _most_telling(errors: Sequence[Any]) -> dict[str, Any]:
    """The error to report: of a union's per-member errors, one that says what is wrong
    with the value (out of range, unencodable) over one that says it is another type;
    among those, the deepest."""
    def rank(error: dict[str, Any]) -> tuple[bool, int]:
        kind = str(error.get("type", ""))
        mismatch = kind.endswith("_type") or kind in _MISMATCH_TYPES
        return not mismatch, len(error.get("loc", ()))
    return max(errors, key=rank, default={})


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"
