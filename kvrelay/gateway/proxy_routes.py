"""The proxy routes, served ahead of the framework's per-request layers.

Every POST to /v1/chat/completions, /v1/completions and /v1/responses went through seven
ASGI layers before reaching ProxiedCall (error and telemetry middleware, body limit,
exception handlers, an exit stack, the router matching ~40 routes, FastAPI's request
handler with its dependency solving and two more exit stacks), and each chunk of a
stream through two send wrappers. None of them does anything for these routes:
ProxiedCall reads and limits the body itself, answers every error with an OpenAI body,
and takes no parameters the framework would parse. So `GatewayApp` puts `ProxyRoutes` in
front of the whole stack: a POST to a proxy path goes straight to ProxiedCall, anything
else (admin, UI, docs, health, metrics, other methods on these paths) to FastAPI as before.
The routes stay registered with FastAPI, which documents them in /openapi.json and serves
them alike should a request reach it (a mounted copy of the app).
"""

from __future__ import annotations

import logging
from typing import cast

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvrelay.gateway.call import GatewayState, ProxiedCall
from kvrelay.gateway.endpoints import ENDPOINTS, Endpoint
from kvrelay.wire.errors import error_response

logger = logging.getLogger(__name__)


class ProxyRoutes:
    """ASGI: POSTs to the proxy paths to ProxiedCall, everything else to `fallback`."""

    def __init__(self, fallback: ASGIApp, app: FastAPI) -> None:
        self.fallback = fallback
        self.app = app  # its state holds the GatewayState once the lifespan has started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = _proxy_endpoint(scope)
        if endpoint is None:
            await self.fallback(scope, receive, send)
            return
        await self.serve(endpoint, scope, receive, send)

    async def serve(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        """One POST to `endpoint`, through ProxiedCall."""
        scope["app"] = self.app  # what Starlette sets for Request.app
        state = cast(GatewayState, self.app.state.gateway)
        try:
            response = await ProxiedCall(state, endpoint, Request(scope, receive)).run()
        except Exception:  # ProxiedCall answers its own failures; this is the framework's last resort
            logger.exception("the gateway failed to handle a request to %s", endpoint.path)
            response = error_response(500, "the gateway failed to handle the request", "server_error")
        await response(scope, receive, send)


class GatewayApp(FastAPI):
    """FastAPI, with ProxyRoutes in front of its middleware stack. Once the stack is built
    (at the lifespan's start), a proxy POST skips FastAPI's and Starlette's own entry too
    (its telemetry check, the scope bookkeeping): it goes from the server to ProxyRoutes."""

    def build_middleware_stack(self) -> ASGIApp:
        return ProxyRoutes(super().build_middleware_stack(), self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        routes = self.middleware_stack
        if isinstance(routes, ProxyRoutes):
            if self.root_path:
                scope["root_path"] = self.root_path  # what FastAPI.__call__ sets
            if (endpoint := _proxy_endpoint(scope)) is not None:
                await routes.serve(endpoint, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _proxy_endpoint(scope: Scope) -> Endpoint | None:
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root):]
    return ENDPOINTS.get(path)
