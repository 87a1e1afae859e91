"""The engine's OpenAI-compatible HTTP API. Routes stay thin; CompletionService does the work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry.sdk.trace import TracerProvider

from engine_ext.async_engine import AsyncEngine
from kvrelay.wire.otel import build_provider
from kvrelay.wire.seal import PlanSeal
from engine_ext.server.errors import error_response, install_error_handlers
from engine_ext.server.plans import PlanReader
from engine_ext.server.reuse_metrics import reuse_metrics
from engine_ext.server.responses import RESPONSES_BODY, ResponsesAPI, ResponseStore
from engine_ext.server.schemas import ChatCompletionRequest, CompletionRequest
from engine_ext.server.service import CompletionService
from engine_ext.server.tracing import engine_tracer
from engine_ext.tools.formats.generic import AutoPolicy
from kvrelay.wire.errors import error_responses
from kvrelay.wire.cache_report import CACHE_PATH, CacheReport, digests
from kvrelay.wire.reports import FIDELITY_PATH, FidelityPage

_DISCONNECT_POLL_S = 0.2
# A completion answers JSON, or an event stream when the request asks for one; errors in
# the OpenAI shape: 400 invalid, 404 unknown model, 500 engine failure, 503 engine down.
COMPLETION_RESPONSES = {200: {"description": "The completion (JSON), or its chunks as server-sent events",
                              "content": {"text/event-stream": {}}},
                        **error_responses(400, 404, 500, 503)}


def get_service(request: Request) -> CompletionService:
    service: CompletionService = request.app.state.service  # set by create_app; Starlette's state is untyped
    return service


Service = Annotated[CompletionService, Depends(get_service)]


def get_responses(request: Request) -> ResponsesAPI:
    responses: ResponsesAPI = request.app.state.responses  # set by create_app; Starlette's state is untyped
    return responses


Responses = Annotated[ResponsesAPI, Depends(get_responses)]


def create_app(engine: AsyncEngine, model_name: str, tracer_provider: TracerProvider | None = None,
               plan_seal: PlanSeal | None = None, response_store: ResponseStore | None = None,
               generic_tool_auto: AutoPolicy = "call-first") -> FastAPI:
    """Build the app around a constructed engine; the engine thread runs for the app's
    lifespan. Spans go to `tracer_provider`, else to the exporters the OTEL_* variables
    name (kvrelay/wire/otel.py), else nowhere. With `plan_seal`, only plans the gateway
    sealed are followed (kvrelay/wire/seal.py). `response_store` keeps the responses
    previous_response_id continues (default: ResponseStore.from_env()). `generic_tool_auto`
    decides tool_choice "auto" for a model whose chat template has no tools branch
    (engine_ext/tools/formats/generic.py)."""
    owned_provider = build_provider(default_service="kvrelay-engine") if tracer_provider is None else None
    provider = tracer_provider or owned_provider

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.is_alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.stop)
        if owned_provider is not None:
            owned_provider.shutdown()  # flushes the spans still batched

    app = FastAPI(title="kvrelay engine", lifespan=lifespan)
    app.state.service = CompletionService(engine, model_name, engine_tracer(provider), PlanReader(plan_seal),
                                          generic_tool_auto)
    app.state.responses = ResponsesAPI(app.state.service,
                                       response_store if response_store is not None else ResponseStore.from_env())
    install_error_handlers(app)

    @app.get("/health")
    async def health(service: Service) -> Response:
        if not service.engine.is_alive:
            return error_response(503, "the engine loop is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(service: Service) -> Response:
        return PlainTextResponse(service.plans.metrics() + reuse_metrics(service.engine.reuse_counters()))

    @app.get("/v1/models")
    async def models(service: Service) -> dict[str, Any]:
        return service.models()

    @app.get(FIDELITY_PATH, responses=error_responses(400))
    async def fidelity(service: Service, after: Annotated[int, Query(ge=0)] = 0,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 1000) -> FidelityPage:
        """Fidelity probe results (engine_ext/probes.py) with seq > `after`, oldest first;
        `next` is what to ask after next (below `after` when the engine restarted)."""
        probes = service.engine.probes
        results, next_seq = probes.results_after(after, limit)
        return FidelityPage(results=results, next=next_seq, counters=probes.counters())

    @app.get(CACHE_PATH)
    async def cache(service: Service) -> CacheReport:
        """The blocks this engine holds (their digests), for the gateway's cache-aware
        routing: what a client could learn here it could learn from its own hits' timing
        too, and every digest is keyed by its tenant's salted root."""
        device, lower = service.engine.resident_blocks()
        return CacheReport(block_size=service.engine.model.block_size, device=digests(device), lower=digests(lower))

    @app.post("/v1/chat/completions", responses=COMPLETION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request, service: Service) -> Response:
        return await _respond(service, body, request)

    @app.post("/v1/completions", responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request, service: Service) -> Response:
        return await _respond(service, body, request)

    @app.post("/v1/responses", responses=COMPLETION_RESPONSES, openapi_extra=RESPONSES_BODY)
    async def responses(body: Annotated[dict[str, Any], Body()], request: Request, api: Responses) -> Response:
        """The Responses API, translated over chat completions (engine_ext/server/responses.py)."""
        prepared = api.prepare(body)
        if prepared.stream:
            return _event_stream(await api.stream(prepared, request.headers))
        return await _unless_disconnected(api.complete(prepared, request.headers), request)

    return app


def _event_stream(lines: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(lines, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _respond(service: CompletionService, body: ChatCompletionRequest | CompletionRequest,
                   request: Request) -> Response:
    if body.stream:
        return _event_stream(await service.stream(body, request.headers))
    return await _unless_disconnected(service.complete(body, request.headers), request)


async def _unless_disconnected(work: Awaitable[dict[str, Any]], request: Request) -> Response:
    """The JSON answer, or 499 once the client is gone (the work is cancelled)."""
    task = asyncio.ensure_future(work)
    # Starlette only notices a vanished client when it reads the socket: poll for it so
    # an abandoned non-streaming request stops computing and frees its KV blocks.
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return JSONResponse(task.result())
        if await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
