"""What the gateway's OpenAPI schema says about routes that read their body raw.

The proxy routes forward the client's JSON untouched, so FastAPI cannot derive their
request schema; it is declared here (the fields the gateway itself reads, the rest
passed through), with every status the routes answer. The schema is what clients and
the fuzz tests (tests/gateway/test_openapi_fuzz.py) rely on.
"""

from __future__ import annotations

from typing import Any

from kvrelay.wire.errors import error_responses
from kvrelay.openai_responses import REQUEST_SCHEMA
from kvrelay.wire.salt import SALT_FIELD, SALT_SCHEMA

_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": True,
            "properties": {"role": {"type": "string"}, "name": {"type": "string"},
                           "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}},
                                                {"type": "null"}]}}}
_COMMON = {"model": {"type": "string", "minLength": 1}, "stream": {"type": "boolean"},
           "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0},
           "kv_transfer_params": {"type": "object"}, SALT_FIELD: SALT_SCHEMA}


def _body(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "required": required, "additionalProperties": True,
              "properties": {**_COMMON, **properties}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


CHAT_BODY = _body(["model", "messages"], {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE}})
COMPLETION_BODY = _body(["model", "prompt"], {"prompt": {"anyOf": [
    {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]}})
# The Responses API: the engine's schema for it (kvrelay/openai_responses.py).
RESPONSES_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": REQUEST_SCHEMA}}}}

# 400 invalid, 401 key, 404 model, 413 body, 429 rate limit, 502/504 upstream failed or
# stalled, 503 no upstream.
PROXY_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The upstream's completion (JSON), or its chunks as server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **error_responses(400, 401, 404, 413, 429, 502, 503, 504),
}


def html_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the /ui pages: each status answers HTML; a 404 may also be
    the router's JSON one (a path no route matches)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        content: dict[str, Any] = {"text/html": {}}
        if status == 404:
            content["application/json"] = {"schema": {"$ref": "#/components/schemas/OpenAIError"}}
        out[status] = {"description": "An HTML page", "content": content}
    return out
