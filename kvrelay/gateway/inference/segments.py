"""SegmentBuilder: one prompt cut into the segments of its plan.

Each message is searched for what the session knows (earlier outputs, tool results, the
question, delimited blocks); what is found becomes a named placeholder, what is new is
remembered so later prompts find it, and the gaps become private segments.

Equal texts: agents of one session often give the same answer word for word. A text
quoted k times in one prompt reads the k newest of the equal outputs, in the order
they were produced (`settle`): a prompt that quotes three equal answers read three, and
one that quotes an answer once read the latest. Which agent's output a prompt read is
what the step graph and the round detector learn from.

Short texts (under the index's anchor) are found inside a message only among the
session's own texts of at least INNER_MIN_CHARS, as whole words (the newest the session
keeps, state.MAX_INNER_KEPT); shorter ones only as a whole message (textindex.py).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from typing import NamedTuple

from kvrelay.wire.plan import Segment, SegmentKind
from kvrelay.gateway.inference.agenttable import AgentState
from kvrelay.gateway.inference.blocks import split_blocks
from kvrelay.gateway.inference.budget import Deadline
from kvrelay.gateway.inference.messages import PromptMessage, sha256
from kvrelay.gateway.inference.question import common_core
from kvrelay.gateway.inference.state import AppState, KnownText, SessionState, TextKind, TextRef
from kvrelay.gateway.inference.textindex import Holders, Match

MAX_NAME_CHARS = 128
INNER_MIN_CHARS = 16  # a shorter text recurs by chance inside longer ones
MAX_INNER_PLACES = 8  # places one short text is looked for in one message


class Span(NamedTuple):
    """A named part of one message, before the gaps are filled with private segments."""

    start: int
    end: int
    kind: SegmentKind
    name: str | None
    content_hash: str
    source_request: str | None
    seq: int | None = None  # a text of this session: named once the whole prompt is read
    equal: tuple[int, ...] = ()  # equal texts of this session it may be (settled once the prompt is read)
    message_name: str | None = None  # the `name` of a message this span is the whole of


class SegmentBuilder:
    """Collects the named spans of each message, then fills the gaps with private ones."""

    def __init__(self, app: AppState, session: SessionState, agent: AgentState, request_id: str,
                 deadline: Deadline) -> None:
        self.app, self.session, self.agent, self.request_id = app, session, agent, request_id
        self.deadline = deadline
        self._spans: dict[int, Spans] = {}
        self._texts: dict[int, str] = {}
        self.responses_read: set[int] = set()  # seqs of this session's responses found in the prompt (see settle)
        self.renamed: set[str] = set()  # agents that got a name from this prompt
        self._inner: dict[str, list[int]] = {}  # the session's short texts by text, built once per prompt ...
        self._inner_of: int | None = None  # ... for the session's newest short text then (a new one rebuilds it)

    def add_message(self, message: PromptMessage, matches: list[Match[TextRef]], fixed_chars: int,
                    separators: list[str]) -> None:
        content = message.content or ""
        self._texts[message.index] = content
        spans = self._spans.setdefault(message.index, Spans())
        if fixed_chars:
            spans.add(Span(0, fixed_chars, "fixed_prefix", self.agent.id, sha256(content[:fixed_chars]), None))
        whole = content.strip()
        for match in matches:
            name = message.name if content[match.start:match.end].strip() == whole else None
            if match.start >= fixed_chars and (span := self._span(match, content, name)) is not None:
                spans.add(span)
        self._add_inner(spans, content, fixed_chars)
        if message.role == "tool" and not len(spans):  # a tool result this session has not seen yet
            self._add_new(spans, 0, len(content), content, "tool")
        for block in split_blocks(content, tuple(separators)):
            if self.deadline.expired():
                break  # thousands of blocks cost microseconds each: the rest stay private this time
            if block.start >= fixed_chars and not spans.overlaps(block.start, block.end):
                self._add_new(spans, block.start, block.end, content, "block")

    def add_question(self, messages: list[PromptMessage], anchor_chars: int) -> None:
        """The first request of a session brings the shared user question (inside the
        app's wording, once a second session shows it); a later agent that wraps it in
        its own template narrows it to the text they share."""
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
                self._add_new(self._spans.setdefault(asks[-1].index, Spans()), *question.span, content, "question")
                if question.earlier is not None:
                    self._narrow_earlier(*question.earlier)
            return
        seq = session.question_seq
        if self.agent.id in session.question_tried or any(
                span.seq == seq for spans in self._spans.values() for span in spans):
            return
        session.question_tried.add(self.agent.id)
        message = asks[0]
        question_text = self.app.index.text_of(TextRef(session.id, seq)) or ""
        core = common_core(question_text, message.content or "", anchor_chars)
        spans = self._spans.setdefault(message.index, Spans())
        if core is None or spans.overlaps(core.message_start, core.message_start + core.end - core.start):
            return
        text = question_text[core.start:core.end]
        known = dataclasses.replace(session.texts[seq], content_hash=sha256(text))
        self.app.replace_text(session, seq, text, known)
        start = core.message_start
        spans.add(Span(start, start + len(text), "placeholder", None, known.content_hash, known.request_id, seq))

    def settle(self) -> None:
        """Decide which of several equal texts each quote read (see the module's
        docstring), then what the prompt read: its outputs, and the names it gives them."""
        places: dict[tuple[int, ...], list[tuple[Spans, int]]] = defaultdict(list)
        for index in sorted(self._spans):
            spans = self._spans[index]
            for at, span in enumerate(spans):
                if span.equal:
                    places[span.equal].append((spans, at))
        for equal, quoted in places.items():
            # k quotes read the k newest; more quotes than texts read the newest again
            newest = equal[-len(quoted):] + (equal[-1],) * max(0, len(quoted) - len(equal))
            for (spans, at), seq in zip(quoted, newest):
                spans.replace(at, spans[at]._replace(seq=seq, source_request=self.session.texts[seq].request_id))
        for spans in self._spans.values():
            for span in spans:
                if span.seq is None:
                    continue
                known = self.session.texts[span.seq]
                if known.kind == "response":
                    self.responses_read.add(span.seq)
                    if span.message_name:
                        self._name(known.agent_id, span.message_name)

    def outputs_in_order(self) -> list[int]:
        """The session's outputs this prompt reads, in the order it reads them."""
        return [span.seq for index in sorted(self._spans) for span in self._spans[index]
                if span.seq is not None and span.seq in self.responses_read]

    def segments(self, limit: int) -> list[Segment] | None:
        """Every message cut into segments; None past `limit` segments (such a plan is not
        sent, so the rest is not built). A quoted text is named relative to the newest
        text of the session this prompt holds, not to the newest text there is: every
        agent of an All-Gather round names the previous round's outputs alike, even when
        some agents of the round have already answered."""
        horizon = max((span.seq for spans in self._spans.values() for span in spans
                       if span.seq is not None and self.session.texts[span.seq].kind != "block"), default=-1)
        out: list[Segment] = []
        span: Span | None  # None once _named finds no name for it
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
                                   kind=span.kind, name=span.name, content_hash=span.content_hash,
                                   source_request=span.source_request))
                cursor = span.end
                if len(out) > limit:
                    return None
            if cursor < len(text):
                out.append(_private(index, text, cursor, len(text)))
                if len(out) > limit:
                    return None
        return out

    # -- inside -------------------------------------------------------------------------
    def _span(self, match: Match[TextRef], content: str, message_name: str | None) -> Span | None:
        """The span of a match: a text of this session first, else a block of another (a
        short text, found as a whole message, only of this session)."""
        digest = sha256(content[match.start:match.end])  # a text may be found under another form than it was kept
        own = tuple(sorted(ref.seq for ref in match.refs.of(self.session.id)))
        if own:
            known = self.session.texts[own[-1]]
            return Span(match.start, match.end, "placeholder", None, digest, known.request_id, own[-1],
                        own if len(own) > 1 else (), message_name)
        if match.end - match.start < self.app.index.anchor_chars:
            return None
        for ref in match.refs:
            other = self.app.sessions.get(ref.session_id)
            if other is not None and (known := other.texts[ref.seq]).kind == "block":
                return Span(match.start, match.end, "shared_block", None, digest, known.request_id)
        return None

    def _add_inner(self, spans: Spans, content: str, fixed_chars: int) -> None:
        """The session's short texts inside this message, as whole words."""
        newest = self.session.inner[-1] if self.session.inner else None
        if newest != self._inner_of:  # seqs only grow: a changed newest is a new short text
            self._inner, self._inner_of = defaultdict(list), newest
            for seq in self.session.inner:
                if (text := self.app.index.text_of(TextRef(self.session.id, seq))) and len(text) >= INNER_MIN_CHARS:
                    self._inner[text].append(seq)
        for text, seqs in self._inner.items():
            at = content.find(text, fixed_chars)
            for _ in range(MAX_INNER_PLACES):
                if at < 0:
                    break
                end = at + len(text)
                if not (at and content[at - 1].isalnum()) and not (end < len(content) and content[end].isalnum()) \
                        and not spans.overlaps(at, end):
                    match = Match(at, end, Holders({self.session.id: tuple(TextRef(self.session.id, s) for s in seqs)}))
                    if (span := self._span(match, content, None)) is not None:
                        spans.add(span)
                at = content.find(text, end)

    def _add_new(self, spans: Spans, start: int, end: int, content: str, kind: TextKind) -> None:
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
        spans.add(Span(start, end, "placeholder", None, known.content_hash, self.request_id, seq))

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

    def _name(self, agent_id: str | None, name: str) -> None:
        """An output that is a whole message under a `name` gives its agent that name."""
        agent = self.app.agents.get(agent_id or "")
        if agent is not None and agent.name != name[:MAX_NAME_CHARS]:
            agent.name = name[:MAX_NAME_CHARS]
            self.renamed.add(agent.id)

    def _named(self, span: Span, seq: int, horizon: int) -> Span | None:
        """Kind and name of a span over text `seq` of this session; None when it has none."""
        if self.session.texts[seq].kind == "block":
            return span._replace(kind="shared_block")
        name = self.session.placeholder_name(seq, horizon)
        return span._replace(name=name) if name is not None else None


class Spans:
    """The named spans of one message, by start. They never overlap (each is added only
    where none lies), so an overlap test is one bisection: only the last span starting
    before `end` can reach past `start`. A prompt of thousands of blocks stays linear."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._starts: list[int] = []

    def add(self, span: Span) -> None:
        at = bisect.bisect_left(self._starts, span.start)
        self._starts.insert(at, span.start)
        self._spans.insert(at, span)

    def replace(self, at: int, span: Span) -> None:
        """Put `span` in place of the one at position `at` (same start and end)."""
        self._spans[at] = span

    def overlaps(self, start: int, end: int) -> bool:
        before = bisect.bisect_left(self._starts, end) - 1
        return before >= 0 and self._spans[before].end > start

    def __getitem__(self, at: int) -> Span:
        return self._spans[at]

    def __iter__(self) -> Iterator[Span]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


def _private(index: int, text: str, start: int, end: int) -> Segment:
    return Segment(message_index=index, char_start=start, char_end=end, kind="private",
                   content_hash=sha256(text[start:end]))
