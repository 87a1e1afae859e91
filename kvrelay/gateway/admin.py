"""/admin routes, behind the admin key: manage client API keys, look at the upstreams and at
the sessions, agents, rounds and step graphs inferred from traffic.

The admin key is separate from client keys (a leaked client key cannot mint others) and
is configured, not stored: KVRELAY_ADMIN_KEY. Without it the admin API is off.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError

from kvrelay.gateway.approximation import ApproxMethod
from kvrelay.gateway.auth import KeyInfo, KeyNotFoundError
from kvrelay.gateway.call import GatewayState
from kvrelay.gateway.inference.views import agent_names, session_agents, session_detail, session_summary
from kvrelay.gateway.ttft import format_report, load_requests, session_ttft
from kvrelay.wire.errors import error_response, error_responses


class AdminRefused(Exception):
    def __init__(self, status: int, message: str, code: str = "admin_unauthorized") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"\S")]  # not only whitespace
    requests_per_minute: Annotated[int | None, Field(ge=1, le=10**9)] = None  # bounded: the column is 64-bit
    tokens_per_minute: Annotated[int | None, Field(ge=1, le=10**12)] = None


def _require_admin(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    admin_key = state.settings.admin_key
    if admin_key is None:
        raise AdminRefused(403, "the admin API is disabled; set KVRELAY_ADMIN_KEY to enable it")
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(secret.strip().encode(),
                                                              admin_key.get_secret_value().encode()):
        raise AdminRefused(401, "the admin key is missing or wrong")
    return state


Admin = Annotated[GatewayState, Depends(_require_admin)]


def _key_json(key: KeyInfo) -> dict[str, Any]:
    return {**key._asdict(), "object": "api_key", "created_at": key.created_at.isoformat(),
            "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None}


def admin_router() -> APIRouter:
    # Every admin route: 400 invalid, 401 wrong key, 403 admin API off, 503 database down.
    router = APIRouter(prefix="/admin", responses=error_responses(400, 401, 403, 503))

    @router.get("/keys")
    async def list_keys(state: Admin) -> dict[str, Any]:
        return {"object": "list", "data": [_key_json(k) for k in await state.access.store.list()]}

    @router.post("/keys", status_code=201)
    async def create_key(new: NewKey, state: Admin) -> dict[str, Any]:
        try:
            created = await state.access.store.create(new.name, new.requests_per_minute, new.tokens_per_minute)
        except ValueError as exc:
            raise AdminRefused(400, str(exc), code="invalid_key_request") from exc
        await state.access.refresh()
        return {**_key_json(created.info), "key": created.secret}

    @router.delete("/keys/{key_id}", responses=error_responses(404))
    async def revoke_key(key_id: str, state: Admin) -> JSONResponse:
        try:
            revoked = await state.access.store.revoke(key_id)
        except KeyNotFoundError as exc:
            return error_response(404, str(exc), param="key_id", code="key_not_found")
        await state.access.refresh()
        return JSONResponse(_key_json(revoked))

    @router.get("/upstreams")
    async def upstreams(state: Admin) -> dict[str, Any]:
        data = [{"url": u.url, "healthy": u.healthy, "breaker_open": time.monotonic() < u.open_until, "in_flight": u.in_flight,
                 "models": sorted(u.models)} for u in state.upstreams.pool.upstreams]
        return {"object": "list", "data": data}

    @router.get("/fidelity")
    async def fidelity(state: Admin) -> dict[str, Any]:
        """The fidelity guard's figures per (tenant, app, method), most recently scored first."""
        guard = state.fidelity
        return {"object": "list", "enabled": guard is not None, "data": guard.snapshot() if guard else [],
                "settings": state.settings.approximation.guard.model_dump()}

    @router.post("/fidelity/{app}/{method}/enable", responses=error_responses(404, 409))
    async def enable_method(app: str, method: ApproxMethod, state: Admin,
                            tenant: Annotated[str | None, Query(min_length=1, max_length=256)] = None
                            ) -> dict[str, Any]:
        """Switch a method the guard turned off back on for an app (for `tenant` only, else
        for every tenant), without waiting for the re-probe."""
        if state.fidelity is None:
            raise AdminRefused(409, "the fidelity guard is off", code="fidelity_guard_off")
        tenants = state.fidelity.enable(tenant, app, method)
        if not tenants:
            raise AdminRefused(404, f"{method} is not off for app {app!r}" + (f" (tenant {tenant!r})" if tenant else ""),
                               code="method_not_off")
        return {"object": "fidelity.enabled", "tenants": tenants, "app": app, "method": method, "state": "on"}

    @router.get("/sessions")
    async def sessions(state: Admin, app: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
        """Live sessions (in memory), most recently used first."""
        apps = state.inference.apps
        live = [(app_id, s) for app_id, a in apps.items() if app in (None, app_id) for s in a.sessions.values()]
        live.sort(key=lambda item: item[1].last_seen, reverse=True)
        return {"object": "list", "data": [session_summary(app_id, s) for app_id, s in live[:limit]]}

    @router.get("/sessions/{session_id}", response_model=None, responses=error_responses(404, 409))
    async def session(session_id: str, state: Admin, app: str | None = None,
                      format: Literal["json", "mermaid"] = "json") -> Response:
        """One session, live or restored from SQL, with its agents, segments, rounds and step graph."""
        app_id = await session_app(state, session_id, app)
        found = state.inference.apps[app_id].sessions[session_id]
        if format == "mermaid":
            inferred = state.inference.apps[app_id]
            return PlainTextResponse(inferred.graph.mermaid(set(session_agents(found)), agent_names(inferred)) + "\n")
        return JSONResponse(session_detail(state.inference.apps[app_id], app_id, found))

    @router.get("/sessions/{session_id}/ttft", response_model=None, responses=error_responses(404))
    async def session_ttft_report(session_id: str, request: Request, state: Admin,
                                  format: Literal["json", "text"] = "json") -> Response:
        """Per request and per round: where the time to first token went, what reuse saved
        against prefix caching alone (kvrelay/gateway/ttft.py, the computation /ui and `kvrelay ttft` show)."""
        try:
            rows = await load_requests(request.app.state.db, session_id)
        except (SQLAlchemyError, OSError) as exc:
            raise AdminRefused(503, f"database unavailable: {type(exc).__name__}", code="database_unavailable") from exc
        if not rows:
            raise AdminRefused(404, f"no requests recorded for session {session_id!r}", code="session_not_found")
        report = session_ttft(session_id, rows)
        if format == "text":
            return PlainTextResponse(format_report(report) + "\n")
        return JSONResponse(report)

    return router


async def session_app(state: GatewayState, session_id: str, app: str | None) -> str:
    """The app whose session this is, with the session in memory (restored if need be)."""
    apps = [app] if app is not None else [a for a, s in state.inference.apps.items() if session_id in s.sessions]
    if not apps and state.store is not None:
        try:
            apps = await state.store.sessions_named(session_id)
        except (SQLAlchemyError, OSError) as exc:
            raise AdminRefused(503, f"database unavailable: {type(exc).__name__}", code="database_unavailable") from exc
    if len(apps) > 1:
        raise AdminRefused(409, f"session {session_id!r} exists in several apps ({', '.join(sorted(apps))}); "
                                "name one with ?app=", code="ambiguous_session")
    if apps and state.store is not None:
        await state.store.restore(apps[0], session_id)
    if not apps or not state.inference.has_session(apps[0], session_id):
        raise AdminRefused(404, f"no session {session_id!r}" + (f" in app {app!r}" if app else ""),
                           code="session_not_found")
    return apps[0]


def install_admin(app: FastAPI) -> None:
    app.include_router(admin_router())

    @app.exception_handler(AdminRefused)
    async def _refused(_: Request, exc: AdminRefused) -> JSONResponse:
        return error_response(exc.status, str(exc), "invalid_request_error", code=exc.code)
