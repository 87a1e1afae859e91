"""Which live session a request without a session id continues, from what its prompt quotes.

The session whose answers and tool results cover most of the prompt, if any. Of those
that cover as much, the most recently used: a repeated run of a task produces the same
texts again, and its next prompt continues the new run, not the old one. The question
counts only between sessions that share none of their outputs with the prompt. Short
texts (found only as whole messages) recur by chance and link nothing.

A session is continued when the prompt holds its outputs, or anything after its
question. One that this agent has already asked, and of which the prompt holds only the
question as its last message, is started over: that is a new run of the same task (a
second agent asking the same question is the same run: a round's next member).

Tool-call ids are stronger than any text: they are unique per answer, so a prompt that
carries the id of a call one of a session's answers made continues that session.

A prompt that continues one session and also quotes the outputs of others joins them
(`sessions_to_merge`): agents that each kept a conversation of their own (an All-Gather
app whose first round shares no text) are one workflow once they read each other. Only
outputs found nowhere in the continued session count (not the question, which an answer
may repeat), only into a session that already had requests, and only sessions none of
whose agents has asked in it: a new run of a task whose answers repeat an old run's is
not merged with it.
"""

from __future__ import annotations

from collections import Counter

from kvrelay.gateway.inference.state import AppState, TextKind, TextRef
from kvrelay.gateway.inference.textindex import Match

_LINKING_KINDS: frozenset[TextKind] = frozenset({"response", "tool", "question"})


def find_texts(app: AppState, content: str) -> list[Match[TextRef]]:
    """The known texts in one message: long ones anywhere in it, a short one as the whole message."""
    matches = app.index.find(content)
    if not matches and (whole := app.index.find_whole(content)) is not None:
        matches = [whole]
    return matches


def linked_session(app: AppState, found: dict[int, list[Match[TextRef]]], agent_id: str,
                   last_message: int) -> str | None:
    """The session a prompt continues, by the texts `found` in each message (by index)."""
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
    for session_id in sorted(chars | asked, reverse=True,
                             key=lambda s: (chars[s], bool(chars[s]) or asked[s], app.sessions[s].used)):
        if session_id in continued or not app.sessions[session_id].has_asked(agent_id):
            return session_id
    return None


def sessions_to_merge(app: AppState, found: dict[int, list[Match[TextRef]]], session_id: str) -> list[str]:
    """The other live sessions whose outputs this prompt of `session_id` quotes (see above)."""
    session = app.sessions[session_id]
    if not session.num_requests:
        return []  # a session this prompt starts: it continues none, so it joins none
    others: list[str] = []
    for matches in found.values():
        for match in matches:
            if match.end - match.start < app.index.anchor_chars or match.refs.of(session_id):
                continue
            kinds: dict[str, set[str]] = {}
            for ref in match.refs:
                if (other := app.sessions.get(ref.session_id)) is not None:
                    kinds.setdefault(ref.session_id, set()).add(other.texts[ref.seq].kind)
            for other_id, found_kinds in kinds.items():  # an answer that repeats its session's question is the question
                if found_kinds == {"response"} and other_id not in others \
                        and not app.sessions[other_id].members & session.members:
                    others.append(other_id)
    return others
