"""KVCollector: finds the requests of one All-Gather round that can be prefilled together.

The gateway names each request's round in its plan (round id, expected size). The
scheduler asks the collector, when it admits a round's request, which waiting requests
of the same round may join it; once they are admitted (their segments assembled), the
collector keeps the compatible ones as a group. Compatible means: a request of a round,
on its first prefill, whose placed segments all use blend (the recovery collective
reuse drives). The probe, over whose prompt the deviation pass runs, is the member with
the most placed tokens; in an All-Gather where each agent reads the others' outputs
but not its own, the probe lacks its own output, and CollectivePrefill runs one more
pass over a member that holds it (a few passes per round, not one per member).
Anything else runs on the single-request path.

Grouping adds no waiting by default: only requests already waiting together join.
With `window_ms` > 0, a round's first waiting request is held (and the queue behind it)
until the round's expected size is waiting or the window has passed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine_ext.config import CollectiveConfig
from engine_ext.reuse.methods import METHODS
from engine_ext.sequence import Sequence
from kvrelay.wire.plan import RoundInfo


MAX_FORMED_ROUNDS = 256


@dataclass
class CollectiveGroup:
    """Requests of one round prefilled together; members[0] is the probe."""

    round_id: str
    members: list[Sequence]


def _round_of(seq: Sequence) -> RoundInfo | None:
    """The All-Gather round the sequence's plan puts it in, if any."""
    return seq.scope.round if seq.scope is not None else None


def round_id(seq: Sequence) -> str | None:
    info = _round_of(seq)
    return info.id if info is not None else None


def group_key(seq: Sequence) -> str | None:
    """What a sequence is grouped by: its round, within its tenant (two tenants' rounds
    never prefill together, even under the same id)."""
    rid = round_id(seq)
    return None if rid is None else f"{seq.tenant}\x00{rid}"


class KVCollector:
    def __init__(self, config: CollectiveConfig) -> None:
        self.config = config
        self.num_groups = 0
        self.num_grouped = 0  # requests prefilled collectively
        self._formed: OrderedDict[str, None] = OrderedDict()  # recent rounds that ran: their late members never wait

    def holds(self, seq: Sequence, waiting: Iterable[Sequence], now: float | None = None) -> bool:
        """Whether the round's first waiting request should wait for its siblings a little longer."""
        info, rid = _round_of(seq), group_key(seq)  # rid is None exactly when info is
        # A request without segments (a multi-LoRA adapter's) never joins a group: no waiting.
        if info is None or self.config.window_ms <= 0 or seq.num_preemptions or not seq.segments \
                or rid in self._formed:
            return False
        now = time.monotonic() if now is None else now
        if (now - seq.arrival_time) * 1e3 >= self.config.window_ms:
            return False
        num_waiting = sum(1 for s in waiting if group_key(s) == rid)
        return num_waiting < info.size

    def siblings(self, seq: Sequence, waiting: Iterable[Sequence]) -> list[Sequence]:
        """Waiting requests of seq's round, in arrival order, at most max_group - 1."""
        rid = group_key(seq)
        if rid is None:
            return []
        same = [s for s in waiting if s is not seq and group_key(s) == rid and s.num_preemptions == 0]
        return same[: self.config.max_group - 1]

    def form(self, admitted: list[Sequence]) -> CollectiveGroup | None:
        """Group the compatible admitted requests of a round (probe first); None if none is.
        A request alone is a group too: it reuses its round's selection if one was made
        (TokenDance's late arrival), and its cache joins the round's in the DiffStore."""
        candidates = [s for s in admitted if _collectible(s)]
        if not candidates:
            return None
        probe = max(candidates, key=_num_placed_tokens)
        key = group_key(probe)
        members = [probe] + [s for s in candidates if s is not probe and group_key(s) == key]
        group = CollectiveGroup(round_id(probe) or "", members)
        for s in members:
            s.group = group
        self._formed[key or ""] = None
        while len(self._formed) > MAX_FORMED_ROUNDS:
            self._formed.popitem(last=False)
        self.num_groups += 1
        self.num_grouped += len(members)
        return group


def _num_placed_tokens(seq: Sequence) -> int:
    """How many tokens its placed segments cover (the probe is the member with the most)."""
    return sum(p.segment.num_tokens for p in seq.assembly.placed) if seq.assembly is not None else 0


def _collectible(seq: Sequence) -> bool:
    a = seq.assembly
    return (round_id(seq) is not None and a is not None and bool(a.placed) and not a.decisions and not a.measurements
            and seq.reuse_outcomes is None and all(METHODS[p.method].blends and p.num_linked == 0 for p in a.placed))
