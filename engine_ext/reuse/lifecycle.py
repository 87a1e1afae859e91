"""ReuseLifecycle: the one owner of a request's reuse, from admission to release.

Reuse beyond the prefix cache touches a request at a few points: when it is admitted
(where its prompt's KV comes from: the prefix cache, a stored round cache, a lower
tier, segments placed from the segment index, its round group), when its placed KV
has been computed, once its prompt is done (commit what it measured, keep what others
may reuse) and whenever it stops running (let go of every pin). These used to be
branches inside the scheduler, the model runner and the engine, each knowing which
optional piece (restorer, tiers, collector, assembler, diff store) exists. Here they
are methods; the scheduler budgets with an `AdmissionPlan` and calls in here at
admission, the runner computes and calls nothing above it, and the engine tells the
lifecycle what each step computed.

The request's path: `plan` (admission: what is ready, what to compute, at what cost)
-> `place` (copy fetched and restored KV in, once its blocks are allocated) -> the
prefill (the runner; the engine then calls `round_computed` and `prefill_done`)
-> `after_prefill` (commit, register, store) -> `release` (preempted, finished, or an
admission undone: every pin let go in one idempotent call).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine_ext.collective.collector import KVCollector
from engine_ext.collective.prefill import CollectiveResult, GroupMember
from engine_ext.config import EngineConfig
from engine_ext.diffs.restorer import Restore
from engine_ext.kv.manager import KVCacheManager, PrefixMatch
from engine_ext.reuse.answers import Ending
from engine_ext.reuse.keep import Keeper
from engine_ext.reuse.parts import ReuseParts
from engine_ext.sequence import Sequence
from engine_ext.tiers.store import LowerMatch, TieredStore, TierEntry
from engine_ext.timeline import Placement
from engine_ext.tokenizer import Tokenizer


@dataclass(frozen=True)
class AdmissionPlan:
    """Where a waiting prompt's KV comes from, decided before its blocks are allocated."""

    prefix: PrefixMatch  # the prefix cache's hit
    restore: Restore | None  # a stored round cache it extends (engine_ext/diffs)
    fetch: tuple[TierEntry, ...]  # lower-tier blocks continuing the prefix hit (engine_ext/tiers)
    num_ready: int  # tokens it starts with: hit, fetched or restored
    num_tokens: int  # tokens its first chunk computes (or places)
    cost: int  # tokens it takes from the step's budget

    @property
    def num_new_tokens(self) -> int:
        """Tokens to allocate blocks for, past the prefix hit's blocks."""
        return self.num_tokens + self.num_ready - self.prefix.num_cached_tokens


class ReuseLifecycle:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, parts: ReuseParts, tiers: TieredStore | None,
                 tokenizer: Tokenizer) -> None:
        self.config = config
        self.kv = kv
        self.tiers = tiers
        self.parts = parts
        self.assembler = parts.assembler
        self.restorer = parts.restorer
        self.collector: KVCollector | None = parts.collector
        self.keeper = Keeper(config, kv, parts, tokenizer)

    # -- admission ---------------------------------------------------------------------
    def holds(self, seq: Sequence, waiting: Iterable[Sequence]) -> bool:
        """Whether the round's first waiting request waits for its siblings a little longer."""
        return self.collector is not None and self.collector.holds(seq, waiting)

    def candidates(self, head: Sequence, waiting: Iterable[Sequence]) -> list[Sequence]:
        """The head of the queue and the waiting siblings it brings along (its round's)."""
        return [head] + (self.collector.siblings(head, waiting) if self.collector is not None else [])

    def admitted(self, seqs: list[Sequence]) -> None:
        """Group the admitted requests of a round for one collective prefill."""
        if seqs and self.collector is not None:
            self.collector.form(seqs)

    def still_loading(self, seq: Sequence) -> bool:
        """Whether to pass the sequence over this step: part of its prefix is on its way
        to the device tier, and it has not waited `max_load_wait_ms` for it yet."""
        if self.tiers is None or seq.num_preemptions:
            return False
        if not self._lower_match(self.tiers, seq, len(self.kv.match_prefix(seq).blocks)).loading:
            return False
        now = time.monotonic()
        if seq.load_wait_since is None:
            seq.load_wait_since = now
        return (now - seq.load_wait_since) * 1000.0 < self.config.tiers.max_load_wait_ms

    def plan(self, seq: Sequence, budget: int) -> AdmissionPlan:
        """Decide where the prompt's KV comes from; what it reads is pinned on `seq.pins`
        until `release`. Reuse is planned for a prompt's first prefill; after a preemption
        it is recomputed densely (from the prefix cache where it can). A prefill around
        placed segments runs whole, in one step: blend needs every placed token at once."""
        prefix = self.kv.match_prefix(seq)
        restore = self.restorer.find(seq, prefix.num_cached_tokens) if self.restorer is not None else None
        fetch: list[TierEntry] = []
        if restore is None and self.tiers is not None:
            fetch = self._lower_match(self.tiers, seq, len(prefix.blocks)).entries
        num_ready = restore.num_tokens if restore is not None else \
            prefix.num_cached_tokens + len(fetch) * self.kv.block_size
        num_tokens = min(seq.num_tokens - num_ready, budget)
        cost = num_tokens
        if seq.segments and seq.reuse_outcomes is None:
            restored_from = restore.region_start if restore is not None else None
            seq.assembly = self.assembler.assemble(seq.segments, seq.token_ids, num_ready, seq.scope, restored_from)
            seq.pins.add(*self.assembler.locks(seq.assembly))
            if seq.assembly.placed:
                num_tokens = seq.num_tokens - num_ready
                cost = min(len(seq.assembly.full_positions()), budget)
        if restore is not None:
            seq.pins.add(restore.lock)
        return AdmissionPlan(prefix, restore, tuple(fetch), num_ready, num_tokens, cost)

    def place(self, seq: Sequence, plan: AdmissionPlan) -> list[tuple[str, Placement]] | None:
        """Copy the fetched and restored KV into the sequence's allocated blocks; returns
        what was put in place (part of its prefill), or None when a lower tier could not
        be read (the caller undoes the admission: next time it recomputes those blocks)."""
        placements: list[tuple[str, Placement]] = []
        if plan.fetch and self.tiers is not None:  # `plan` fetches from lower tiers only when there are some
            num_hits, num_fetched = len(plan.prefix.blocks), len(plan.fetch) * self.kv.block_size
            fetched_at = time.monotonic()
            if not self.tiers.fetch(list(plan.fetch), seq.blocks[num_hits : num_hits + len(plan.fetch)]):
                return None
            placements.append(("tier_fetch", Placement(fetched_at, time.monotonic(), num_fetched)))
            self.kv.computed(seq, seq.num_computed_tokens + num_fetched)
            if seq.num_preemptions == 0:
                seq.num_fetched_tokens = num_fetched
        restore = plan.restore
        if restore is not None and self.restorer is not None:  # `plan` restores only with a restorer
            restored_at = time.monotonic()
            self.restorer.apply(restore, self.kv.slots(seq, restore.num_tokens))
            placements.append(("diff_restore", Placement(restored_at, time.monotonic(),
                                                         restore.num_tokens - restore.region_start)))
            seq.restore = restore
            self.kv.computed(seq, restore.num_tokens)
            exact = seq.num_exact_tokens
            seq.num_exact_tokens = restore.region_start if exact is None else min(exact, restore.region_start)
        if seq.num_preemptions == 0:  # what it reports as cached: what it started with, at its first admission
            seq.num_cached_tokens = plan.num_ready
        return placements

    def _lower_match(self, tiers: TieredStore, seq: Sequence, num_hits: int) -> LowerMatch:
        """The lower tiers' view of the prompt's blocks past its `num_hits` device hits,
        keeping one prompt token (and every token whose logits it keeps) to compute."""
        max_blocks = seq.max_prefix_tokens // self.kv.block_size
        return tiers.match(seq.block_hashes[num_hits:max_blocks])

    # -- the prefill -------------------------------------------------------------------
    def round_computed(self, seqs: list[Sequence], members: list[GroupMember], result: CollectiveResult) -> None:
        """A round group's collective prefill ran: report it on each member, and keep
        the round's caches (while the segments they read are still pinned)."""
        for i, (seq, member) in enumerate(zip(seqs, members, strict=True)):
            member.assembly.collective = result.plan.report(i)  # the member's assembly is the sequence's
            num_placed = sum(p.segment.num_tokens for p in member.assembly.placed)
            seq.timeline.placed("collective", Placement(*result.placed, num_placed))
        self.keeper.store_round(seqs, members, result.plan)

    @staticmethod
    def prefill_done(seq: Sequence) -> None:
        """Its placed KV is computed (or its prefill failed): let go of what it read, and
        never publish the blocks from its first placed token on (approximate KV)."""
        seq.pins.release()
        seq.group = None
        first_approximate = seq.assembly.first_approximate if seq.assembly is not None else None
        limits = [n for n in (seq.num_exact_tokens, first_approximate) if n is not None]
        seq.num_exact_tokens = min(limits) if limits else None

    def after_prefill(self, seq: Sequence) -> None:
        """Once a prompt with segments is computed: record what each segment got, commit
        what it measured, keep what others may reuse. Nothing for other sequences."""
        if not seq.segments or seq.reuse_outcomes is not None or seq.num_computed_tokens < seq.num_prompt_tokens:
            return
        kept = time.monotonic()
        self.keeper.keep(seq)
        seq.timeline.keep_s = time.monotonic() - kept  # reuse's bookkeeping, before its first token

    def answer_end(self, seq: Sequence, ending: Ending) -> int | None:
        """Where the finished answer kept as a segment ends, None when it is not kept. The
        caller computes its tokens up to there first (a last token sampled, never computed)."""
        return self.keeper.answer_end(seq, ending)

    def keep_answer(self, seq: Sequence, end: int) -> None:
        """Keep the answer, computed up to `end` (`answer_end`), as a segment."""
        self.keeper.keep_answer(seq, end)

    # -- the end -----------------------------------------------------------------------
    @staticmethod
    def release(seq: Sequence) -> None:
        """Let go of every pin the request holds and forget its placement plan: it was
        preempted, finished, or its admission undone. Idempotent."""
        seq.pins.release()
        seq.assembly = None

    # -- what the engine's TTFT breakdowns ask -----------------------------------------
    @staticmethod
    def exact_hit(seq: Sequence) -> int:
        """Prompt tokens it started with exactly (a restore starts approximate at its region)."""
        return seq.restore.region_start if seq.restore is not None else seq.num_cached_tokens

    def runs_dense(self, seq: Sequence) -> bool:
        """Whether its chunk computes every token it names (no placed KV, no round group)."""
        return "collective" not in seq.timeline.assembly and seq.placement is None

