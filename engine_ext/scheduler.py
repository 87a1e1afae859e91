"""Continuous batching: which sequences run in the next step, and how many tokens each.

Running sequences go first (decodes cost one token each), so a long prompt arriving
never stalls the streams already decoding; it is prefilled in chunks with whatever
token budget the step has left. When the KV pool runs dry the newest running sequence
is preempted (its blocks freed, to be recomputed later, mostly from the prefix cache).

A request of an All-Gather round is admitted together with its waiting siblings, so the
KVCollector can prefill them as one group; a prompt that extends a stored round cache
starts from it (the Restorer), as it would from a prefix-cache hit.

With lower KV tiers (engine_ext/tiers), the blocks of a prompt's prefix that left the
device are copied back into its own blocks at admission (reactive loading). A request
whose prefix is still being prefetched is passed over while others run (KVFlow's
status-aware scheduling), for at most `tiers.max_load_wait_ms`; then it goes on and
recomputes what has not arrived.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from engine_ext.collective.collector import KVCollector
from engine_ext.config import EngineConfig
from engine_ext.diffs.restorer import Restorer
from engine_ext.kv.manager import KVCacheManager
from engine_ext.reuse.assembler import Assembler
from engine_ext.sequence import Sequence, SequenceStatus
from engine_ext.tiers.store import LowerMatch, TieredStore, TierEntry
from engine_ext.timeline import Placement


class ScheduledChunk(NamedTuple):
    seq: Sequence
    num_tokens: int

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]  # prefill chunks first, then single-token (decode) chunks
    num_preempted: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Admission(NamedTuple):
    chunk: ScheduledChunk
    cost: int  # tokens it takes from the step's budget


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, assembler: Assembler | None = None,
                 collector: KVCollector | None = None, restorer: Restorer | None = None,
                 tiers: TieredStore | None = None) -> None:
        self.config = config
        self.kv = kv
        self.tiers = tiers  # lower KV tiers to load evicted prefix blocks from
        self.assembler = assembler
        self.collector = collector  # groups a round's waiting requests (engine_ext/collective)
        self.restorer = restorer  # serves prompts that extend a stored round cache (engine_ext/diffs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed, budget)
            while not self.kv.allocate(seq, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, num_tokens))
                budget -= num_tokens
                i += 1
        skipped: set[str] = set()  # waiting requests passed over: their prefix is still loading
        while budget > 0 and not num_preempted:
            head = next((seq for seq in self.waiting if seq.request_id not in skipped), None)
            if head is None:
                break
            if self._still_loading(head):
                skipped.add(head.request_id)
                continue
            if self.collector is not None and self.collector.holds(head, self.waiting):
                break
            # A round's request brings its waiting siblings along (KVCollector).
            candidates = [head] + (self.collector.siblings(head, self.waiting) if self.collector else [])
            admitted = []
            for seq in candidates:
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                admission = self._admit(seq, budget)
                if admission is None:
                    break
                chunks.append(admission.chunk)
                budget -= admission.cost
                admitted.append(seq)
            if admitted and self.collector is not None:
                self.collector.form(admitted)
            if len(admitted) < len(candidates):
                break
        chunks.sort(key=lambda c: c.is_decode)  # stable: prefill chunks first
        return SchedulerOutput(chunks, num_preempted)

    def _admit(self, seq: Sequence, budget: int) -> Admission | None:
        """Move a waiting sequence to running with its first chunk; None (nothing
        changed) when the pool cannot hold it now. A prefill around placed segments runs
        whole, in one step: its blend selection needs every placed token at once."""
        started = time.monotonic()
        prefix = self.kv.match_prefix(seq)
        restore = self.restorer.find(seq, prefix.num_cached_tokens) if self.restorer is not None else None
        fetch = self._lower_tier_blocks(seq, len(prefix.blocks)) if restore is None else []
        num_ready = restore.num_tokens if restore is not None else \
            prefix.num_cached_tokens + len(fetch) * self.kv.block_size
        num_tokens = min(seq.num_tokens - num_ready, budget)
        cost = num_tokens
        # Reuse is planned for a prompt's first prefill; after a preemption the
        # sequence is recomputed densely (from the prefix cache where it can).
        if seq.segments and seq.reuse_outcomes is None and self.assembler is not None:
            restored_from = restore.region_start if restore is not None else None
            seq.assembly = self.assembler.assemble(seq.segments, seq.token_ids, num_ready, seq.scope, restored_from)
            if seq.assembly.placed:
                num_tokens = seq.num_tokens - num_ready
                cost = min(len(seq.assembly.full_positions()), budget)
        planned = time.monotonic()
        if not self.kv.allocate(seq, num_tokens + num_ready - prefix.num_cached_tokens, prefix):
            self._drop_assembly(seq)
            if restore is not None:
                self.restorer.cancel(restore)
            return None
        placements: list[tuple[str, Placement]] = []  # KV put in place at admission: part of the prefill
        if fetch:
            num_hits = len(prefix.blocks)
            fetched_at = time.monotonic()
            if not self.tiers.fetch(fetch, seq.blocks[num_hits : num_hits + len(fetch)]):
                self._undo_admission(seq)  # the unreadable blocks are gone: next time it recomputes them
                return None
            placements.append(("tier_fetch", Placement(fetched_at, time.monotonic(), len(fetch) * self.kv.block_size)))
            seq.num_computed_tokens += len(fetch) * self.kv.block_size
            if seq.num_preemptions == 0:
                seq.num_fetched_tokens = len(fetch) * self.kv.block_size
        if restore is not None:
            restored_at = time.monotonic()
            self.restorer.apply(restore, self.kv.slots(seq, restore.num_tokens))
            placements.append(("diff_restore", Placement(restored_at, time.monotonic(),
                                                         restore.num_tokens - restore.region_start)))
            seq.restore = restore
            seq.num_computed_tokens = restore.num_tokens
            exact = seq.num_exact_tokens
            seq.num_exact_tokens = restore.region_start if exact is None else min(exact, restore.region_start)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_ready
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.timeline.admitted is None:
            seq.timeline.admit(started, planned)
            for method, placement in placements:
                seq.timeline.placed(method, placement)
        return Admission(ScheduledChunk(seq, num_tokens), cost)

    def num_blocks_to_finish(self) -> int:
        """Blocks the running sequences may still allocate before they finish."""
        return sum(max(self.kv.num_blocks_for(seq.num_prompt_tokens + seq.max_tokens) - len(seq.blocks), 0)
                   for seq in self.running)

    def _lower_tier_blocks(self, seq: Sequence, num_hits: int) -> list[TierEntry]:
        """The lower-tier blocks that continue the sequence's device prefix hit (up to
        the first block still loading), keeping one prompt token to compute."""
        if self.tiers is None:
            return []
        return self._lower_match(seq, num_hits).entries

    def _lower_match(self, seq: Sequence, num_hits: int) -> LowerMatch:
        """The lower tiers' view of the prompt's blocks past its `num_hits` device hits."""
        max_blocks = (len(seq.token_ids) - 1) // self.kv.block_size  # one prompt token stays to compute
        return self.tiers.match(seq.block_hashes[num_hits:max_blocks])

    def _still_loading(self, seq: Sequence) -> bool:
        """Whether to pass the sequence over this step: part of its prefix is on its way
        to the device tier, and it has not waited `max_load_wait_ms` for it yet."""
        if self.tiers is None or seq.num_preemptions:
            return False
        if not self._lower_match(seq, len(self.kv.match_prefix(seq).blocks)).loading:
            return False
        now = time.monotonic()
        if seq.load_wait_since is None:
            seq.load_wait_since = now
        return (now - seq.load_wait_since) * 1000.0 < self.config.tiers.max_load_wait_ms

    def _undo_admission(self, seq: Sequence) -> None:
        """Give back what `_admit` took for a sequence that stays waiting."""
        self._drop_assembly(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0

    def _drop_assembly(self, seq: Sequence) -> None:
        """Unpin the cached segments of an assembly that will not run now."""
        if seq.assembly is not None and self.assembler is not None:
            self.assembler.release(seq.assembly)
        seq.assembly = None

    def _preempt(self, seq: Sequence) -> None:
        self._drop_assembly(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks (they stay cached for reuse)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_assembly(seq)
        self.kv.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
