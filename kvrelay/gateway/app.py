"""The gateway app: `create_app(settings)` builds everything; nothing exists at import time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, cast

import aiohttp
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from kvrelay.wire.salt import TenantSalts
from kvrelay.wire.seal import PlanSeal
from kvrelay.gateway.adapters import AdapterRouter
from kvrelay.gateway.fidelity_guard import FidelityGuard
from kvrelay.gateway.fidelity_metrics import FidelityCollector
from kvrelay.gateway.fidelity_poll import FidelityPoller
from kvrelay.gateway.upstream_probe import UpstreamProber
from kvrelay.gateway.approximation import Approximation
from kvrelay.gateway.admin import install_admin
from kvrelay.gateway.ui import install_ui
from kvrelay.gateway.auth import AccessControl, KeyStore, RateLimiter, TokenEstimator
from kvrelay.gateway.call import GatewayState, ProxiedCall
from kvrelay.gateway.collector import tune_for_serving
from kvrelay.gateway.endpoints import ENDPOINTS, ResponseSessions
from kvrelay.gateway.inference import Inference, RoundHold, StateStore
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.openapi_docs import CHAT_BODY, COMPLETION_BODY, PROXY_RESPONSES, RESPONSES_BODY
from kvrelay.gateway.settings import GatewaySettings
from kvrelay.gateway.storage import migrate
from kvrelay.gateway.storage.engine import open_database
from kvrelay.gateway.storage.journal import RecordJournal
from kvrelay.gateway.storage.writer import RecordWriter
from kvrelay.gateway.supervisor import SupervisedTask
from kvrelay.gateway.tracing import build_tracer_provider, tracer_from
from kvrelay.gateway.upstream_client import UpstreamClient, build_http_client, build_proxy_client
from kvrelay.gateway.upstreams import UpstreamPool
from kvrelay.gateway.proxy_routes import GatewayApp
from kvrelay.gateway.replicas import Replicas
from kvrelay.gateway.routing.cache_poll import CachePoller
from kvrelay.wire.errors import error_response, error_responses, install_request_error_handlers

logger = logging.getLogger(__name__)


def create_app(settings: GatewaySettings | None = None, *, tracer_provider: TracerProvider | None = None) -> FastAPI:
    """The gateway. Spans go to `tracer_provider` when given (tests pass an in-memory one),
    else to the exporters the OTEL_* variables name; the app shuts down only a provider
    it built."""
    settings = settings or GatewaySettings()
    owned_provider = build_tracer_provider() if tracer_provider is None else None
    provider = tracer_provider or owned_provider

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(migrate.upgrade, settings.database_url)  # alembic runs its own loop
        db = open_database(settings.database_url)
        journal = RecordJournal(settings.record_journal_dir) if settings.record_journal_dir is not None else None
        writer = RecordWriter(db, settings.record_queue_size, settings.record_batch_size, journal,
                              settings.record_linger_ms / 1e3)
        writer.start()
        access = await build_access(settings, db)
        http = build_http_client(settings)
        pool = UpstreamPool(settings.upstreams, settings.breaker, settings.load_guard_factor, settings.routing)
        proxy = build_proxy_client(settings)
        upstreams = UpstreamClient(http, pool, settings, proxy)
        await upstreams.check_health()
        loops = [SupervisedTask("kvrelay-key-refresh", access.refresh_loop),
                 SupervisedTask("kvrelay-health", upstreams.health_loop)]
        if pool.policy.reads_cache:
            poller = CachePoller(http, pool, pool.cache, settings.routing.cache_poll_interval_s)
            loops.append(SupervisedTask("kvrelay-cache-poll", poller.run))
        for loop in loops:
            loop.start()
        router = AdapterRouter.from_settings(settings.adapters)
        if router.num_rules:
            logger.info("adapter routing: %d rules", router.num_rules)
        inference = Inference(settings.inference, router)
        store, saver = await start_store(settings, db, inference)
        hold = RoundHold(settings.inference.round_hold_ms) if settings.inference.round_hold_ms > 0 else None
        metrics = GatewayMetrics(pool.served)
        metrics.count_bounds(inference.bounded)
        metrics.count_records(writer)
        secret = settings.plan_secret.get_secret_value() if settings.plan_secret is not None else None
        seal = PlanSeal(secret, settings.plan_max_age_s) if secret is not None else None
        guard, prober, guard_loops = start_guard(settings, http, pool, metrics, seal)
        loops += guard_loops
        approximation = Approximation.from_settings(settings.approximation, guard, guard)
        responses = ResponseSessions()
        replicas = None
        if settings.replication.enabled:
            replicas = Replicas(db, settings.replication, inference, pool, responses)
            await replicas.start()
            metrics.count_replication(replicas.log)
            logger.info("replica %s: sharing inferred state through the database", replicas.log.replica_id)
        app.state.gateway = GatewayState(settings, upstreams, writer, metrics, tracer_from(provider), access,
                                         inference, store, hold, seal, approximation, guard, prober=prober,
                                         responses=responses, salts=TenantSalts(secret), replicas=replicas)
        app.state.db = db
        app.state.loops = [*loops, *([saver] if saver is not None else []), *(replicas.tasks if replicas else [])]
        try:
            yield
        finally:
            for loop in loops:
                await loop.stop()
            if replicas is not None:
                await replicas.stop()
            if store is not None and saver is not None:
                store.stop()
                await saver.join()
            await writer.close()
            if store is not None:
                await final_flush(store)
            await http.close()
            proxy.close()
            await db.dispose()
            if owned_provider is not None:
                owned_provider.shutdown()  # flushes the batch of spans not yet exported

    app = GatewayApp(title="kvrelay gateway", lifespan=lifespan)
    install_request_error_handlers(app)
    install_admin(app)
    install_ui(app)

    @app.post("/v1/chat/completions", openapi_extra=CHAT_BODY, responses=PROXY_RESPONSES)
    async def chat(request: Request, state: State) -> Response:
        return await ProxiedCall(state, ENDPOINTS["/v1/chat/completions"], request).run()

    @app.post("/v1/completions", openapi_extra=COMPLETION_BODY, responses=PROXY_RESPONSES)
    async def completions(request: Request, state: State) -> Response:
        return await ProxiedCall(state, ENDPOINTS["/v1/completions"], request).run()

    @app.post("/v1/responses", openapi_extra=RESPONSES_BODY, responses=PROXY_RESPONSES)
    async def responses(request: Request, state: State) -> Response:
        return await ProxiedCall(state, ENDPOINTS["/v1/responses"], request).run()

    @app.get("/v1/models")
    async def models(state: State) -> dict[str, Any]:
        ids = sorted({m for u in state.upstreams.pool.upstreams if u.healthy for m in u.models})
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvrelay"} for m in ids]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses=error_responses(503))
    async def ready(request: Request, state: State) -> Response:
        try:
            async with request.app.state.db.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (SQLAlchemyError, OSError) as exc:
            return error_response(503, f"database unavailable: {type(exc).__name__}", "service_unavailable")
        if state.upstreams.pool.healthy_count() == 0:
            return error_response(503, "no healthy upstream", "service_unavailable")
        if not state.writer.alive:  # requests would be served but not recorded until it restarts
            return error_response(503, "the record writer is not running", "service_unavailable")
        if down := [loop.name for loop in request.app.state.loops if not loop.alive]:
            return error_response(503, f"background tasks not running: {', '.join(down)}", "service_unavailable")
        return JSONResponse({"status": "ready", "record_backlog": state.writer.backlog})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(state: State) -> Response:
        return PlainTextResponse(state.metrics.render())

    return app


def create_served_app() -> FastAPI:
    """The app of a `kvrelay gateway --workers N` worker, a process that serves it alone:
    settings from the environment, the collector set for serving (collector.py)."""
    app = create_app()
    tune_for_serving()
    return app


def start_guard(settings: GatewaySettings, http: aiohttp.ClientSession, pool: UpstreamPool, metrics: GatewayMetrics,
                seal: PlanSeal | None = None) -> tuple[FidelityGuard | None, UpstreamProber | None, list[SupervisedTask]]:
    """The fidelity guard, its figures in /metrics, the loop that feeds it engines' probe
    scores and the one that scores probes for upstreams that cannot (vLLM); nothing
    when the guard is off."""
    guard_settings = settings.approximation.guard
    if not guard_settings.enabled:
        return None, None, []
    guard = FidelityGuard(guard_settings)
    metrics.registry.register(FidelityCollector(guard))
    poller = FidelityPoller(http, pool, guard, guard_settings.poll_interval_s)
    prober = UpstreamProber(http, pool, guard, poller.scores_itself, seal)
    tasks = [SupervisedTask("kvrelay-fidelity-poll", poller.run), SupervisedTask("kvrelay-upstream-probe", prober.run)]
    for task in tasks:
        task.start()
    return guard, prober, tasks


async def build_access(settings: GatewaySettings, db: AsyncEngine) -> AccessControl:
    """Key checks and rate limits; the tokenizer for estimates loads only when keys are required."""
    estimator = await asyncio.to_thread(TokenEstimator) if settings.require_api_key else None
    limiter = RateLimiter(settings.default_requests_per_minute, settings.default_tokens_per_minute)
    access = AccessControl(KeyStore(db), settings.require_api_key, limiter, settings.key_refresh_s, estimator)
    await access.refresh()
    return access


async def start_store(settings: GatewaySettings, db: AsyncEngine,
                      inference: Inference) -> tuple[StateStore | None, SupervisedTask | None]:
    """Rebuild the inferred state from SQL and start saving it, unless persistence is off."""
    if not settings.inference.persist:
        return None, None
    store = StateStore(db, inference, settings.inference.flush_interval_s)
    loaded = await store.load()
    logger.info("inferred state restored: %d agents, %d sessions, %d segments", *loaded)
    saver = SupervisedTask("kvrelay-state-saver", store.run)
    saver.start()
    return store, saver


async def final_flush(store: StateStore, attempts: int = 3) -> None:
    """Save what is left at shutdown, retrying briefly: a database busy with the record
    writer's last batch must not cost the inferred state."""
    for attempt in range(1, attempts + 1):
        try:
            await store.flush()
            return
        except (SQLAlchemyError, OSError) as exc:
            if attempt == attempts:
                logger.error("the last changes to the inferred state were not saved (%s)", type(exc).__name__)
                return
            await asyncio.sleep(0.2 * attempt)


async def get_state(request: Request) -> GatewayState:
    return cast(GatewayState, request.app.state.gateway)


State = Annotated[GatewayState, Depends(get_state)]
