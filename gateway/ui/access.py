"""Who may open /ui: the admin, by `Authorization: Bearer <admin key>` or by the session
cookie the login form sets.

The cookie holds a token derived from the admin key (an HMAC of a fixed label), never
the key itself: a leaked cookie opens the page but cannot call the admin API, and
rotating the admin key invalidates every cookie. It is HttpOnly, SameSite=Strict, scoped
to /ui, and Secure when the request came over https (directly or via a proxy's
X-Forwarded-Proto). Without an admin key the page is open only while client keys are
off (a development gateway on loopback).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request, Response

from gateway.call import GatewayState

COOKIE = "kvrelay_ui"
_LABEL = b"kvrelay /ui session v1"


def ui_token(admin_key: str) -> str:
    return hmac.new(admin_key.encode(), _LABEL, hashlib.sha256).hexdigest()


def is_allowed(request: Request, state: GatewayState) -> bool:
    admin_key = state.settings.admin_key
    if admin_key is None:
        return not state.settings.require_api_key
    secret = admin_key.get_secret_value()
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(bearer.strip().encode(), secret.encode())
    return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), ui_token(secret).encode())


def is_admin_key(state: GatewayState, offered: str) -> bool:
    admin_key = state.settings.admin_key
    return admin_key is not None and hmac.compare_digest(offered.encode(), admin_key.get_secret_value().encode())


def remember(response: Response, request: Request, state: GatewayState) -> None:
    """Set the session cookie (the caller checked the key)."""
    admin_key = state.settings.admin_key
    if admin_key is None:
        return
    secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"
    response.set_cookie(COOKIE, ui_token(admin_key.get_secret_value()), path="/ui", httponly=True,
                        samesite="strict", secure=secure)


def forget(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
