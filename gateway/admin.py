"""/admin routes: manage client API keys and look at the upstreams, behind the admin key.

The admin key is separate from client keys (a leaked client key cannot mint others) and
is configured, not stored: KVRELAY_ADMIN_KEY. Without it the admin API is off.
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import KeyInfo, KeyNotFoundError
from gateway.call import GatewayState
from kvrelay.openai_errors import error_response


class AdminRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=128)]
    requests_per_minute: Annotated[int | None, Field(ge=1)] = None
    tokens_per_minute: Annotated[int | None, Field(ge=1)] = None


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
    router = APIRouter(prefix="/admin")

    @router.get("/keys")
    async def list_keys(state: Admin) -> dict[str, Any]:
        return {"object": "list", "data": [_key_json(k) for k in await state.access.store.list()]}

    @router.post("/keys", status_code=201)
    async def create_key(new: NewKey, state: Admin) -> dict[str, Any]:
        created = await state.access.store.create(new.name, new.requests_per_minute, new.tokens_per_minute)
        await state.access.refresh()
        return {**_key_json(created.info), "key": created.secret}

    @router.delete("/keys/{key_id}")
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

    return router


def install_admin(app: Any) -> None:
    app.include_router(admin_router())

    @app.exception_handler(AdminRefused)
    async def _refused(_: Request, exc: AdminRefused) -> JSONResponse:
        return error_response(exc.status, str(exc), "invalid_request_error", code="admin_unauthorized")
