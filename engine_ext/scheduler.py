"""Continuous batching: which sequences run in the next step, and how many tokens each.

Running sequences go first (decodes cost one token each), so a long prompt arriving
never stalls the streams already decoding; it is prefilled in chunks with whatever
token budget the step has left. When the KV pool runs dry the newest running sequence
is preempted (its blocks freed, to be recomputed later, mostly from the prefix cache).

Where a prompt's KV comes from beyond its own computation is the ReuseLifecycle's
(engine_ext/reuse/lifecycle.py): at admission it returns an `AdmissionPlan` (tokens
ready, tokens to compute, their cost) that the scheduler budgets with, and it is told
whenever a request stops running, to let go of what the request pinned. Through it, a
request of an All-Gather round is admitted together with its waiting siblings (one
collective prefill), a prompt that extends a stored round cache starts from it, the
blocks of a prefix that left the device are copied back from a lower KV tier, and a
request whose prefix is still being prefetched is passed over while others run (KVFlow's
status-aware scheduling), for at most `tiers.max_load_wait_ms`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from engine_ext.config import EngineConfig
from engine_ext.kv.manager import KVCacheManager
from engine_ext.reuse.lifecycle import ReuseLifecycle
from engine_ext.sequence import Sequence, SequenceStatus


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
    def __init__(self, config: EngineConfig, kv: KVCacheManager, lifecycle: ReuseLifecycle) -> None:
        self.config = config
        self.kv = kv
        self.lifecycle = lifecycle
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
            if self.lifecycle.still_loading(head):
                skipped.add(head.request_id)
                continue
            if self.lifecycle.holds(head, self.waiting):
                break
            candidates = self.lifecycle.candidates(head, self.waiting)  # a round's request brings its siblings
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
            self.lifecycle.admitted(admitted)
            if len(admitted) < len(candidates):
                break
        chunks.sort(key=lambda c: c.is_decode)  # stable: prefill chunks first
        return SchedulerOutput(chunks, num_preempted)

    def _admit(self, seq: Sequence, budget: int) -> Admission | None:
        """Move a waiting sequence to running with its first chunk; None (nothing
        changed) when the pool cannot hold it now."""
        started = time.monotonic()
        plan = self.lifecycle.plan(seq, budget)
        planned = time.monotonic()
        if not self.kv.allocate(seq, plan.num_new_tokens, plan.prefix):
            self.lifecycle.release(seq)
            return None
        placements = self.lifecycle.place(seq, plan)  # KV put in place at admission: part of the prefill
        if placements is None:
            self._undo_admission(seq)
            return None
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = plan.num_ready
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.timeline.admitted is None:
            seq.timeline.admit(started, planned)
            for method, placement in placements:
                seq.timeline.placed(method, placement)
        return Admission(ScheduledChunk(seq, plan.num_tokens), plan.cost)

    def num_blocks_to_finish(self) -> int:
        """Blocks the running sequences may still allocate before they finish."""
        return sum(max(self.kv.num_blocks_for(seq.num_prompt_tokens + seq.max_tokens) - len(seq.blocks), 0)
                   for seq in self.running)

    def _undo_admission(self, seq: Sequence) -> None:
        """Give back what `_admit` took for a sequence that stays waiting."""
        self.lifecycle.release(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.lifecycle.release(seq)
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
        self.lifecycle.release(seq)
        self.kv.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
