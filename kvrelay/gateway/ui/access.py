"""Who may open /ui: the admin, by `Authorization: Bearer <admin key>` or by the session
cookie the login form sets.

The cookie holds `<issued>.<HMAC(admin key, label + issued)>`, never the key: a leaked
cookie opens the page (not the admin API) for at most SESSION_TTL_S, and rotating the
admin key invalidates every cookie. It is HttpOnly, SameSite=Strict, scoped to /ui, and
Secure when the request came over https (directly or via a proxy's X-Forwarded-Proto).
Login and logout refuse cross-site posts (Origin / Sec-Fetch-Site). Without an admin key
the page opens only to loopback clients while client keys are off: a development
gateway, never one reachable from the network.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from urllib.parse import urlsplit

from fastapi import Request, Response

from kvrelay.gateway.call import GatewayState

COOKIE = "kvrelay_ui"
SESSION_TTL_S = 12 * 3600
_LABEL = b"kvrelay /ui session v1 "


def ui_token(admin_key: str, issued: int) -> str:
    digest = hmac.new(admin_key.encode(), _LABEL + str(issued).encode(), hashlib.sha256).hexdigest()
    return f"{issued}.{digest}"


def _valid_token(token: str, admin_key: str, now: float) -> bool:
    issued_text, _, _ = token.partition(".")
    if not issued_text.isdigit() or len(issued_text) > 12:
        return False
    issued = int(issued_text)
    fresh = issued <= now + 60 and now - issued <= SESSION_TTL_S  # a minute of clock skew
    return fresh and hmac.compare_digest(token.encode(), ui_token(admin_key, issued).encode())


def is_loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_allowed(request: Request, state: GatewayState) -> bool:
    admin_key = state.settings.admin_key
    if admin_key is None:
        return not state.settings.require_api_key and is_loopback(request)
    secret = admin_key.get_secret_value()
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(bearer.strip().encode(), secret.encode())
    return _valid_token(request.cookies.get(COOKIE, ""), secret, time.time())


def is_admin_key(state: GatewayState, offered: str) -> bool:
    admin_key = state.settings.admin_key
    return admin_key is not None and hmac.compare_digest(offered.encode(), admin_key.get_secret_value().encode())


def is_same_origin(request: Request) -> bool:
    """False for a browser's cross-site post (a page elsewhere logging the admin in or out)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    return origin is None or urlsplit(origin).netloc == request.headers.get("host")


def remember(response: Response, request: Request, state: GatewayState) -> None:
    """Set the session cookie (the caller checked the key)."""
    admin_key = state.settings.admin_key
    if admin_key is None:
        return
    secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"
    response.set_cookie(COOKIE, ui_token(admin_key.get_secret_value(), int(time.time())), max_age=SESSION_TTL_S,
                        path="/ui", httponly=True, samesite="strict", secure=secure)


def forget(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
