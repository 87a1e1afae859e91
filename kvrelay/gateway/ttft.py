"""A session's TTFT analysis: per request and per round, where the time to the first
token went (the engine's breakdown kept with each request) and what reuse saved: the
TTFT prefix caching alone would have given (the engine prices what that path would
have computed at its measured dense prefill time, engine_ext/timeline.py), against
the actual one.

One computation for every view: GET /admin/sessions/{id}/ttft, `kvrelay ttft
SESSION_ID` and the /ui session page all show `session_ttft` of the request records in
SQL, each record's breakdown checked again (kvrelay/wire/reports.py) as it is read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from kvrelay.gateway.storage.models import RequestRow
from kvrelay.wire.reports import TtftBreakdown

STAGES = ("prepare", "queue", "plan", "prefill", "first")  # up to the first token, as the engine reports them
MAX_REQUESTS = 5000  # a report past this many requests shows the first ones: a page, not a dump
_COLUMNS = (RequestRow.id, RequestRow.agent_id, RequestRow.started_at, RequestRow.plan, RequestRow.status,
            RequestRow.prompt_tokens, RequestRow.cached_tokens, RequestRow.ttft_ms, RequestRow.latency_ms,
            RequestRow.stream, RequestRow.ttft_breakdown)


async def load_requests(db: AsyncEngine, session_id: str) -> list[Any]:
    """The session's request records, oldest first: the columns the report reads (never
    the stored prompt or completion text), at most MAX_REQUESTS."""
    query = (select(*_COLUMNS).where(RequestRow.session_id == session_id)
             .order_by(RequestRow.started_at).limit(MAX_REQUESTS))
    async with db.connect() as conn:
        return list((await conn.execute(query)).all())


def session_ttft(session_id: str, rows: list[Any]) -> dict[str, Any]:
    """The report: each request's breakdown, then each round's (summed over its members)
    and the session's totals. Requests without an engine breakdown (another engine, an
    error) are listed with what the gateway measured alone."""
    requests = [_request(row) for row in rows]
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for request in requests:
        if request["round_id"] is not None:
            rounds[request["round_id"]].append(request)
    for round_id in [r for r, members in rounds.items() if len(members) < 2]:
        for request in rounds.pop(round_id):  # a round of one request did not form: shown as none
            request["round_id"] = None
    return {"object": "session.ttft", "session_id": session_id, "requests": requests,
            "truncated": len(rows) >= MAX_REQUESTS,
            "rounds": [{"round_id": round_id, "num_requests": len(members), "wall_ttft_s": _wall_ttft(members),
                        "stages_s": _stage_sums(members), **_totals(members)}
                       for round_id, members in rounds.items()],
            "totals": {"num_requests": len(requests), **_totals(requests)}}


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table, milliseconds: one line per request, then per round
    (stages summed over its members, and its wall-clock TTFT), then the total, and a
    line saying what `dense` and `saved` are measured against."""
    head = ("request", "agent", "round", *(s if s != "prepare" else "prep" for s in STAGES),
            "ttft", "dense", "saved", "gateway")
    lines = [head]
    for r in report["requests"]:
        b = r["engine"] or {}
        lines.append((r["request_id"][:12], (r["agent_id"] or "-")[:16], (r["round_id"] or "-")[-8:],
                      *(_ms(b.get(f"{s}_s")) for s in STAGES), _ms(b.get("ttft_s")), _ms(b.get("dense_ttft_s")),
                      _ms(b.get("saved_s")) if "saved_s" in b or not b else "?", _ms(r["gateway_ttft_ms"], scale=1)))
    for r in report["rounds"]:
        lines.append((f"round {r['round_id'][-8:]}", f"{r['num_requests']} requests", f"wall {_ms(r['wall_ttft_s'])}",
                      *(_ms(r["stages_s"][f"{s}_s"]) for s in STAGES), _ms(r["ttft_s"]), _ms(r["dense_ttft_s"]),
                      _ms(r["saved_s"]), ""))
    t = report["totals"]
    lines.append(("total", f"{t['num_requests']} requests", "", *("" for _ in STAGES), _ms(t["ttft_s"]),
                  _ms(t["dense_ttft_s"]), _ms(t["saved_s"]), ""))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    table = "\n".join("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
    if report.get("truncated"):
        table += f"\n(the first {MAX_REQUESTS} requests only)"
    table += (f"\ndense: the TTFT with prefix caching alone, its prefill priced at the engine's measured dense "
              f"prefill time; saved = dense - ttft, over {t['num_priced']} of {t['num_reported']} requests "
              f"(?: no similar prefill measured yet); {t['reused_tokens']} tokens reused beyond the prefix cache")
    return table


def _request(row: Any) -> dict[str, Any]:
    plan = _json(row.plan)
    round_info = plan.get("round") if isinstance(plan, dict) else None
    return {"request_id": row.id, "agent_id": row.agent_id, "started_at": row.started_at.isoformat(),
            "round_id": round_info.get("id") if isinstance(round_info, dict) else None,
            "status": row.status, "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
            "gateway_ttft_ms": row.ttft_ms if row.stream else row.latency_ms,
            "engine": _engine(row.ttft_breakdown)}


def _totals(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT summed over the requests the engine reported on; the TTFT prefix caching
    alone would have given and the saving over those with a baseline (a request that
    did the prefix path's own work counts, saving 0; one that reused beyond it only if
    the engine could price it), so an unknown never counts as saving nothing, and the
    tokens reused beyond the prefix cache. None when there are none."""
    reported = [r["engine"] for r in requests if r["engine"]]
    priced = [b for b in reported if "saved_s" in b]
    return {"num_reported": len(reported), "num_priced": len(priced),
            "ttft_s": sum(b["ttft_s"] for b in reported) if reported else None,
            "dense_ttft_s": sum(b["dense_ttft_s"] for b in priced) if priced else None,
            "saved_s": sum(b["saved_s"] for b in priced) if priced else None,
            "reused_tokens": int(sum(b.get("reused_tokens", 0) for b in reported))}


def _wall_ttft(members: list[dict[str, Any]]) -> float | None:
    """A round's TTFT as its members lived it: from the first one reaching the gateway to
    the last one's first token (its members overlap, so their TTFTs do not add up)."""
    ends: list[tuple[float, float]] = [(datetime.fromisoformat(r["started_at"]).timestamp(), r["engine"]["ttft_s"])
                                       for r in members if r["engine"]]
    if not ends:
        return None
    first = min(start for start, _ in ends)
    # Offsets from the first start, then the TTFT: at epoch magnitudes `start + ttft - first`
    # rounds by ~1e-7 s, and could come out under the member's own TTFT.
    return max((start - first) + ttft for start, ttft in ends)


def _stage_sums(members: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's seconds summed over the round's members: where the round's TTFT went."""
    keys = [f"{stage}_s" for stage in STAGES] + ["prefill_compute_s", "prefill_wait_s"]
    return {key: sum(r["engine"].get(key) or 0.0 for r in members if r["engine"]) for key in keys}


def _json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _engine(text: str | None) -> dict[str, Any] | None:
    """A record's stored breakdown, read again as an upstream's (it may predate a fix)."""
    report = TtftBreakdown.read(_json(text))
    return None if report is None else report.to_json()


def _ms(value: float | None, scale: float = 1e3) -> str:
    return "-" if value is None else f"{value * scale:.0f}"
