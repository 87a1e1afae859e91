"""Reuse methods: what each plan method asks of the engine, as registered objects.

A segment's method (the plan's, or the engine's default) used to be tested by name
wherever it mattered: whether it places cached KV at all, how many of its tokens it
computes anyway, which are blend candidates, whether KVCOMM's anchors decide it. Each
method is now one `ReuseMethodSpec` in `METHODS`; the assembler, the reuse prefill and
the keeper ask the spec. A new method is one class (in its own module if it is more
than a few lines) and one registration line here; the plan's `ReuseMethod` names it.
"""

from __future__ import annotations

import math
from abc import ABC

from engine_ext.config import ReuseConfig
from engine_ext.reuse.segments import TokenSegment


class ReuseMethodSpec(ABC):
    """Contract: a method that `places` copies a segment's cached KV to its new position
    (approximate: never published to the prefix cache), recomputing in every layer its
    first `num_linked` tokens, and `num_recomputed` tokens in all; placing is refused
    when that is not fewer than the segment's. Past the linked head, the `repair_ratio`
    of its tokens whose keys deviate most on the check layers are recomputed in the
    deeper layers (CacheBlend's selection). `blends` marks CacheBlend itself (whose
    rounds collective prefill handles); `uses_anchors` has KVCOMM's anchor bank decide
    the segment. A method that does not place is exact: the segment is served by the
    prefix cache or computed."""

    name: str
    places: bool = True
    blends: bool = False
    uses_anchors: bool = False

    def num_linked(self, seg: TokenSegment, config: ReuseConfig) -> int:
        return 0

    def repair_ratio(self, config: ReuseConfig) -> float:
        return 0.0

    def num_recomputed(self, seg: TokenSegment, config: ReuseConfig) -> int:
        return self.num_linked(seg, config) + math.ceil(self.repair_ratio(config) * seg.num_tokens)


class Exact(ReuseMethodSpec):
    """prefix, dense: no placed KV; the prefix cache or the model computes it."""

    places = False

    def __init__(self, name: str) -> None:
        self.name = name


class Shift(ReuseMethodSpec):
    """The cached KV, keys RoPE-shifted to the new position; nothing recomputed."""

    name = "shift"


class Blend(ReuseMethodSpec):
    """CacheBlend: shifted, then the `blend_ratio` of tokens that deviate most recomputed."""

    name = "blend"
    blends = True

    def repair_ratio(self, config: ReuseConfig) -> float:
        return config.blend_ratio


class Link(ReuseMethodSpec):
    """Shifted, its first `link_tokens` recomputed in every layer (none at position 0)."""

    name = "link"

    def num_linked(self, seg: TokenSegment, config: ReuseConfig) -> int:
        return min(config.link_tokens, seg.num_tokens) if seg.start > 0 else 0


class KVComm(ReuseMethodSpec):
    """KVCOMM: shifted, plus the offsets its anchors predict (engine_ext/kvcomm), and
    optionally the `anchors.recompute_ratio` that still deviate most recomputed (a
    placement reproduced from its own exact anchors excepted: the assembler knows)."""

    name = "kvcomm"
    uses_anchors = True

    def repair_ratio(self, config: ReuseConfig) -> float:
        return config.anchors.recompute_ratio


METHODS: dict[str, ReuseMethodSpec] = {
    "prefix": Exact("prefix"),
    "dense": Exact("dense"),
    "shift": Shift(),
    "blend": Blend(),
    "link": Link(),
    "kvcomm": KVComm(),
}

# Methods whose reused tokens count as cached (they place KV).
PLACED_METHODS = frozenset(name for name, spec in METHODS.items() if spec.places)
