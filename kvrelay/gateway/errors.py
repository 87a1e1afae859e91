"""The gateway's exception hierarchy: each class carries its HTTP status and OpenAI type."""

from __future__ import annotations


class GatewayError(Exception):
    status: int = 500
    type_: str = "server_error"
    code: str | None = None
    record_status: str = "error"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.headers = headers  # extra response headers, e.g. Retry-After
        if code is not None:
            self.code = code


class BadRequestError(GatewayError):
    status, type_, record_status = 400, "invalid_request_error", "client_error"


class BodyTooLargeError(GatewayError):
    status, type_, code, record_status = 413, "invalid_request_error", "body_too_large", "client_error"


class ModelNotFoundError(GatewayError):
    status, type_, code, record_status = 404, "invalid_request_error", "model_not_found", "client_error"


class NoUpstreamError(GatewayError):
    status, type_, code, record_status = 503, "service_unavailable", "no_upstream", "unavailable"


class UpstreamUnreachableError(GatewayError):
    status, type_, code, record_status = 502, "upstream_error", "upstream_unreachable", "upstream_error"


class UpstreamFailedError(GatewayError):
    status, type_, code, record_status = 502, "upstream_error", "upstream_failed", "upstream_error"


class UpstreamTimeoutError(GatewayError):
    status, type_, code, record_status = 504, "timeout", "upstream_timeout", "timeout"


class AuthenticationError(GatewayError):
    status, type_, code, record_status = 401, "invalid_request_error", "invalid_api_key", "client_error"


class RateLimitedError(GatewayError):
    status, type_, code, record_status = 429, "rate_limit_error", "rate_limit_exceeded", "rate_limited"


class GatewayInternalError(GatewayError):
    """A bug of the gateway's own: answered 500 and recorded, never a dropped request."""
    status, type_, code, record_status = 500, "server_error", "internal_error", "error"
