"""A prompt's segments in token space, and what the engine did with each.

The gateway's plan speaks of message characters; the aligner turns it into
`TokenSegment`s (token ranges of the prompt the engine actually runs). After the
prompt is prefilled, each segment gets a `SegmentOutcome`, reported back to the caller
under `kv_transfer_params["kvrelay_reuse"]`.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

from engine_ext.kv.hashing import DEFAULT_TENANT
from kvrelay.wire.plan import ReuseMethod, RoundInfo, WorkflowInfo

REUSE_METHODS: tuple[ReuseMethod, ...] = get_args(ReuseMethod)
# What an outcome reports: a plan's method, or `restored` (KV restored from a stored
# round cache, engine_ext/diffs: the approximate KV an earlier turn of the agent ran on).
OutcomeMethod = ReuseMethod | Literal["restored"]

# Kinds whose text recurs across requests and is worth keeping in the segment index.
REUSABLE_KINDS = frozenset({"fixed_prefix", "placeholder", "shared_block"})


class TokenSegment(NamedTuple):
    start: int  # first token of the segment in the prompt
    end: int  # one past its last token
    kind: str  # fixed_prefix | placeholder | shared_block | private
    name: str | None = None
    method: ReuseMethod | None = None  # asked for by the plan; None: the engine's default
    plan_index: int | None = None  # index of the plan segment it came from

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def is_reusable(self) -> bool:
        return self.kind in REUSABLE_KINDS


DEFAULT_APP = "default"  # the app of a plan that names none


class ReuseScope(NamedTuple):
    """Whose prompt this is, from the plan: every cache is namespaced by tenant; KVCOMM
    keeps anchors per tenant and app and offsets per
    agent; TokenDance prefills the requests of one All-Gather round together; KVFlow
    ranks cached prefixes by the workflow's steps-to-execution, kept per session (one
    workflow instance: several run one app's step graph at once, each at its own step)."""

    app_id: str
    agent_id: str | None
    round: RoundInfo | None = None
    workflow: WorkflowInfo | None = None
    tenant: str = DEFAULT_TENANT  # whose caches it may read and fill (engine_ext/kv/hashing.py)
    session_id: str | None = None  # the plan's session; None: the app's one unnamed session
    # The tenant the plan names, before a cache_salt split it into `tenant`: what a fidelity
    # score is reported under (the gateway's guard keys its figures and switches by it).
    named_tenant: str | None = None


class SegmentOutcome(NamedTuple):
    """What happened to one segment: `method` is what ran (dense when reuse fell back)."""

    segment: TokenSegment
    method: OutcomeMethod
    num_reused: int  # tokens whose KV came from a cache
    num_recomputed: int  # tokens computed by the model
    reason: str | None = None  # why a reusable segment fell back to dense, if it did
    kvcomm: dict[str, Any] | None = None  # a KVCOMM placeholder: anchor hit or new, anchors used
    collective: dict[str, Any] | None = None  # a segment reused collectively: its round group and master

    def to_json(self) -> dict[str, Any]:
        seg = self.segment
        out: dict[str, Any] = {
            "index": seg.plan_index, "kind": seg.kind, "name": seg.name, "method": self.method,
            "token_start": seg.start, "token_end": seg.end,
            "tokens_reused": self.num_reused, "tokens_recomputed": self.num_recomputed,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.kvcomm is not None:
            out["kvcomm"] = self.kvcomm
        if self.collective is not None:
            out["collective"] = self.collective
        return out


def report(outcomes: list[SegmentOutcome], alignment_note: str | None = None) -> dict[str, Any]:
    """The JSON reported back under kv_transfer_params[REUSE_KEY] (kvrelay/wire/reports.py)."""
    body: dict[str, Any] = {
        "segments": [o.to_json() for o in outcomes],
        "tokens_reused": sum(o.num_reused for o in outcomes),
        "tokens_recomputed": sum(o.num_recomputed for o in outcomes),
    }
    if alignment_note:
        body["alignment"] = alignment_note
    return body
