"""The id of a session a request starts.

One gateway mints a random id. Gateway replicas cannot: the agents of an app's first
round often send their first prompts at the same moment, each to another replica,
before any replica has the others' plans in its log, and each would start a session of
its own (measured: 0.02-0.04 of session Rand lost on the long-context traffic). So
replicas derive it from what they all know alike:

    id = hash(app, what the prompt asks, the last session started by the same ask, the minute)

"What the prompt asks" is its messages other than system or developer ones (the
agents' personas differ; the question their first prompts carry is the same). The last
session started by the same ask tells a new run of a task from its first: replicas
that have both read the log up to it agree on it. The minute (wall clock, which
replicas keep in sync) keeps an id from coming back after a restart, when the table of
starts is empty again: a session started by the same ask in another minute has another
id. Prompts that start two runs of one task in the same minute from the same state are
one run, as on one gateway a second agent asking the same question joins the first's
session.
"""

from __future__ import annotations

import hashlib
import time
import os
from collections import OrderedDict

from kvrelay.gateway.inference.messages import PromptMessage

WINDOW_S = 60.0  # the part of the wall clock an agreed id depends on
MAX_STARTS = 10_000  # asks remembered per app, least recently used out


class SessionStarts:
    """Per app: the last session each ask started (an ask is a digest of the prompt's
    non-system messages)."""

    def __init__(self, max_asks: int = MAX_STARTS) -> None:
        self._last: OrderedDict[str, str] = OrderedDict()
        self._max_asks = max_asks

    def last(self, ask: str) -> str | None:
        return self._last.get(ask)

    def started(self, ask: str, session_id: str) -> None:
        self._last[ask] = session_id
        self._last.move_to_end(ask)
        while len(self._last) > self._max_asks:
            self._last.popitem(last=False)


def ask_of(messages: list[PromptMessage]) -> str:
    """The digest of what a prompt asks: its messages but system and developer ones."""
    digest = hashlib.sha256()
    for m in messages:
        if m.role not in ("system", "developer"):
            digest.update(f"{m.role}\0{m.name or ''}\0{m.content or ''}\0".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def new_session_id(agreed: bool, app_id: str, ask: str, starts: SessionStarts, now: float | None = None) -> str:
    """A random id, or (`agreed`, for replicas) the one every replica derives alike."""
    if not agreed:
        return f"sess-{os.urandom(8).hex()}"  # as random as uuid4, at a fifth of its cost
    minute = int((time.time() if now is None else now) // WINDOW_S)
    seed = f"{app_id}\0{ask}\0{starts.last(ask) or ''}\0{minute}"
    return "sess-" + hashlib.sha256(seed.encode("utf-8", "surrogatepass")).hexdigest()[:16]
