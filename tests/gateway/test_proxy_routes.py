"""ProxyRoutes: POSTs to the proxy paths go to ProxiedCall ahead of FastAPI; all else to FastAPI."""

from __future__ import annotations

from typing import Any

import pytest

from kvrelay.gateway.proxy_routes import ProxyRoutes, _proxy_endpoint
from tests.gateway.test_proxy import CHAT


def _scope(method: str, path: str, root_path: str = "", type_: str = "http") -> dict[str, Any]:
    return {"type": type_, "method": method, "path": path, "root_path": root_path}


@pytest.mark.parametrize(("method", "path", "root_path", "served"), [
    ("POST", "/v1/chat/completions", "", "/v1/chat/completions"),
    ("POST", "/v1/completions", "", "/v1/completions"),
    ("POST", "/v1/responses", "", "/v1/responses"),
    ("POST", "/api/v1/chat/completions", "/api", "/v1/chat/completions"),  # served under a root path
    ("GET", "/v1/chat/completions", "", None),  # FastAPI answers 405
    ("POST", "/v1/chat/completions/", "", None),  # FastAPI's own redirect or 404
    ("POST", "/v1/models", "", None),
    ("POST", "/apiv1/chat/completions", "/api", None),
    ("POST", "/admin/keys", "", None),
])
def test_which_requests_skip_the_framework(method, path, root_path, served):
    endpoint = _proxy_endpoint(_scope(method, path, root_path))
    assert (endpoint.path if endpoint else None) == served


async def test_anything_else_reaches_the_fallback_untouched():
    reached: list[dict[str, Any]] = []

    async def fallback(scope, receive, send):
        reached.append(scope)

    routes = ProxyRoutes(fallback, app=None)  # type: ignore[arg-type]  # never read for these
    for scope in (_scope("GET", "/v1/chat/completions"), _scope("POST", "/admin/keys"),
                  {"type": "lifespan"}, _scope("GET", "/v1/chat/completions", type_="websocket")):
        await routes(scope, None, None)  # type: ignore[arg-type]
    assert len(reached) == 4 and all("app" not in scope for scope in reached)


def test_the_proxy_routes_answer_as_before_and_the_rest_still_goes_through_fastapi(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url])
    with gw.client() as http:
        ok = http.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and ok.headers["x-kvrelay-request-id"].startswith("req-")
        streamed = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]") and streamed.headers["x-kvrelay-request-id"]
        bad = http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "the request body is not valid JSON"
        wrong_method = http.get("/v1/chat/completions")
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()
        assert "/v1/chat/completions" in http.get("/openapi.json").json()["paths"]  # still documented
    assert [row.status for row in gw.rows(3)] == ["ok", "ok", "client_error"]
