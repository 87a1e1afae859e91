"""SegmentPlanner: approximate, opted-in reuse of other agents' outputs inside vLLM.

Scheduler side. Only segments whose plan names a placing method vLLM can run (`shift`,
`link`, `blend`; the gateway names one only for an app that opted into approximation)
are considered; every other request is exact and never reaches this class.

- An answer becomes reusable text when its request finishes: its token ids, keyed by
  the sha256 of its text, which is what the gateway's placeholder segments carry.
- In a later prompt, a placeholder with that hash is looked for as exactly those token
  ids (so a segment is placed only where the prompt tokenized it alike: canonical ids,
  by construction). The first prompt that holds it computes it as vLLM always would,
  and its KV is then kept (`SegmentSave`); later prompts place it (`PlacedSpan`).
- A prompt is claimed up to the end of its last placed segment when that computes
  fewer tokens than vLLM would: placed tokens must outnumber the ones in between.
  ModelBridge (worker side) fills the claim; vLLM computes the rest, always including
  the last prompt token.

Stored segments are files in the connector's segment directory, within their own
budget, least recently used evicted first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvrelay.wire.plan import SegmentPlan

PLACING_METHODS = frozenset({"shift", "link", "blend"})  # kvcomm needs its anchors: the embedded engine's
REUSABLE_KINDS = frozenset({"placeholder", "shared_block"})
MAX_TEXTS = 4096  # answers remembered as reusable text


class PlacedSpan(NamedTuple):
    start: int  # position in this prompt
    end: int
    key: bytes  # the stored segment's file name
    position: int  # where the stored segment's KV was computed
    skip: int = 0  # its leading tokens not placed (link computes them): the span is stored[skip:]

    @property
    def num_stored(self) -> int:
        return self.end - self.start + self.skip


class ReuseJob(NamedTuple):
    """Worker: fill positions [num_computed, end) of a request's blocks."""

    request_id: str
    block_ids: list[int]
    token_ids: list[int]  # the prompt's first `end` tokens
    num_computed: int  # held in the request's blocks once its loads are done
    end: int
    spans: list[PlacedSpan]
    blend_ratio: float  # 0: no blend
    check_layer: int


class SegmentSave(NamedTuple):
    """Worker: keep positions [start, end) of a request, every layer, as segment `key`."""

    key: bytes
    block_ids: list[int]
    start: int
    end: int
    request_id: str
    hold: bool = False  # a finished request whose blocks vLLM holds until the worker says it copied them
    token_ids: tuple[int, ...] = ()  # the segment's tokens: the worker checks vLLM's cache layout on them


class SegmentDelete(NamedTuple):
    key: bytes


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    @property
    def all_special_ids(self) -> list[int]: ...


@dataclass
class Placement:
    """A request's segment decisions, made once at its first lookup."""

    spans: list[PlacedSpan]  # placed, in order (empty: nothing to claim)
    harvest: list[tuple[int, int, bytes]]  # (start, end, key) to keep once vLLM has computed them
    end: int  # claim end: the last placed segment's end, else 0
    method: str


@dataclass(frozen=True)
class SegmentSettings:
    capacity_tokens: int  # the segment store's budget
    blend_ratio: float = 0.15
    check_layer: int = 1
    link_tokens: int = 8
    min_tokens: int = 4  # shorter segments are not worth a lookup


class SegmentPlanner:
    def __init__(self, tokenizer: Tokenizer, root: bytes, settings: SegmentSettings) -> None:
        self.tokenizer = tokenizer
        self.root = root
        self.settings = settings
        self._special = frozenset(tokenizer.all_special_ids)
        # (tenant, sha256 of a text) -> the token ids it may appear as in a prompt
        self._texts: OrderedDict[tuple[str, str], tuple[tuple[int, ...], ...]] = OrderedDict()
        self._stored: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (position, num tokens)
        self._num_tokens = 0

    def output_finished(self, request_id: str, tenant: str, prompt_len: int, output_ids: Sequence[int],
                        block_ids: list[int]) -> list[SegmentSave | SegmentDelete]:
        """A request of an opted-in app answered: its text may be quoted by the next agents,
        as the model wrote it or stripped (as frameworks often pass it on). Each text is
        looked for as the ids the model produced and as the text's own tokenization.

        The answer's own KV (computed by its request, every token but the last sampled
        one) is kept at once, so every agent of the next round can place it, not only
        the ones after the first that quotes it: the returned ops save it from the
        finished request's blocks (the connector holds them until the save is copied)."""
        ids = list(output_ids)
        while ids and ids[-1] in self._special:  # the stop token is not part of the text a client sees
            ids.pop()
        if len(ids) < self.settings.min_tokens:
            return []
        num_with_kv = min(len(ids), len(output_ids) - 1)  # the last sampled token was never run
        key = self._key(tenant, ids)
        ops: list[SegmentSave | SegmentDelete] = []
        if num_with_kv >= self.settings.min_tokens and key not in self._stored and block_ids:
            ops.append(SegmentSave(key, list(block_ids), prompt_len, prompt_len + num_with_kv, request_id, hold=True,
                                   token_ids=tuple(ids[:num_with_kv])))
            ops += self.saved(key, prompt_len, num_with_kv)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for variant in dict.fromkeys((text, text.strip())):
            candidates = [tuple(ids)] if variant == text else []
            candidates.append(tuple(self.tokenizer.encode(variant, add_special_tokens=False)))
            text_key = (tenant, hashlib.sha256(variant.encode()).hexdigest())
            self._texts[text_key] = tuple(dict.fromkeys(candidates))
            self._texts.move_to_end(text_key)
        while len(self._texts) > MAX_TEXTS:
            self._texts.popitem(last=False)
        return ops

    def _key(self, tenant: str, ids: Sequence[int]) -> bytes:
        return hashlib.sha256(self.root + tenant.encode() + b"\0" + _pack(ids)).digest()[:16]

    def place(self, tenant: str, token_ids: Sequence[int], plan: SegmentPlan, num_computed: int) -> Placement | None:
        """Where this prompt's reusable segments are and which can be placed, or None when
        the plan names no method vLLM can place."""
        methods = {s.method for s in plan.segments if s.kind in REUSABLE_KINDS and s.method in PLACING_METHODS}
        if not methods:
            return None
        method = sorted(methods)[0]  # the gateway names one method per request
        spans: list[PlacedSpan] = []
        harvest: list[tuple[int, int, bytes]] = []
        cursor = num_computed
        for segment in plan.segments:
            if segment.kind not in REUSABLE_KINDS or segment.method not in PLACING_METHODS:
                continue
            found = self._locate(token_ids, self._texts.get((tenant, segment.content_hash), ()), cursor)
            if found is None:
                continue
            start, ids = found
            end = start + len(ids)
            cursor = end
            key = self._key(tenant, ids)
            stored = self._stored.get(key)
            if stored is None:
                harvest.append((start, end, key))
                continue
            self._stored.move_to_end(key)
            position, num_stored = stored  # an answer kept by its own request lacks its last token
            head = min(self.settings.link_tokens, num_stored - 1) if method == "link" and start > 0 else 0
            spans.append(PlacedSpan(start + head, start + num_stored, key, position, head))
        placed = sum(s.end - s.start for s in spans)
        claim_end = spans[-1].end if spans else 0
        if spans and placed <= claim_end - num_computed - placed:
            spans, claim_end = [], 0  # more to compute around the segments than they save
        return Placement(spans, harvest, claim_end, method)

    @staticmethod
    def _locate(token_ids: Sequence[int], candidates: Sequence[tuple[int, ...]],
                cursor: int) -> tuple[int, tuple[int, ...]] | None:
        """The first candidate found at or after `cursor`, ending before the last token."""
        for ids in candidates:
            start = _find(token_ids, ids, cursor, len(token_ids) - 1)
            if start is not None:
                return start, ids
        return None

    def job(self, request_id: str, placement: Placement, token_ids: Sequence[int], block_ids: list[int],
            num_computed: int) -> ReuseJob:
        ratio = self.settings.blend_ratio if placement.method == "blend" else 0.0
        return ReuseJob(request_id, block_ids, list(token_ids[: placement.end]), num_computed, placement.end,
                        placement.spans, ratio, self.settings.check_layer)

    def saved(self, key: bytes, position: int, num_tokens: int) -> list[SegmentDelete]:
        """A SegmentSave was issued: the segment is stored (the worker writes it before any
        later job reads it: one ordered thread). Returns the deletes its room costs."""
        if key in self._stored:
            return []
        self._stored[key] = (position, num_tokens)
        self._num_tokens += num_tokens
        deletes: list[SegmentDelete] = []
        while self._num_tokens > self.settings.capacity_tokens and self._stored:
            old, (_, n) = self._stored.popitem(last=False)
            self._num_tokens -= n
            deletes.append(SegmentDelete(old))
        return deletes

    def drop(self, key: bytes) -> list[SegmentDelete]:
        """A stored segment failed to load: forget it and delete its file."""
        found = self._stored.pop(key, None)
        if found is None:
            return []
        self._num_tokens -= found[1]
        return [SegmentDelete(key)]


def _pack(ids: Sequence[int]) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in ids)


def _find(haystack: Sequence[int], needle: Sequence[int], start: int, limit: int) -> int | None:
    """The first index >= start where `needle` occurs ending at or before `limit`."""
    if not needle:
        return None
    first = needle[0]
    for i in range(start, limit - len(needle) + 1):
        if haystack[i] == first and list(haystack[i : i + len(needle)]) == list(needle):
            return i
    return None
