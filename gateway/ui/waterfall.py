"""The TTFT waterfall of a session: one row per request on a shared time axis, one bar
per stage up to the first token (queue, plan, prefill, first token), KV assembly shown
inside the prefill in the colour of its reuse method. Server-rendered SVG: no script
is needed to read it, and a test can count its rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

STAGE_COLOURS = {"queue": "#b0b7c3", "plan": "#8e7cc3", "prefill": "#6fa8dc", "first": "#93c47d"}
METHOD_COLOURS = {"prefix": "#274e13", "shift": "#e69138", "blend": "#cc0000", "link": "#a64d79",
                  "kvcomm": "#f1c232", "restored": "#45818e", "dense": "#999999"}
ROW_HEIGHT = 22
LABEL_WIDTH = 220
PLOT_WIDTH = 640


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    colour: str
    title: str


def waterfall_svg(requests: list[dict[str, Any]]) -> str:
    """SVG for the requests of a TTFT report (gateway/ttft.py), oldest at the top."""
    rows = [r for r in requests if r.get("engine")]
    if not rows:
        return '<p class="empty">No request carries an engine TTFT breakdown yet.</p>'
    starts = [datetime.fromisoformat(r["started_at"]).timestamp() for r in rows]
    origin = min(starts)
    span = max(s - origin + (r["engine"].get("ttft_s") or 0.0) for s, r in zip(starts, rows)) or 1e-3
    scale = PLOT_WIDTH / span
    height = ROW_HEIGHT * (len(rows) + 1)
    parts = [f'<svg class="waterfall" xmlns="http://www.w3.org/2000/svg" width="{LABEL_WIDTH + PLOT_WIDTH + 20}" '
             f'height="{height}" role="img" aria-label="TTFT waterfall">']
    for i, (start, request) in enumerate(zip(starts, rows)):
        y = i * ROW_HEIGHT + 4
        label = f"{request['agent_id'] or '-'} {request['round_id'] and '(round)' or ''}".strip()
        parts.append(f'<g class="request" data-request="{_esc(request["request_id"])}">'
                     f'<text x="0" y="{y + 13}" font-size="12">{_esc(label[:32])}</text>')
        for bar in _bars(request["engine"], (start - origin) * scale, scale):
            parts.append(f'<rect x="{LABEL_WIDTH + bar.x:.1f}" y="{y}" width="{max(bar.width, 0.5):.1f}" '
                         f'height="{ROW_HEIGHT - 8}" fill="{bar.colour}"><title>{_esc(bar.title)}</title></rect>')
        parts.append("</g>")
    parts.append(f'<text x="{LABEL_WIDTH}" y="{height - 4}" font-size="11">0 ms</text>'
                 f'<text x="{LABEL_WIDTH + PLOT_WIDTH - 60}" y="{height - 4}" font-size="11">{span * 1e3:.0f} ms</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bars(engine: dict[str, Any], x0: float, scale: float) -> list[Bar]:
    bars, x = [], x0
    for stage, colour in STAGE_COLOURS.items():
        seconds = engine.get(f"{stage}_s") or 0.0
        bars.append(Bar(x, seconds * scale, colour, f"{stage}: {seconds * 1e3:.1f} ms"))
        if stage == "prefill":
            inner = x
            for method, assembly_s in (engine.get("assembly_s") or {}).items():
                bars.append(Bar(inner, assembly_s * scale, METHOD_COLOURS.get(method, "#000000"),
                                f"KV assembly, {method}: {assembly_s * 1e3:.1f} ms"))
                inner += assembly_s * scale
        x += seconds * scale
    return bars


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
