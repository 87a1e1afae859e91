"""Inference on the request path: session, agent and the SegmentPlan of one request.

`plan()` runs before the upstream call; `observe_response()` after it, so the answer an
agent just produced is recognised when the next agent's prompt quotes it. Both are
synchronous and touch only memory, on the gateway's event loop, so their cost is bounded:
linear in the prompt (numpy passes, C string searches), and bounded in the app's state
(agents found by index, not scan; a step graph of at most `max_agents` nodes walked once;
the question looked for in linear time). On top, `plan_budget_ms`: the plan is built in
stages (who is asking; the segments and round; the workflow), and once the budget is
spent the stages left are skipped. The request then goes on with the plan built so far
(its tenant always, its segments and round if they were done), counted as
`plans_over_budget`.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

from engine_ext.protocol import Segment, SegmentPlan, WorkflowInfo
from gateway.adapters import AdapterRouter
from gateway.identity import Identity
from gateway.inference.agents import resolve_agent
from gateway.inference.agenttable import AgentState
from gateway.inference.blocks import split_blocks
from gateway.inference.budget import Deadline
from gateway.inference.prefix import PrefixLearner
from gateway.inference.question import common_core
from gateway.inference.state import AppState, Changes, KnownText, SessionState, TextKind, TextRef
from gateway.inference.textindex import Match
from gateway.settings import InferenceSettings
from gateway.sse import tool_call_ids
from gateway.tenancy import TenantMap

PER_MESSAGE_MS = 0.05  # planning budget per message, on top of plan_budget_ms (about 3x the measured cost)
_LINKING_KINDS: frozenset[TextKind] = frozenset({"response", "tool", "question"})


class PromptMessage(NamedTuple):
    index: int
    role: str
    name: str | None
    content: str | None  # None when the content is not a plain string (parts, tool calls only)


class _Span(NamedTuple):
    """A named part of one message, before the gaps are filled with private segments."""

    start: int
    end: int
    kind: str
    name: str | None
    content_hash: str
    source_request: str | None
    seq: int | None = None  # a text of this session: named once the whole prompt is read


class PlanResult(NamedTuple):
    session_id: str
    agent_id: str
    plan: SegmentPlan
    session_inferred: bool  # no header or body field named the session
    over_budget: bool = False  # the budget ran out: the plan holds only the stages done in time


def prompt_messages(body: dict[str, Any]) -> list[PromptMessage]:
    messages = body.get("messages")
    if isinstance(messages, list):
        return [PromptMessage(i, str(m.get("role", "")), m.get("name") if isinstance(m.get("name"), str) else None,
                              m.get("content") if isinstance(m.get("content"), str) else None)
                for i, m in enumerate(messages) if isinstance(m, dict)]
    prompt = body.get("prompt")
    return [PromptMessage(0, "user", None, prompt if isinstance(prompt, str) else None)]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Inference:
    def __init__(self, settings: InferenceSettings, router: AdapterRouter | None = None) -> None:
        self.settings = settings
        # No router: no rules, so every request runs on the model it names.
        self.router = router if router is not None else AdapterRouter()
        self.apps: OrderedDict[str, AppState] = OrderedDict()  # least recently used first
        self.changes = Changes()  # for the StateStore, which saves them to SQL
        self.tenants = TenantMap(settings.shared_caches)
        self.bounded: Counter[str] = Counter()  # what the bounds cut, by kind (gateway /metrics)

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

    def plan(self, ident: Identity, body: dict[str, Any], request_id: str, model: str) -> PlanResult:
        messages = prompt_messages(body)
        # The budget grows with the transcript: planning is linear in it, and a long but
        # ordinary one (hundreds of turns) must keep its plan; only what is beyond
        # linear cost is cut.
        deadline = Deadline((self.settings.plan_budget_ms + PER_MESSAGE_MS * len(messages)) / 1e3)
        app = self.app(ident.app_id)
        found = {m.index: _find(app, m.content) for m in messages if m.content}
        called = app.session_of_calls(_call_ids(body))
        system = next((m for m in messages if m.role in ("system", "developer") and m.content is not None), None)
        agent = resolve_agent(app, ident.agent_id, system.content if system else None, model, self.new_learner)
        session_id = (ident.session_id or called
                      or self._linked_session(app, found, agent.id, messages[-1].index if messages else 0)
                      or f"sess-{uuid.uuid4().hex[:16]}")
        session = app.session(session_id)
        session.num_requests += 1
        fixed_chars = agent.prefix.observe(system.content).fixed_chars if system and system.content else 0
        app.agents.refile(agent)  # its candidate prefix may have moved
        self.changes.sessions.add((ident.app_id, session_id))
        self.changes.agents.add((ident.app_id, agent.id))
        adapter = self.router.route(model, agent.id, system.content if system else None) if model else None
        segments: list[Segment] = []
        round_info, workflow = None, None
        if not deadline.expired():
            builder = _SegmentBuilder(app, session, agent, request_id, deadline)
            for message in messages:
                if message.content:
                    fixed = fixed_chars if system is not None and message.index == system.index else 0
                    builder.add_message(message, found.get(message.index, []), fixed, self.settings.separators)
            builder.add_question(messages, self.settings.anchor_chars)
            round_info = session.rounds.assign(frozenset(builder.responses_read))
            cut = builder.segments(self.settings.max_plan_segments)
            if cut is None:
                self.bounded["plans_cut"] += 1  # a prompt of countless pieces: no reuse, it runs densely
            segments = cut or []
            if not deadline.expired():
                workflow = self._step(app, session, agent.id, builder.responses_read, deadline)
        if workflow is None:
            session.last_agent = agent.id  # the step graph did not learn this run; the next one follows it
        over_budget = deadline.expired()
        if over_budget:
            self.bounded["plans_over_budget"] += 1
        plan = SegmentPlan(session_id=session_id, agent_id=agent.id, request_id=request_id,
                           segments=segments, round=round_info, workflow=workflow,
                           adapter=adapter, app_id=ident.app_id, tenant=self.tenants.namespace(ident.app_id))
        return PlanResult(session_id, agent.id, plan, ident.session_id is None, over_budget)

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

    def _linked_session(self, app: AppState, found: dict[int, list[Match]], agent_id: str,
                        last_message: int) -> str | None:
        """The live session whose answers and tool results cover most of the prompt, if
        any (of those that cover as much, the most recently used: a repeated run produces
        the same texts again; the question counts only between sessions that share none
        of their outputs with the prompt). Short texts recur by chance and link nothing.
        A session is continued when the prompt holds its outputs, or anything after its
        question; one that this agent has already asked, and of which the prompt holds
        only the question, as its last message, is started over: a new run of the same task."""
        chars: Counter[str] = Counter()  # of outputs
        asked: Counter[str] = Counter()  # of the question
        continued: set[str] = set()
        for index, matches in found.items():
            for match in matches:
                if match.end - match.start < app.index.anchor_chars:
                    continue
                counted: set[str] = set()  # a match counts once per session, however many of its texts it equals
                for ref in match.refs:
                    session = app.sessions.get(ref.session_id)
                    kind = session.texts[ref.seq].kind if session is not None else None
                    if kind in _LINKING_KINDS and ref.session_id not in counted:
                        counted.add(ref.session_id)
                        (asked if kind == "question" else chars)[ref.session_id] += match.end - match.start
                        if kind != "question" or index < last_message:
                            continued.add(ref.session_id)
        recency = {session_id: n for n, session_id in enumerate(app.sessions)}  # least recently used first
        for session_id in sorted(chars | asked, key=lambda s: (chars[s], bool(chars[s]) or asked[s], recency[s]),
                                 reverse=True):
            session = app.sessions[session_id]
            if session_id in continued or not session.has_asked(agent_id):
                return session_id
        return None

    def new_learner(self) -> PrefixLearner:
        s = self.settings
        return PrefixLearner(s.prefix_min_hits, s.anchor_chars, tuple(s.fixed_prefix_delimiters))


class _SegmentBuilder:
    """Collects the named spans of each message, then fills the gaps with private ones."""

    def __init__(self, app: AppState, session: SessionState, agent: AgentState, request_id: str,
                 deadline: Deadline) -> None:
        self.app, self.session, self.agent, self.request_id = app, session, agent, request_id
        self.deadline = deadline
        self._spans: dict[int, _Spans] = {}
        self._texts: dict[int, str] = {}
        self.responses_read: set[int] = set()  # seqs of this session's responses found in the prompt

    def add_message(self, message: PromptMessage, matches: list[Match], fixed_chars: int,
                    separators: list[str]) -> None:
        content = message.content or ""
        self._texts[message.index] = content
        spans = self._spans.setdefault(message.index, _Spans())
        if fixed_chars:
            spans.add(_Span(0, fixed_chars, "fixed_prefix", self.agent.id, sha256(content[:fixed_chars]), None))
        for match in matches:
            if match.start >= fixed_chars and (span := self._span(match, content)) is not None:
                spans.add(span)
        if message.role == "tool" and not len(spans):  # a tool result this session has not seen yet
            self._add_new(spans, 0, len(content), content, "tool")
        for block in split_blocks(content, tuple(separators)):
            if self.deadline.expired():
                break  # thousands of blocks cost microseconds each: the rest stay private this time
            if block.start >= fixed_chars and not spans.overlaps(block.start, block.end):
                self._add_new(spans, block.start, block.end, content, "block")

    def add_question(self, messages: list[PromptMessage], anchor_chars: int) -> None:
        """The first request of a session brings the shared user question; a later agent
        that wraps it in its own template narrows it to the text they share."""
        users = [m for m in messages if m.role == "user" and m.content]
        # Unnamed first; else the initiator of a group chat (AutoGen names it, e.g. "User_proxy").
        asks = [m for m in users if m.name in (None, "user")] or users[:1]
        if not asks:
            return
        session = self.session
        if session.question_seq is None:
            if session.num_requests == 1 and not self._spans.get(asks[-1].index):
                content = asks[-1].content or ""
                question = self.app.openings.question(content)  # the task, without the app's wording around it
                self.app.openings.remember(content, session.id)
                self._add_new(self._spans.setdefault(asks[-1].index, _Spans()), *question.span, content, "question")
                if question.earlier is not None:
                    self._narrow_earlier(*question.earlier)
            return
        seq = session.question_seq
        if self.agent.id in session.question_tried or any(
                span.seq == seq for spans in self._spans.values() for span in spans):
            return
        session.question_tried.add(self.agent.id)
        message = asks[0]
        question = self.app.index.text_of(TextRef(session.id, seq)) or ""
        core = common_core(question, message.content or "", anchor_chars)
        spans = self._spans.setdefault(message.index, _Spans())
        if core is None or spans.overlaps(core.message_start, core.message_start + core.end - core.start):
            return
        text = question[core.start:core.end]
        known = dataclasses.replace(session.texts[seq], content_hash=sha256(text))
        self.app.replace_text(session, seq, text, known)
        start = core.message_start
        spans.add(_Span(start, start + len(text), "placeholder", None, known.content_hash, known.request_id, seq))

    def _narrow_earlier(self, session_id: str, question: str) -> None:
        """An earlier session whose opening showed the app's template: its question, if
        still the whole opening, becomes the part inside the template, as this one's
        (so a later run of its task, or its own later prompts, find the same text)."""
        earlier = self.app.sessions.get(session_id)
        seq = earlier.question_seq if earlier is not None else None
        if earlier is None or seq is None or not question:
            return
        kept = self.app.index.text_of(TextRef(session_id, seq)) or ""
        if len(question) < len(kept) and question in kept:
            known = dataclasses.replace(earlier.texts[seq], content_hash=sha256(question))
            self.app.replace_text(earlier, seq, question, known)

    def segments(self, limit: int) -> list[Segment] | None:
        """Every message cut into segments; None past `limit` segments (such a plan is not
        sent, so the rest is not built). A quoted text is named relative to the newest
        text of the session this prompt holds, not to the newest text there is: every
        agent of an All-Gather round names the previous round's outputs alike, even when
        some agents of the round have already answered."""
        horizon = max((span.seq for spans in self._spans.values() for span in spans
                       if span.seq is not None and self.session.texts[span.seq].kind != "block"), default=-1)
        out: list[Segment] = []
        for index in sorted(self._texts):
            text, cursor = self._texts[index], 0
            for span in self._spans.get(index, ()):
                if span.seq is not None:
                    span = self._named(span, span.seq, horizon)
                if span is None or span.start < cursor:
                    continue  # unnamed, or overlaps a span already placed
                if span.start > cursor:
                    out.append(_private(index, text, cursor, span.start))
                out.append(Segment(message_index=index, char_start=span.start, char_end=span.end,
                                   kind=span.kind, name=span.name, content_hash=span.content_hash,  # type: ignore[arg-type]
                                   source_request=span.source_request))
                cursor = span.end
                if len(out) > limit:
                    return None
            if cursor < len(text):
                out.append(_private(index, text, cursor, len(text)))
                if len(out) > limit:
                    return None
        return out

    def _add_new(self, spans: _Spans, start: int, end: int, content: str, kind: TextKind) -> None:
        """A text seen for the first time: remember it and plan it as what it will be."""
        text = content[start:end]
        stripped = text.strip()
        start += len(text) - len(text.lstrip())
        end = start + len(stripped)
        known = KnownText(kind, self.agent.id, self.request_id, sha256(stripped))
        seq = self.app.add_text(self.session, stripped, known)
        if seq is None:
            return
        if kind == "tool":
            self.session.tools.setdefault(self.agent.id, []).append(seq)
        elif kind == "question":
            self.session.question_seq = seq
        spans.add(_Span(start, end, "placeholder", None, known.content_hash, self.request_id, seq))

    def _span(self, match: Match, content: str) -> _Span | None:
        """The span of a match: a text of this session first, else a block of another (a
        short text, found as a whole message, only of this session)."""
        digest = sha256(content[match.start:match.end])  # a text may be found under another form than it was kept
        for ref in match.refs:
            if ref.session_id == self.session.id:
                known = self.session.texts[ref.seq]
                if known.kind == "response":
                    self.responses_read.add(ref.seq)
                return _Span(match.start, match.end, "placeholder", None, digest, known.request_id, ref.seq)
        if match.end - match.start < self.app.index.anchor_chars:
            return None
        for ref in match.refs:
            other = self.app.sessions.get(ref.session_id)
            if other is not None and (known := other.texts[ref.seq]).kind == "block":
                return _Span(match.start, match.end, "shared_block", None, digest, known.request_id)
        return None

    def _named(self, span: _Span, seq: int, horizon: int) -> _Span | None:
        """Kind and name of a span over text `seq` of this session; None when it has none."""
        if self.session.texts[seq].kind == "block":
            return span._replace(kind="shared_block")
        name = self.session.placeholder_name(seq, horizon)
        return span._replace(name=name) if name is not None else None


class _Spans:
    """The named spans of one message, by start. They never overlap (each is added only
    where none lies), so an overlap test is one bisection: only the last span starting
    before `end` can reach past `start`. A prompt of thousands of blocks stays linear."""

    def __init__(self) -> None:
        self._spans: list[_Span] = []
        self._starts: list[int] = []

    def add(self, span: _Span) -> None:
        at = bisect.bisect_left(self._starts, span.start)
        self._starts.insert(at, span.start)
        self._spans.insert(at, span)

    def overlaps(self, start: int, end: int) -> bool:
        before = bisect.bisect_left(self._starts, end) - 1
        return before >= 0 and self._spans[before].end > start

    def __iter__(self) -> Iterator[_Span]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


def _call_ids(body: dict[str, Any]) -> list[str]:
    """The tool-call ids a prompt carries: on the calls of its assistant messages, and on its tool messages."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    answered = [m["tool_call_id"] for m in messages if isinstance(m, dict) and isinstance(m.get("tool_call_id"), str)]
    return [*tool_call_ids(messages), *answered]


def _find(app: AppState, content: str) -> list[Match]:
    """The known texts in one message: long ones anywhere in it, a short one as the whole message."""
    matches = app.index.find(content)
    if not matches and (whole := app.index.find_whole(content)) is not None:
        matches = [whole]
    return matches


def _private(index: int, text: str, start: int, end: int) -> Segment:
    return Segment(message_index=index, char_start=start, char_end=end, kind="private",
                   content_hash=sha256(text[start:end]))
