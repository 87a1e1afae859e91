"""Inference on the request path: session, agent and the SegmentPlan of one request.

`plan()` runs before the upstream call; `observe_response()` after it, so the answer an
agent just produced is recognised when the next agent's prompt quotes it. Both are
synchronous and touch only memory, on the gateway's event loop, so their cost is bounded:
linear in the prompt (numpy passes, C string searches), and bounded in the app's state
(agents found by index, not scan; a step graph of at most `max_agents` nodes walked once;
the question looked for in linear time). On top, `plan_budget_ms`, counted once the prompt has
been scanned for known texts (a linear pass done whatever the budget): the plan is built in
stages (who is asking: the agent, then the session it continues, linking.py; the
segments and round, segments.py and rounds.py; the workflow, stepgraph.py), and once the budget is
spent the stages left are skipped. The request then goes on with the plan built so far
(its tenant always, its segments and round if they were done), counted as
`plans_over_budget`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, NamedTuple

from kvrelay.wire.plan import RoundInfo, Segment, SegmentPlan, WorkflowInfo
from kvrelay.gateway.adapters import AdapterRouter
from kvrelay.gateway.identity import Identity
from kvrelay.gateway.inference.agents import resolve_agent
from kvrelay.gateway.inference.agenttable import AgentState
from kvrelay.gateway.inference.budget import Deadline
from kvrelay.gateway.inference.linking import find_texts, linked_session, sessions_to_merge
from kvrelay.gateway.inference.messages import call_ids, prompt_messages, sha256
from kvrelay.gateway.inference.prefix import PrefixLearner
from kvrelay.gateway.inference.rounds import read_pattern
from kvrelay.gateway.inference.segments import SegmentBuilder
from kvrelay.gateway.inference.session_ids import ask_of, new_session_id
from kvrelay.gateway.inference.state import AppState, Changes, KnownText, SessionState
from kvrelay.gateway.settings import InferenceSettings
from kvrelay.gateway.tenancy import TenantMap

PER_MESSAGE_MS = 0.05  # planning budget per message, on top of plan_budget_ms (about 3x the measured cost)


class PlanResult(NamedTuple):
    session_id: str
    agent_id: str
    plan: SegmentPlan
    session_inferred: bool  # no header or body field named the session
    over_budget: bool = False  # the budget ran out: the plan holds only the stages done in time
    agent_name: str | None = None  # what the traffic calls the agent, once it has named it


class Inference:
    def __init__(self, settings: InferenceSettings, router: AdapterRouter | None = None) -> None:
        self.settings = settings
        # No router: no rules, so every request runs on the model it names.
        self.router = router if router is not None else AdapterRouter()
        self.apps: OrderedDict[str, AppState] = OrderedDict()  # least recently used first
        self.changes = Changes()  # for the StateStore, which saves them to SQL
        self.tenants = TenantMap(settings.shared_caches)
        self.bounded: Counter[str] = Counter()  # what the bounds cut, by kind (gateway /metrics)
        # New sessions get ids every gateway replica derives alike (session_ids.py); set by
        # Replicas. Off: random ids, one gateway.
        self.agreed_session_ids = False

    def app(self, app_id: str) -> AppState:
        """The app's state (created if new), as the most recently used; past `max_apps`
        the least recently used app leaves memory (its saved state stays in SQL)."""
        app = self.apps.get(app_id)
        if app is None:
            s = self.settings
            app = self.apps[app_id] = AppState(s.anchor_chars, s.session_ttl_s, s.max_sessions,
                                               s.max_texts_per_session, self.bounded, s.max_agents,
                                               s.same_agent_ratio, s.max_step_sources)
            while len(self.apps) > s.max_apps:
                self.apps.popitem(last=False)
                self.bounded["apps_evicted"] += 1
        self.apps.move_to_end(app_id)
        return app

    def plan(self, ident: Identity, body: dict[str, Any], request_id: str, model: str,
             replay_in: str | None = None) -> PlanResult:
        """The request's session, agent and plan, learning from it as it goes. `replay_in`:
        another gateway replica planned this request in that session (replication.py); it
        is learned in full (no budget) and its session kept, so the replicas' states agree."""
        messages = prompt_messages(body)
        app = self.app(ident.app_id)
        found = {m.index: find_texts(app, m.content) for m in messages if m.content}
        # The clock starts after the scan for known texts: the scan is linear in the prompt
        # and done whatever the budget, and its cost says nothing of what follows (the first
        # long prompt after start pays the first touch of fresh memory, several times the
        # scan itself, and lost its plan to it). The budget grows with the transcript: a long
        # but ordinary one (hundreds of turns) must keep its plan; only what is beyond linear
        # cost is cut.
        budget_s = (self.settings.plan_budget_ms + PER_MESSAGE_MS * len(messages)) / 1e3
        deadline = Deadline(float("inf") if replay_in is not None else budget_s)
        called = app.session_of_calls(call_ids(body))
        system = next((m for m in messages if m.role in ("system", "developer") and m.content is not None), None)
        opening = next((m.content for m in messages if m.content), None)
        agent = resolve_agent(app, ident.agent_id, system.content if system else None, model, self.new_learner,
                              None if system else opening)
        known = (replay_in or ident.session_id or called
                 or linked_session(app, found, agent.id, messages[-1].index if messages else 0))
        # With agreed ids, a session the gateway starts is filed under the prompt's ask
        # (also when replayed: what the next run's id derives from); hashed only then.
        starts_here = self.agreed_session_ids and ident.session_id is None and \
            (known is None or (existing := app.sessions.get(known)) is None or not existing.num_requests)
        ask = ask_of(messages) if starts_here else ""
        session_id = known or new_session_id(self.agreed_session_ids, ident.app_id, ask, app.starts)
        session = app.session(session_id)
        if starts_here:
            app.starts.started(ask, session_id)
        if ident.session_id is None and (joined := sessions_to_merge(app, found, session_id)):
            for other in joined:
                app.merge(session, app.sessions[other])
                self.changes.merged.add((ident.app_id, other))
            found = {m.index: find_texts(app, m.content) for m in messages if m.content}  # now texts of this session
        session.num_requests += 1
        session.members.add(agent.id)
        fixed_chars = agent.prefix.observe(system.content).fixed_chars if system and system.content else 0
        app.agents.refile(agent)  # its candidate prefix may have moved
        self.changes.sessions.add((ident.app_id, session_id))
        self.changes.agents.add((ident.app_id, agent.id))
        adapter = self.router.route(model, agent.id, system.content if system else None) if model else None
        segments: list[Segment] = []
        round_info, workflow = None, None
        if not deadline.expired():
            builder = SegmentBuilder(app, session, agent, request_id, deadline)
            for message in messages:
                if message.content:
                    fixed = fixed_chars if system is not None and message.index == system.index else 0
                    builder.add_message(message, found.get(message.index, []), fixed, self.settings.separators)
            builder.add_question(messages, self.settings.anchor_chars)
            builder.settle()
            self.changes.agents |= {(ident.app_id, a) for a in builder.renamed}
            round_info = self._round(ident.app_id, app, session, agent, builder.outputs_in_order())
            cut = builder.segments(self.settings.max_plan_segments)
            if cut is None:
                self.bounded["plans_cut"] += 1  # a prompt of countless pieces: no reuse, it runs densely
            segments = cut or []
            if not deadline.expired():
                workflow = self._step(app, session, agent.id, builder.responses_read, deadline)
                if round_info is not None:  # the round's members still to come run next too
                    rest = {a for a in session.rounds.rest_of_round() if a in app.agents}
                    workflow = workflow.model_copy(update={"next": sorted(set(workflow.next) | rest)})
        if workflow is None:
            session.last_agent = agent.id  # the step graph did not learn this run; the next one follows it
        over_budget = deadline.expired()
        if over_budget:
            self.bounded["plans_over_budget"] += 1
        plan = SegmentPlan(session_id=session_id, agent_id=agent.id, request_id=request_id,
                           segments=segments, round=round_info, workflow=workflow,
                           adapter=adapter, app_id=ident.app_id, tenant=self.tenants.namespace(ident.app_id))
        return PlanResult(session_id, agent.id, plan, ident.session_id is None, over_budget, agent.name)

    def has_session(self, app_id: str, session_id: str) -> bool:
        app = self.apps.get(app_id)
        return app is not None and session_id in app.sessions

    def observe_response(self, app_id: str, session_id: str, agent_id: str, request_id: str, text: str,
                         tool_call_ids: tuple[str, ...] = ()) -> None:
        """Remember a completed answer so later prompts that quote it are linked to it: as
        it was produced (frameworks that copy it keep its trailing spaces and newlines)
        and stripped (others strip it), and the ids of the tool calls it made (a prompt
        that carries one continues this session, whatever else it shares with others)."""
        app = self.app(app_id)
        session = app.session(session_id)
        for call_id in tool_call_ids:
            app.add_call(session, call_id)
        stripped = text.strip()
        if not stripped:
            return
        known = KnownText("response", agent_id, request_id, sha256(text))
        seq = app.add_text(session, text, known, forms=(stripped,))
        if seq is not None:
            session.responses.setdefault(agent_id, []).append(seq)
            self.changes.sessions.add((app_id, session_id))

    def _round(self, app_id: str, app: AppState, session: SessionState, agent: AgentState,
               read: list[int]) -> RoundInfo | None:
        """Count the request in its session's pass, weigh what its reading shows about
        rounds for every agent of the pass, and give it its round, if any."""
        session.rounds.enter(agent.id)
        pattern = read_pattern(read, {seq: session.texts[seq].agent_id for seq in read}, session.responses,
                               session.rounds.read_before(frozenset(read)))
        if pattern is not None:
            for member in session.rounds.pass_agents:
                if (state := app.agents.get(member)) is not None:
                    if pattern == "composed":
                        state.composed_reads += 1
                    else:
                        state.transcript_reads += 1
                    self.changes.agents.add((app_id, member))
        return session.rounds.join(frozenset(read), agent.expects_rounds())

    def _step(self, app: AppState, session: SessionState, agent_id: str, responses_read: set[int],
              deadline: Deadline) -> WorkflowInfo:
        """Teach the app's step graph this run, and read the workflow position from it.
        A source is fresh when this agent reads one of its outputs for the first time.
        Sources no longer in memory (evicted agents) are left out: the graph's nodes are
        the app's agents."""
        seen = session.read_by.setdefault(agent_id, set())
        read_from = {a for seq in responses_read if (a := session.texts[seq].agent_id or "") in app.agents}
        fresh_from = {a for seq in responses_read - seen if (a := session.texts[seq].agent_id or "") in app.agents}
        seen |= responses_read
        previous = session.last_agent if session.last_agent in app.agents else None
        app.graph.observe(agent_id, read_from, fresh_from, previous)
        session.last_agent = agent_id
        return app.graph.workflow(agent_id, self.settings.max_workflow_agents, deadline)

    def new_learner(self) -> PrefixLearner:
        s = self.settings
        return PrefixLearner(s.prefix_min_hits, s.anchor_chars, tuple(s.fixed_prefix_delimiters))
