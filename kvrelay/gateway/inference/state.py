"""What the gateway remembers of each app: its agents, its live sessions, their texts.

Everything is per app (API key or client id), so two apps never share agents, sessions
or texts. Sessions are bounded: one idle for `session_ttl_s` or pushed out by
`max_sessions` (least recently used first) is dropped with its texts. Agents are
bounded too (`max_agents`, least recently used first, agenttable.py); the step graph
forgets an evicted agent with it, so its size follows the agents'.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, NamedTuple

from kvrelay.gateway.inference.agenttable import AgentTable
from kvrelay.gateway.inference.rounds import RoundDetector
from kvrelay.gateway.inference.stepgraph import StepGraph
from kvrelay.gateway.inference.template import OpeningTemplates
from kvrelay.gateway.inference.session_ids import SessionStarts
from kvrelay.gateway.inference.textindex import TextIndex

TextKind = Literal["response", "tool", "question", "block"]
MAX_INNER_KEPT = 64  # short texts a session keeps to look for inside its prompts (segments.py)


class TextRef(NamedTuple):
    session_id: str
    seq: int  # the text's number within its session


@dataclass(frozen=True)
class KnownText:
    kind: TextKind
    agent_id: str | None  # who produced it (response) or received it (tool)
    request_id: str  # the request that produced or first carried it
    content_hash: str


@dataclass
class SessionState:
    id: str
    last_seen: float
    texts: dict[int, KnownText] = field(default_factory=dict)
    responses: dict[str, list[int]] = field(default_factory=dict)  # agent -> its responses' seqs, oldest first
    tools: dict[str, list[int]] = field(default_factory=dict)  # agent -> tool results' seqs
    question_seq: int | None = None
    num_requests: int = 0
    last_agent: str | None = None  # the agent of the latest request
    read_by: dict[str, set[int]] = field(default_factory=dict)  # agent -> response seqs its prompts quoted
    question_tried: set[str] = field(default_factory=set)  # agents whose template was compared with the question
    call_ids: list[str] = field(default_factory=list)  # ids of the tool calls its answers made
    inner: list[int] = field(default_factory=list)  # seqs of its texts shorter than the index's anchor, newest last
    first_seen: float = field(default_factory=time.time)  # wall clock, for the records
    num_saved_texts: int = 0  # texts 0 .. n-1 are in SQL (seqs are dense: a text is only numbered once kept)
    members: set[str] = field(default_factory=set)  # agents that have sent a request of it
    used: int = 0  # when it was last used, as the app's use counter: its place in the app's LRU order
    rounds: RoundDetector = field(init=False)

    def __post_init__(self) -> None:
        self.rounds = RoundDetector(self.id)

    def next_seq(self) -> int:
        return len(self.texts)

    @property
    def first_seen_at(self) -> datetime:
        return datetime.fromtimestamp(self.first_seen, UTC)

    @property
    def last_seen_at(self) -> datetime:
        """`last_seen` (monotonic, for the TTL) on the wall clock, for SQL and the admin API."""
        return datetime.fromtimestamp(time.time() - (time.monotonic() - self.last_seen), UTC)

    def has_asked(self, agent_id: str) -> bool:
        """Whether this agent has sent a request of the session."""
        return agent_id in self.members

    def placeholder_name(self, seq: int, horizon: int | None = None) -> str | None:
        """The KVCOMM name of text `seq` (None for a block), counting back from text
        `horizon` (default: the newest): `agent_<id>_history_<k>` is k outputs older."""
        known = self.texts[seq]
        if known.kind == "question":
            return "user_question"
        if known.kind == "block":
            return None
        series = (self.responses if known.kind == "response" else self.tools).get(known.agent_id or "", [])
        at = bisect.bisect_left(series, seq)  # a series is in seq order: bisections, not scans
        if at == len(series) or series[at] != seq:
            return None
        horizon = self.next_seq() if horizon is None else horizon
        back = max(0, bisect.bisect_right(series, horizon) - at - 1)  # outputs in (seq, horizon]
        stem = "agent" if known.kind == "response" else "condition"
        return f"{stem}_{known.agent_id}_{'current' if back == 0 else f'history_{back}'}"


@dataclass
class Changes:
    """What changed since the last save to SQL: keys only, the rows are built when saved,
    so a session touched by ten requests between two saves is written once."""

    sessions: set[tuple[str, str]] = field(default_factory=set)  # (app, session)
    agents: set[tuple[str, str]] = field(default_factory=set)  # (app, agent): its prefix and step-graph node
    merged: set[tuple[str, str]] = field(default_factory=set)  # (app, session) merged into another: its rows go

    def take(self) -> Changes:
        taken = Changes(self.sessions, self.agents, self.merged)
        self.sessions, self.agents, self.merged = set(), set(), set()
        return taken

    def merge(self, other: Changes) -> None:
        self.sessions |= other.sessions
        self.agents |= other.agents
        self.merged |= other.merged

    def __bool__(self) -> bool:
        return bool(self.sessions or self.agents or self.merged)


class AppState:
    def __init__(self, anchor_chars: int, session_ttl_s: float, max_sessions: int,
                 max_texts_per_session: int = 4096, bounded: Counter[str] | None = None,
                 max_agents: int = 1000, same_agent_ratio: float = 0.9, max_step_sources: int = 64) -> None:
        self.bounded: Counter[str] = bounded if bounded is not None else Counter()  # what a bound cut, by kind
        self.graph = StepGraph(max_step_sources, self.bounded)
        self.agents = AgentTable(max_agents, same_agent_ratio, self.graph.remove, self.bounded)
        self.openings = OpeningTemplates()
        self.index: TextIndex[TextRef] = TextIndex(anchor_chars, group=_session_of, bounded=self.bounded)
        self.starts = SessionStarts(max_sessions)  # the last session each ask started (session_ids.py)
        self.sessions: OrderedDict[str, SessionState] = OrderedDict()
        self._calls: dict[str, str] = {}  # tool-call id -> the session whose answer made the call
        self._uses = itertools.count(1)  # stamps SessionState.used, so recency needs no walk of the sessions
        self._ttl_s = session_ttl_s
        self._max_sessions = max_sessions
        self._max_texts = max_texts_per_session

    def session(self, session_id: str, now: float | None = None) -> SessionState:
        """The live session (created if new), marked as just used."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        state = self.sessions.get(session_id)
        if state is None:
            state = self.sessions[session_id] = SessionState(session_id, now)
            self._trim()
        self.sessions.move_to_end(session_id)
        state.last_seen, state.used = now, next(self._uses)
        return state

    def adopt(self, session: SessionState) -> None:
        """Take in a session rebuilt from SQL, with its texts, as the most recently used."""
        if session.id in self.sessions:
            self._drop(session.id)
        self.sessions[session.id] = session
        session.used = next(self._uses)
        for call_id in session.call_ids:
            self._calls.setdefault(call_id, session.id)
        self._trim()

    def add_text(self, session: SessionState, text: str, known: KnownText, forms: tuple[str, ...] = ()) -> int | None:
        """Remember a text of the session (and other forms it may be quoted in); its seq,
        or None when it is empty or the session keeps no more texts."""
        if len(session.texts) >= self._max_texts:
            self.bounded["texts_not_kept"] += 1  # the session's later texts are simply not reused
            return None
        seq = session.next_seq()
        if not self.index.add(text, TextRef(session.id, seq), forms):
            return None
        if len(text.strip()) < self.index.anchor_chars:
            session.inner = [*session.inner[-MAX_INNER_KEPT + 1:], seq]
        session.texts[seq] = known
        return seq

    def add_call(self, session: SessionState, call_id: str) -> None:
        """A tool call one of the session's answers made (ids are unique per answer)."""
        if len(session.call_ids) >= self._max_texts or call_id in self._calls:
            return
        session.call_ids.append(call_id)
        self._calls[call_id] = session.id

    def session_of_calls(self, call_ids: list[str]) -> str | None:
        """The live session whose answers made the first of these tool calls it knows."""
        return next((self._calls[c] for c in call_ids if c in self._calls), None)

    def merge(self, into: SessionState, other: SessionState) -> None:
        """Take `other`'s texts, agents and tool calls into `into` and drop `other`: a
        prompt of `into` quoted `other`'s outputs, so they are one workflow (agents that
        each kept a conversation of their own until they read each other). `other`'s
        texts are numbered after `into`'s, in their order; its rounds are not kept."""
        renumbered: dict[int, int] = {}
        for seq in sorted(other.texts):
            ref = TextRef(other.id, seq)
            forms = self.index.forms_of(ref)
            if forms and (new := self.add_text(into, forms[0], other.texts[seq], forms[1:])) is not None:
                renumbered[seq] = new
        for mine, theirs in ((into.responses, other.responses), (into.tools, other.tools)):
            for agent, seqs in theirs.items():
                mine.setdefault(agent, []).extend(renumbered[s] for s in seqs if s in renumbered)
        for agent, read in other.read_by.items():
            into.read_by.setdefault(agent, set()).update(renumbered[s] for s in read if s in renumbered)
        into.members |= other.members
        into.num_requests += other.num_requests
        into.first_seen = min(into.first_seen, other.first_seen)
        calls = other.call_ids
        self._drop(other.id)
        for call_id in calls:
            self.add_call(into, call_id)

    def replace_text(self, session: SessionState, seq: int, text: str, known: KnownText) -> None:
        """Narrow a known text (the question, to the part agents share); saved again."""
        ref = TextRef(session.id, seq)
        self.index.remove(ref)
        self.index.add(text, ref)
        session.texts[seq] = known
        session.num_saved_texts = min(session.num_saved_texts, seq)

    def expire(self, now: float) -> None:
        while self.sessions:
            oldest = next(iter(self.sessions.values()))
            if now - oldest.last_seen < self._ttl_s:
                break
            self._drop(oldest.id)

    def _trim(self) -> None:
        while len(self.sessions) > self._max_sessions:
            self._drop(next(iter(self.sessions)))  # least recently used first
            self.bounded["sessions_evicted"] += 1

    def _drop(self, session_id: str) -> None:
        session = self.sessions.pop(session_id)
        for seq in session.texts:
            self.index.remove(TextRef(session_id, seq))
        for call_id in session.call_ids:
            self._calls.pop(call_id, None)


def _session_of(ref: TextRef) -> str:
    return ref.session_id
