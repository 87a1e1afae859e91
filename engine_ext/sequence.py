"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.kv.hashing import DEFAULT_TENANT
from engine_ext.reuse.locks import Pins
from engine_ext.sampling import SamplingParams
from engine_ext.timeline import Timeline

if TYPE_CHECKING:
    from engine_ext.adapters.registry import ServedAdapter
    from engine_ext.collective.collector import CollectiveGroup
    from engine_ext.diffs.restorer import Restore
    from engine_ext.detokenizer import Detokenizer
    from engine_ext.kv.block_pool import Block
    from engine_ext.reuse.assembler import Assembly
    from engine_ext.reuse.segments import ReuseScope, SegmentOutcome, TokenSegment


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved: never beyond the context or the KV budget
    detokenizer: Detokenizer
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # When it passed each stage, stamped by the engine: the caller's (LLMEngine.add_request),
    # else one arriving now. Every sequence has one, so the engine never asks.
    timeline: Timeline = field(default_factory=Timeline)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_fetched_tokens: int = 0  # of those, tokens loaded back from a lower KV tier (engine_ext/tiers)
    load_wait_since: float | None = None  # when admission first found its prefix still loading
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    # Reuse beyond the prefix cache (engine_ext/reuse): the prompt's segments, the
    # decisions for its next prefill, and what happened once the prompt was computed.
    segments: list[TokenSegment] = field(default_factory=list)
    scope: ReuseScope | None = None  # app and agent, for KVCOMM's anchors
    assembly: Assembly | None = None
    # Every cache pin it holds beyond its own blocks (placed segments, anchors, a stored
    # round cache): let go in one call by the ReuseLifecycle (engine_ext/reuse/lifecycle.py).
    pins: Pins = field(default_factory=Pins)
    group: CollectiveGroup | None = None  # the round group its next prefill runs with (engine_ext/collective)
    restore: Restore | None = None  # the stored round cache its prompt started from (engine_ext/diffs)
    reuse_outcomes: list[SegmentOutcome] | None = None
    # Blocks at or past this position hold approximate KV and are never published to
    # the prefix cache; None: every computed block is exact.
    num_exact_tokens: int | None = None
    publish: bool = True  # False: this request leaves nothing for others (prefix cache, round caches)
    adapter: ServedAdapter | None = None  # the LoRA adapter it runs with (engine_ext/adapters)
    # Teacher forcing (the fidelity harness): append these tokens instead of sampling,
    # and keep the logits each step produced.
    forced_token_ids: list[int] | None = None
    logits: list[torch.Tensor] | None = None
    # Teacher forcing in one prefill (a fidelity probe, engine_ext/probes.py): the forced
    # tokens sit in the prompt, and `logits` also keeps the logits of every computed
    # position from this one on (not only those of sampled tokens), in order.
    logits_from: int | None = None
    # Background work (a probe's dense score): run only in steps that no request wants, at
    # most `max_chunk_tokens` tokens a step, and the first to lose its KV when memory is
    # short (engine_ext/scheduler.py).
    background: bool = False
    max_chunk_tokens: int | None = None  # None: whatever the step's budget allows

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.sampling.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def tenant(self) -> str:
        """Whose caches this request reads and fills: its plan's, else the default tenant."""
        return self.scope.tenant if self.scope is not None else DEFAULT_TENANT

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def max_prefix_tokens(self) -> int:
        """Tokens at its start whose KV may come from a cache instead of being computed: all
        but the last, whose logits are needed, and none from `logits_from` on."""
        last = self.num_tokens - 1
        return last if self.logits_from is None else min(last, self.logits_from)

    @property
    def placement(self) -> Assembly | None:
        """The assembly its next prefill runs around when that places segments, else None."""
        return self.assembly if self.assembly is not None and self.assembly.placed else None

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
