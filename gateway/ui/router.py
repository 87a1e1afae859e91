"""Routes of /ui: server-rendered HTML (Jinja2, autoescaped), one vendored script
(cytoscape, for the step graph; see `make ui-assets`), nothing from a CDN.

Access (gateway/ui/access.py): with KVRELAY_ADMIN_KEY set, the page asks for the admin
key once and keeps a token derived from it in a cookie (or takes `Authorization:
Bearer`); without an admin key it is open only while client keys are off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from gateway.call import GatewayState
from gateway.inference.views import session_detail, session_summary
from gateway.storage.models import RequestRow
from gateway.ttft import load_requests, session_ttft
from gateway.ui.access import forget, is_admin_key, is_allowed, remember
from gateway.ui.waterfall import STAGE_COLOURS, WAIT_COLOUR, method_colour, methods_drawn, waterfall_svg

HERE = Path(__file__).parent
EDGE_COLOURS = {"dataflow": "#e69138", "succession": "#999999"}


def _templates() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    # Seconds as milliseconds; "-" for a part the engine did not report (None, or a key
    # missing from the breakdown, which Jinja gives as Undefined).
    env.globals["ms"] = lambda s: f"{round(s * 1e3):d}" if isinstance(s, (int, float)) else "-"
    env.globals["count"] = lambda n, noun: f"{n} {noun}" + ("" if n == 1 else "s")
    env.filters["path_part"] = lambda text: quote(str(text), safe="")  # a session id may hold "/"
    return env


def ui_router() -> APIRouter:
    router = APIRouter(prefix="/ui")
    templates = _templates()

    def page(name: str, **context: Any) -> HTMLResponse:
        return HTMLResponse(templates.get_template(name).render(**context))

    def refuse(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if state.settings.admin_key is None:
            return HTMLResponse("<p>The page needs KVRELAY_ADMIN_KEY while client keys are required.</p>", 403)
        return HTMLResponse('<form method="post" action="/ui/login"><label>Admin key '
                            '<input type="password" name="key"></label> <button>Open</button></form>', 401)

    @router.post("/login")
    async def login(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        body = await request.body()
        key = parse_qs(body[:4096].decode(errors="replace")).get("key", [""])[0]
        if not is_admin_key(state, key):
            return refuse(request)
        response = RedirectResponse("/ui", status_code=303)
        remember(response, request, state)
        return response

    @router.post("/logout")
    async def logout() -> Response:
        response = RedirectResponse("/ui", status_code=303)
        forget(response)
        return response

    @router.get("", response_model=None)
    async def sessions(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if not is_allowed(request, state):
            return refuse(request)
        return page("sessions.html", title="Sessions", sessions=await _session_list(request, state))

    @router.get("/sessions/{session_id:path}", response_model=None)
    async def session(session_id: str, request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        if not is_allowed(request, state):
            return refuse(request)
        try:
            rows = await load_requests(request.app.state.db, session_id)
        except (SQLAlchemyError, OSError) as exc:
            return HTMLResponse(f"<p>The database is unavailable ({type(exc).__name__}).</p>", 503)
        if not rows:
            return HTMLResponse(f"<p>No requests recorded for session {_esc(session_id)}.</p>", 404)
        report = session_ttft(session_id, rows)
        detail = _detail(state, session_id)
        agents = [a["id"] for a in detail["agents"]] if detail else sorted({r["agent_id"] for r in report["requests"]
                                                                             if r["agent_id"]})
        edges = detail["step_graph"]["edges"] if detail else []
        graph = [{"data": {"id": a}} for a in agents] + \
            [{"data": {"id": f"{e['source']}->{e['target']}:{e['kind']}", "source": e["source"], "target": e["target"],
                       "colour": EDGE_COLOURS.get(e["kind"], "#999999")}} for e in edges]
        return page("session.html", title=f"Session {session_id}", session_id=session_id, agents=agents,
                    rounds=report["rounds"], requests=report["requests"], totals=report["totals"],
                    tokens_reused=sum(r["cached_tokens"] or 0 for r in report["requests"]),
                    graph_json=_script_json(graph), waterfall=waterfall_svg(report["requests"]),
                    stage_colours={**STAGE_COLOURS, "prefill wait": WAIT_COLOUR},
                    method_colours={m: method_colour(m) for m in methods_drawn(report["requests"])})

    return router


def _detail(state: GatewayState, session_id: str) -> dict[str, Any] | None:
    """The inferred structure of a live session (agents, step graph), if it is in memory."""
    for app_id, app in state.inference.apps.items():
        found = app.sessions.get(session_id)
        if found is not None:
            return session_detail(app, app_id, found)
    return None


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
    except (SQLAlchemyError, OSError):
        recorded = []  # the live sessions still show
    out += [{"id": sid, "app": None, "num_agents": agents, "num_requests": n, "num_rounds": "-",
             "last_seen": str(last)[:19], "state": "recorded"} for sid, n, agents, last in recorded if sid not in seen]
    return out


def _script_json(value: Any) -> str:
    """JSON safe inside <script>: no character of it can end the element or open a comment."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def install_ui(app: FastAPI) -> None:
    app.include_router(ui_router())
    app.mount("/ui/static", StaticFiles(directory=HERE / "static"), name="ui-static")
