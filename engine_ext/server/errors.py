"""OpenAI-style error bodies and the mapping from engine exceptions to HTTP statuses."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from engine_ext.errors import EngineDeadError, EngineError, InvalidRequestError


class ModelNotFoundError(InvalidRequestError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def engine_error_status(exc: EngineError) -> tuple[int, str]:
    if isinstance(exc, ModelNotFoundError):
        return 404, "invalid_request_error"
    if isinstance(exc, InvalidRequestError):
        return 400, "invalid_request_error"
    if isinstance(exc, EngineDeadError):
        return 503, "service_unavailable"
    return 500, "server_error"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", code="invalid_json")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        return error_response(400, f"{param}: {message}" if param else message, param=param)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        status, type_ = engine_error_status(exc)
        param = getattr(exc, "param", None)
        code = getattr(exc, "code", None)
        return error_response(status, str(exc), type_, param, code)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else _phrase(exc.status_code)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, detail, type_)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"
