"""What the admin API shows of the inferred state: sessions, their agents (with the names
the traffic gives them), segments, the rounds that formed and the step graph, as
JSON-ready dicts and as Mermaid text."""

from __future__ import annotations

from typing import Any

from kvrelay.gateway.inference.state import AppState, SessionState, TextRef


def session_summary(app_id: str, session: SessionState) -> dict[str, Any]:
    return {"object": "session", "id": session.id, "app": app_id, "num_requests": session.num_requests,
            "agents": session_agents(session), "num_segments": len(session.texts),
            "num_rounds": len(session.rounds.formed()), "last_agent": session.last_agent,
            "first_seen": session.first_seen_at.isoformat(), "last_seen": session.last_seen_at.isoformat()}


def session_agents(session: SessionState) -> list[str]:
    agents = set(session.responses) | set(session.tools) | set(session.read_by)
    return sorted(agents | ({session.last_agent} if session.last_agent else set()))


def session_detail(app: AppState, app_id: str, session: SessionState) -> dict[str, Any]:
    members = set(session_agents(session))
    graph = app.graph
    return {
        **session_summary(app_id, session),
        "agents": [{"id": a, "name": app.agents[a].name if a in app.agents else None,
                    "model": app.agents[a].model if a in app.agents else None,
                    "fixed_prefix_chars": _fixed_chars(app, a), "aggregation": graph.aggregation(a),
                    "predecessors": sorted(graph.predecessors(a))} for a in sorted(members)],
        "segments": [_segment(app, session, seq) for seq in sorted(session.texts)],
        "rounds": [{"id": r.id, "expected_size": r.expected, "num_requests": r.num_requests, "reads": sorted(r.reads)}
                   for r in session.rounds.formed()],
        "step_graph": {"edges": [{"source": s, "target": t, "kind": k} for s, t, k in graph.edges()
                                 if s in members and t in members],
                       "next_after_last": graph.workflow(session.last_agent).next if session.last_agent else []},
        "mermaid": graph.mermaid(members, agent_names(app)),
    }


def agent_names(app: AppState) -> dict[str, str]:
    """Agent id -> the name the traffic gives it, for the agents that have one."""
    return {agent_id: agent.name for agent_id, agent in app.agents.items() if agent.name}


def _fixed_chars(app: AppState, agent_id: str) -> int:
    agent = app.agents.get(agent_id)
    fixed = agent.prefix.fixed if agent else None
    return len(fixed) if fixed else 0


def _segment(app: AppState, session: SessionState, seq: int) -> dict[str, Any]:
    known = session.texts[seq]
    text = app.index.text_of(TextRef(session.id, seq)) or ""
    return {"seq": seq, "kind": known.kind, "name": session.placeholder_name(seq), "agent": known.agent_id,
            "request_id": known.request_id, "content_hash": known.content_hash, "chars": len(text)}
