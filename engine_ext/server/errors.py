"""The mapping from engine exceptions to HTTP statuses and OpenAI error bodies."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine_ext.errors import EngineDeadError, EngineError, InvalidRequestError
from kvrelay.wire.errors import error_body, error_response, install_request_error_handlers

__all__ = ["ModelNotFoundError", "engine_error_status", "error_body", "error_response", "install_error_handlers"]


class ModelNotFoundError(InvalidRequestError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def engine_error_status(exc: EngineError) -> tuple[int, str]:
    if isinstance(exc, ModelNotFoundError):
        return 404, "invalid_request_error"
    if isinstance(exc, InvalidRequestError):
        return 400, "invalid_request_error"
    if isinstance(exc, EngineDeadError):
        return 503, "service_unavailable"
    return 500, "server_error"


def install_error_handlers(app: FastAPI) -> None:
    install_request_error_handlers(app)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        status, type_ = engine_error_status(exc)
        return error_response(status, str(exc), type_, getattr(exc, "param", None), getattr(exc, "code", None))
