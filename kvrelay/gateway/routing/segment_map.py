"""SegmentMap: which replica holds the KV an opted-in request would place.

A request opted into an approximate method (KVCOMM, blend, ...) places other texts' KV:
an earlier agent's answer, a document every agent reads. The engine places only KV it
holds itself, and the prefix blocks the CacheMap tracks say nothing about it: those
texts sit after each agent's own system message. Sent to a replica without them, the
request computes them again, densely (bench cluster, long family: most of a board's
prompts are such texts).

A replica holds a text's KV when it computed it: it served the request the text came
from (that request's answer, kept for later reuse because it opted in), or it served
an opted-in request whose prompt held the text (the engine keeps its segments). Both
are recorded when the gateway routes a request. Engines do not report these texts, so
both tables are bounded to the most recent `max_entries`; an entry the engine evicted
meanwhile costs a misroute, never an answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple, TypeVar

from kvrelay.gateway.approximation import APPROX_METHODS
from kvrelay.gateway.routing.cache_map import CHARS_PER_TOKEN
from kvrelay.wire.plan import Segment

# The kinds an engine places from another request's KV; a fixed prefix is a prefix
# hit (the CacheMap counts it), a private segment is the request's own text.
PLACED_KINDS = frozenset({"placeholder", "shared_block"})
APPROXIMATE = frozenset(APPROX_METHODS)  # the methods that place KV computed elsewhere
V = TypeVar("V")


class PlacedText(NamedTuple):
    content_hash: str
    source_request: str | None
    tokens: int  # estimated without a tokenizer


def places(segment: Segment) -> bool:
    """Whether the engine would place this segment's KV from elsewhere rather than compute it."""
    return segment.kind in PLACED_KINDS and segment.method in APPROXIMATE


def placed_texts(segments: Iterable[Segment]) -> tuple[PlacedText, ...]:
    """The segments of a plan whose KV the engine would place rather than compute."""
    return tuple(PlacedText(s.content_hash, s.source_request, max((s.char_end - s.char_start) // CHARS_PER_TOKEN, 1))
                 for s in segments if places(s))


class SegmentMap:
    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._requests: OrderedDict[str, str] = OrderedDict()  # request id -> the replica that served it
        self._texts: OrderedDict[str, set[str]] = OrderedDict()  # content hash -> replicas that computed it

    def routed(self, url: str, request_id: str | None, texts: Iterable[PlacedText]) -> None:
        """A request went to `url`: its answer, and the texts its prompt held, will be there."""
        if request_id is not None:
            _touch(self._requests, request_id, url, self.max_entries)
        for text in texts:
            holders = self._texts.get(text.content_hash)
            if holders is None:
                holders = set()
            holders.add(url)
            _touch(self._texts, text.content_hash, holders, self.max_entries)

    def held_tokens(self, url: str, texts: Iterable[PlacedText]) -> int:
        """Tokens of these texts whose KV the replica at `url` is believed to hold."""
        return sum(t.tokens for t in texts if self._holds(url, t))

    def _holds(self, url: str, text: PlacedText) -> bool:
        if url in self._texts.get(text.content_hash, ()):
            return True
        return text.source_request is not None and self._requests.get(text.source_request) == url


def _touch(table: OrderedDict[str, V], key: str, value: V, bound: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > bound:
        table.popitem(last=False)
