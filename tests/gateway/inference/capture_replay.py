"""Replay the real-framework captures (tests/data/agents) through one in-process Inference.

The gateway sees what its users' apps send: every app of the captures, with the headers
the frameworks sent (no API key, no app header: all of them land in the one default app,
where two apps can share an agent prompt), each request planned when the capture says it
was sent and each answer observed when it arrived, so the concurrency of a round or of
two runs at once is what the gateway saw. The apps follow each other, as they were
captured. What it inferred is scored against the capture's labels by
benchmarks/agents/scoring.py, the scorer of `kvrelay bench agents`.
"""

from __future__ import annotations

from typing import NamedTuple

from benchmarks.agents.scoring import Key, Observed, Record
from benchmarks.agents.workload import Request, Workload
from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import InferenceSettings
from kvrelay.gateway.sse import tool_call_ids

_GAP_S = 1.0  # between one app's last answer and the next app's first request


class CaptureReplay(NamedTuple):
    observed: dict[Key, Observed]
    edges: set[tuple[str, str]]  # (source agent id, target agent id) of the step graphs
    inference: Inference


def request_id(request: Request) -> str:
    return f"{request.workload}-{request.seq}"


def replay(workloads: list[Workload], settings: InferenceSettings | None = None) -> CaptureReplay:
    inference = Inference(settings or InferenceSettings())
    events: list[tuple[float, int, str, int, Request]] = []
    offset = 0.0
    for workload in workloads:
        for request in workload.requests:
            events.append((offset + request.t_start, 1, workload.name, request.seq, request))
            events.append((offset + request.t_end, 0, workload.name, request.seq, request))  # answers first
        offset += max(r.t_end for r in workload.requests) + _GAP_S
    observed: dict[Key, Observed] = {}
    planned: dict[Key, tuple[str, str, str]] = {}  # key -> (app, session, agent)
    for _, is_request, _, _, request in sorted(events):
        if is_request:
            ident = identify(request.headers, request.body, None)
            result = inference.plan(ident, request.body, request_id(request), request.body.get("model", ""))
            planned[request.key] = (ident.app_id, result.session_id, result.agent_id)
            record = Record(result.session_id, result.agent_id, result.plan.model_dump(mode="json"))
            observed[request.key] = Observed(request_id(request), record, request.quotes)
            continue
        answer = request.response.get("content")
        app_id, session_id, agent_id = planned[request.key]
        inference.observe_response(app_id, session_id, agent_id, request_id(request),
                                   answer if isinstance(answer, str) else "",
                                   tool_call_ids([request.response]))
    edges = {(source, target) for app in inference.apps.values() for target in app.graph.nodes
             for source in app.graph.predecessors(target)}
    return CaptureReplay(observed, edges, inference)
