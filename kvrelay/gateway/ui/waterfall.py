"""The TTFT waterfall of a session, server-rendered SVG: no script is needed to read it,
and a test can count its rows.

Requests are grouped as the session ran them: the members of an All-Gather round
together, every other request alone. Each group has its own time axis (from its first
arrival to its last first token), so a long session does not squeeze a round's bars
to nothing. A row is one request: a bar per stage up to the first token (prepare, queue,
plan, prefill, first token); the prefill bar is split into its KV assembly (one segment per
reuse method, in that method's colour), its compute and its wait between chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from markupsafe import escape

STAGE_COLOURS = {"prepare": "#d9d2c5", "queue": "#b0b7c3", "plan": "#8e7cc3", "prefill": "#6fa8dc", "first": "#93c47d"}
WAIT_COLOUR = "#cfe2f3"  # the prefill's wait between chunks: a lighter prefill
METHOD_COLOURS = {"shift": "#e69138", "blend": "#cc0000", "link": "#a64d79", "kvcomm": "#f1c232",
                  "collective": "#38761d", "diff_restore": "#45818e", "tier_fetch": "#7f6000"}
UNKNOWN_METHOD = "#000000"
ROW_HEIGHT = 22
LABEL_WIDTH = 220
PLOT_WIDTH = 640


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    colour: str
    title: str


def methods_drawn(requests: list[dict[str, Any]]) -> list[str]:
    """The reuse methods whose KV assembly appears in the waterfall, for its legend."""
    seen = {m for r in requests if r.get("engine") for m in (r["engine"].get("assembly_s") or {})}
    return sorted(seen, key=lambda m: (m not in METHOD_COLOURS, list(METHOD_COLOURS).index(m)
                                       if m in METHOD_COLOURS else 0, m))


def method_colour(method: str) -> str:
    return METHOD_COLOURS.get(method, UNKNOWN_METHOD)


def waterfall_svg(requests: list[dict[str, Any]]) -> str:
    """SVG for the requests of a TTFT report (kvrelay/gateway/ttft.py), oldest group first."""
    rows = [r for r in requests if r.get("engine")]
    if not rows:
        return '<p class="empty">No request carries an engine TTFT breakdown yet.</p>'
    grouped: dict[str, list[dict[str, Any]]] = {}  # a round's members together, even if others began between
    for request in rows:
        grouped.setdefault(request["round_id"] or request["request_id"], []).append(request)
    groups = list(grouped.values())
    height = ROW_HEIGHT * (len(rows) + 2 * len(groups))
    parts = [f'<svg class="waterfall" xmlns="http://www.w3.org/2000/svg" width="{LABEL_WIDTH + PLOT_WIDTH + 20}" '
             f'height="{height}" role="img" aria-label="TTFT waterfall">']
    y = 0
    for members in groups:
        parts.append(_group(members, y))
        y += ROW_HEIGHT * (len(members) + 2)
    parts.append("</svg>")
    return "".join(parts)


def _group(members: list[dict[str, Any]], y: int) -> str:
    """A group's heading (what it is, its axis length) and one row per member."""
    starts = [datetime.fromisoformat(r["started_at"]).timestamp() for r in members]
    origin = min(starts)
    span = max(s - origin + (r["engine"].get("ttft_s") or 0.0) for s, r in zip(starts, members)) or 1e-3
    scale = PLOT_WIDTH / span
    round_id = members[0]["round_id"]
    heading = f"round …{round_id[-8:]} · {len(members)} requests" if round_id else "request"
    kind = "round" if round_id else "single"
    parts = [f'<g class="group" data-kind="{kind}">'
             f'<text x="0" y="{y + 15}" font-size="12" font-weight="bold">{escape(heading)}</text>'
             f'<text x="{LABEL_WIDTH}" y="{y + 15}" font-size="11">0 ms</text>'
             f'<text x="{LABEL_WIDTH + PLOT_WIDTH}" y="{y + 15}" font-size="11" text-anchor="end">'
             f'{span * 1e3:.0f} ms</text>']
    for i, (start, request) in enumerate(zip(starts, members)):
        row_y = y + (i + 1) * ROW_HEIGHT + 4
        parts.append(f'<g class="request" data-request="{escape(request["request_id"])}">'
                     f'<text x="8" y="{row_y + 13}" font-size="12">{escape((request["agent_id"] or "-")[:30])}</text>')
        for bar in _bars(request["engine"], (start - origin) * scale, scale):
            parts.append(f'<rect x="{LABEL_WIDTH + bar.x:.1f}" y="{row_y}" width="{max(bar.width, 0.5):.1f}" '
                         f'height="{ROW_HEIGHT - 8}" fill="{bar.colour}"><title>{escape(bar.title)}</title></rect>')
        parts.append("</g>")
    parts.append("</g>")
    return "".join(parts)


def _bars(engine: dict[str, Any], x0: float, scale: float) -> list[Bar]:
    bars, x = [], x0
    for stage, colour in STAGE_COLOURS.items():
        seconds = engine.get(f"{stage}_s") or 0.0
        if stage == "prefill" and "prefill_compute_s" in engine:
            bars.extend(_prefill_bars(engine, x, scale))
        else:
            bars.append(Bar(x, seconds * scale, colour, f"{stage}: {seconds * 1e3:.1f} ms"))
        x += seconds * scale
    return bars


def _prefill_bars(engine: dict[str, Any], x: float, scale: float) -> list[Bar]:
    """The prefill as its parts: KV assembly per method, compute, wait between chunks.
    Their order inside the bar is by kind, not by time (the breakdown keeps sums)."""
    parts = [(f"KV assembly, {m}", s, method_colour(m)) for m, s in (engine.get("assembly_s") or {}).items()]
    parts.append(("prefill compute", engine.get("prefill_compute_s") or 0.0, STAGE_COLOURS["prefill"]))
    parts.append(("prefill wait between chunks", engine.get("prefill_wait_s") or 0.0, WAIT_COLOUR))
    bars = []
    for title, seconds, colour in parts:
        bars.append(Bar(x, seconds * scale, colour, f"{title}: {seconds * 1e3:.1f} ms"))
        x += seconds * scale
    return bars
