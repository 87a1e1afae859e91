"""Anchors and their pools: what KVCOMM has measured about a placeholder's samples.

An anchor is one sample of a placeholder (one chunk of a user question or of an
agent's answer: long texts are cut into chunks, bank.py) that was computed densely in the prompts of the agents that read it. It keeps the
sample's base KV (the segment index's entry, canonical frame) and, per agent, how far
the real KV in that agent's prompt was from the base: the placeholder offset, and the
offset of the fixed segment that followed the placeholder there. Offsets are stored in
the canonical frame too (keys rotated back to position 0), so they apply wherever the
placeholder lands next time.

A pool holds the anchors of one chunk position of one placeholder name of one app,
shared by every session of that app: a recurring workflow learns once.

An offset is exact only against the KV it was measured from. The segment index may
evict an entry and register the same tokens again with other KV (computed behind
another prefix, or approximately), so an anchor records the identity (content and
version, kv/segment_index.py) of the entry its base was copied from, and each prefix
offset that of the fixed segment's entry it was measured against. The bank adds an
offset to the index's KV only where the identities are equal (bank.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine_ext.kv.blobs import Blob
from engine_ext.kv.segment_index import EntryIdentity


class SampleIdentity(NamedTuple):
    """Which KV a sample's base is: a chunk of one version of an index entry. A long
    placeholder is decided chunk by chunk (bank.py), each chunk a sample of its own."""

    entry: EntryIdentity
    offset: int  # the chunk's first token within the entry


@dataclass
class AgentOffsets:
    placeholder: Blob  # (n tokens) real - base, keys compared in the canonical frame
    prefix_token_ids: tuple[int, ...] | None = None  # the fixed segment after the placeholder
    prefix: Blob | None = None  # its real - base, likewise
    # The fixed segment's index entry `prefix` was measured against: the offset is added
    # to that entry only (None: no prefix offset, or measured against no known entry).
    prefix_base: EntryIdentity | None = None

    def prefix_for(self, token_ids: tuple[int, ...], entry: EntryIdentity | None) -> bool | None:
        """Whether the prefix offset applies to the fixed segment `token_ids` whose index
        entry is now `entry`: True (same text, measured against that very entry), False
        (same text, another version of it: stale, never applied), None (no offset for
        that text, or no entry to apply it to)."""
        if self.prefix is None or self.prefix_token_ids != token_ids or entry is None:
            return None
        return self.prefix_base == entry

    def blobs(self) -> list[Blob]:
        return [self.placeholder] + ([self.prefix] if self.prefix is not None else [])


@dataclass
class Anchor:
    anchor_id: int  # creation order within the engine
    token_ids: tuple[int, ...]
    base: Blob  # the sample's base KV when it became an anchor
    offsets: dict[str, AgentOffsets] = field(default_factory=dict)  # agent id -> offsets
    num_activations: int = 0  # predictions it took part in
    # The index entry `base` was copied from. `base` is the anchor's own copy, so its
    # offsets stay consistent with it for predicting other samples whatever the index
    # holds later; but they are added to the index's KV for these very tokens only while
    # the index holds this version (None: from no known entry, never).
    base_identity: SampleIdentity | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def blobs(self) -> list[Blob]:
        return [self.base] + [b for o in self.offsets.values() for b in o.blobs()]

    def serves(self, agent_id: str, num_tokens: int) -> bool:
        """Eligible for a sample of `num_tokens` read by this agent: at least as long,
        with this agent's offsets measured."""
        return self.num_tokens >= num_tokens and agent_id in self.offsets

    def exact_for(self, sample: SampleIdentity) -> bool:
        """Whether its offsets were measured against this very chunk of this very entry
        (content and version), so adding them to it reproduces the measured KV."""
        return self.base_identity == sample


class AnchorPool:
    """At most `max_anchors` anchors, oldest first. A new anchor beyond the limit evicts
    the least activated of the `prune_window` oldest: old anchors that keep being used
    stay, and a burst of one-off samples cannot flush the pool."""

    def __init__(self, max_anchors: int, prune_window: int) -> None:
        self.max_anchors = max_anchors
        self.prune_window = prune_window
        self.anchors: list[Anchor] = []

    def __len__(self) -> int:
        return len(self.anchors)

    def find(self, token_ids: tuple[int, ...]) -> Anchor | None:
        return next((a for a in self.anchors if a.token_ids == token_ids), None)

    def eligible(self, agent_id: str, num_tokens: int) -> list[Anchor]:
        return [a for a in self.anchors if a.serves(agent_id, num_tokens)]

    def add(self, anchor: Anchor) -> list[Anchor]:
        """Add an anchor; returns those pruned to make room (the caller frees their blobs)."""
        pruned = []
        while len(self.anchors) >= self.max_anchors:
            window = self.anchors[: self.prune_window]
            victim = min(window, key=lambda a: a.num_activations)  # ties: the oldest
            self.anchors.remove(victim)
            pruned.append(victim)
        self.anchors.append(anchor)
        return pruned

    def remove(self, anchor: Anchor) -> None:
        self.anchors.remove(anchor)

    def replace(self, old: Anchor, new: Anchor) -> None:
        """Put `new` where `old` was: a sample measured again against a new version of
        its base keeps its place and its activations (the sample's usefulness is what
        pruning weighs, not which version measured it)."""
        new.num_activations = old.num_activations
        self.anchors[self.anchors.index(old)] = new
