"""Routes of /ui: server-rendered HTML (Jinja2, autoescaped), one vendored script
(cytoscape, for the step graph; see `make ui-assets`), nothing from a CDN.

Access (kvrelay/gateway/ui/access.py): with KVRELAY_ADMIN_KEY set, the page asks for the admin
key once and keeps a token derived from it in a cookie (or takes `Authorization:
Bearer`); without an admin key it is open only while client keys are off.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import escape
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from kvrelay.gateway.admin import AdminRefused, session_app
from kvrelay.gateway.call import GatewayState
from kvrelay.gateway.openapi_docs import html_responses
from kvrelay.gateway.inference.views import session_detail, session_summary
from kvrelay.gateway.storage.models import RequestRow
from kvrelay.gateway.ttft import load_requests, session_ttft
from kvrelay.gateway.ui.access import forget, is_admin_key, is_allowed, is_same_origin, remember
from kvrelay.gateway.ui.waterfall import STAGE_COLOURS, WAIT_COLOUR, method_colour, methods_drawn, waterfall_svg

HERE = Path(__file__).parent
logger = logging.getLogger(__name__)
EDGE_COLOURS = {"dataflow": "#e69138", "succession": "#999999"}


def _templates() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    # Seconds as milliseconds; "-" for a part the engine did not report (None, or a key
    # missing from the breakdown, which Jinja gives as Undefined).
    env.globals["ms"] = lambda s: f"{round(s * 1e3):d}" if isinstance(s, (int, float)) else "-"
    env.globals["count"] = lambda n, noun: f"{n} {noun}" + ("" if n == 1 else "s")
    env.filters["path_part"] = lambda text: quote(str(text), safe="")  # a session id may hold "/"
    return env


# Every page: no framing (clickjacking), scripts only from /ui/static, no referrer to other
# sites (same-origin, not no-referrer: with no-referrer a browser posts the login with Origin: null).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin", "X-Content-Type-Options": "nosniff",
}
MAX_LOGIN_BYTES = 4096


def ui_router() -> APIRouter:
    router = APIRouter(prefix="/ui")
    templates = _templates()

    def html(content: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(content, status, headers=SECURITY_HEADERS)

    def back_to_ui(what: str) -> HTMLResponse:
        """303 to /ui, with a line of HTML for a client that does not follow redirects."""
        return HTMLResponse(f'<p>{what} <a href="/ui">Sessions</a></p>', 303,
                            headers={**SECURITY_HEADERS, "Location": "/ui"})

    def page(name: str, **context: Any) -> HTMLResponse:
        return html(templates.get_template(name).render(**context))

    def refuse(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if state.settings.admin_key is None:
            return html("<p>Without KVRELAY_ADMIN_KEY the page opens only to loopback clients, "
                        "and only while client keys are off.</p>", 403)
        return html('<form method="post" action="/ui/login"><label>Admin key '
                    '<input type="password" name="key"></label> <button>Open</button></form>', 401)

    @router.post("/login", status_code=303, response_class=HTMLResponse,
                 responses={303: {"description": "Logged in: back to /ui"}, **html_responses(401, 403, 413)})
    async def login(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if not is_same_origin(request):
            return html("<p>Cross-site login refused.</p>", 403)
        body = await _capped_body(request, MAX_LOGIN_BYTES)
        if body is None:
            return html("<p>The login form is larger than it can be.</p>", 413)
        key = parse_qs(body.decode(errors="replace")).get("key", [""])[0]
        if not is_admin_key(state, key):
            return refuse(request)
        response = back_to_ui("Logged in.")
        remember(response, request, state)
        return response

    @router.post("/logout", status_code=303, response_class=HTMLResponse,
                 responses={303: {"description": "Logged out: back to /ui"}, **html_responses(403)})
    async def logout(request: Request) -> Response:
        if not is_same_origin(request):
            return html("<p>Cross-site logout refused.</p>", 403)
        response = back_to_ui("Logged out.")
        forget(response)
        return response

    @router.get("", response_class=HTMLResponse, responses=html_responses(401, 403))
    async def sessions(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if not is_allowed(request, state):
            return refuse(request)
        return page("sessions.html", title="Sessions", sessions=await _session_list(request, state))

    @router.get("/fidelity", response_class=HTMLResponse, responses=html_responses(401, 403))
    async def fidelity(request: Request) -> Response:
        """The fidelity guard's figures (the same as GET /admin/fidelity)."""
        state: GatewayState = request.app.state.gateway
        if not is_allowed(request, state):
            return refuse(request)
        guard = state.fidelity
        return page("fidelity.html", title="Fidelity", enabled=guard is not None,
                    rows=guard.snapshot() if guard else [], settings=state.settings.approximation.guard)

    @router.get("/sessions/{session_id:path}", response_class=HTMLResponse,
                responses=html_responses(401, 403, 404, 503))
    async def session(session_id: str, request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if not is_allowed(request, state):
            return refuse(request)
        try:
            rows = await load_requests(request.app.state.db, session_id)
        except (SQLAlchemyError, OSError) as exc:
            return html(f"<p>The database is unavailable ({type(exc).__name__}).</p>", 503)
        if not rows:
            return html(f"<p>No requests recorded for session {escape(session_id)}.</p>", 404)
        report = session_ttft(session_id, rows)
        detail = await _detail(state, session_id)
        agents = [a["id"] for a in detail["agents"]] if detail else sorted({r["agent_id"] for r in report["requests"]
                                                                             if r["agent_id"]})
        names = {a["id"]: a["name"] for a in detail["agents"] if a["name"]} if detail else {}
        edges = detail["step_graph"]["edges"] if detail else []
        graph = [{"data": {"id": a, "label": names.get(a, a)}} for a in agents] + \
            [{"data": {"id": f"{e['source']}->{e['target']}:{e['kind']}", "source": e["source"], "target": e["target"],
                       "colour": EDGE_COLOURS.get(e["kind"], "#999999")}} for e in edges]
        return page("session.html", title=f"Session {session_id}", session_id=session_id, agents=agents, names=names,
                    rounds=report["rounds"], requests=report["requests"], totals=report["totals"],
                    tokens_reused=sum(r["cached_tokens"] or 0 for r in report["requests"]),
                    graph_json=_script_json(graph), waterfall=waterfall_svg(report["requests"]),
                    stage_colours={**STAGE_COLOURS, "prefill wait": WAIT_COLOUR},
                    method_colours={m: method_colour(m) for m in methods_drawn(report["requests"])})

    return router


async def _capped_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None past `limit` bytes (read no further than that)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return body


async def _detail(state: GatewayState, session_id: str) -> dict[str, Any] | None:
    """The inferred structure of the session (agents, step graph), restored from SQL if
    it is no longer in memory; None when it was never inferred or several apps have it."""
    try:
        app_id = await session_app(state, session_id, None)
    except AdminRefused:
        return None
    return session_detail(state.inference.apps[app_id], app_id, state.inference.apps[app_id].sessions[session_id])


async def _session_list(request: Request, state: GatewayState) -> list[dict[str, Any]]:
    """Live sessions first (most recent use first), then recorded ones no longer in memory."""
    live = [session_summary(app_id, s) for app_id, a in state.inference.apps.items() for s in a.sessions.values()]
    live.sort(key=lambda s: s["last_seen"], reverse=True)
    out = [{"id": s["id"], "app": s["app"], "num_agents": len(s["agents"]), "num_requests": s["num_requests"],
            "num_rounds": s["num_rounds"], "last_seen": s["last_seen"][:19], "state": "live"} for s in live]
    seen = {s["id"] for s in out}
    query = (select(RequestRow.session_id, func.count(), func.count(func.distinct(RequestRow.agent_id)),
                    func.max(RequestRow.started_at))
             .where(RequestRow.session_id.is_not(None)).group_by(RequestRow.session_id)
             .order_by(func.max(RequestRow.started_at).desc()).limit(100))
    try:
        async with request.app.state.db.connect() as conn:
            recorded = (await conn.execute(query)).all()
    except (SQLAlchemyError, OSError) as exc:
        logger.warning("/ui lists live sessions only: the database is unavailable (%s)", type(exc).__name__)
        recorded = []
    out += [{"id": sid, "app": None, "num_agents": agents, "num_requests": n, "num_rounds": "-",
             "last_seen": str(last)[:19], "state": "recorded"} for sid, n, agents, last in recorded if sid not in seen]
    return out


def _script_json(value: Any) -> str:
    """JSON safe inside <script>: no character of it can end the element or open a comment."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def install_ui(app: FastAPI) -> None:
    app.include_router(ui_router())
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
