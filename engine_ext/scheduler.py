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

Background sequences (a fidelity probe's dense score, engine_ext/probes.py) are work
no client waits for. They run only in a step no request wants: while any request is
waiting or running they are paused, keeping their KV and progress, and resume where
they stopped once the engine has been idle for `probe_idle_ms`: in an agent chain the
next agent's request follows the last answer within tens of milliseconds (the client
reads the answer, the gateway plans the next prompt), and a chunk started in that gap
takes both cores from them. At 50 ms, probes running in those gaps made every-request
probing cost agents 2-5 of the long-context board 1.10x their unprobed TTFT (mean over
warm tasks); at 300 ms, 1.03x, with as many scores. A background step computes one chunk of at most the
sequence's `max_chunk_tokens`, and a request arriving during it stops it between two
layers (LLMEngine.step's `interrupt`), so the request waits one layer at most. Their KV goes first when memory is short: before a request would
be preempted for lack of blocks, background KV is freed (the background sequence later
starts over).
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from engine_ext.config import EngineConfig
from engine_ext.kv.manager import KVCacheManager, PrefixMatch
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
    background: bool = False  # the step is background work alone: a request arriving may interrupt it

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
        # Background sequences, oldest first, waiting or running (holding KV) alike: never
        # in `waiting` or `running`, so they take no request's place or `max_num_seqs` slot.
        self.background: list[Sequence] = []
        self._requests_seen = float("-inf")  # monotonic time a step last had requests

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.background)

    @property
    def has_requests(self) -> bool:
        """Whether any request (not background work) is waiting or running."""
        return bool(self.waiting or self.running)

    def background_wait_s(self) -> float:
        """Seconds before background work may run: what is left of the `probe_idle_ms`
        window since the last request. 0.0 when there is none, when it may run now, or when
        requests run (their steps come first; nothing is waiting on the clock)."""
        if self.has_requests or not self.background:
            return 0.0
        return max(0.0, self.config.probe_idle_ms / 1000.0 - (time.monotonic() - self._requests_seen))

    def add(self, seq: Sequence) -> None:
        (self.background if seq.background else self.waiting).append(seq)

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_requests()
        if self.has_requests:
            self._requests_seen = time.monotonic()
            return out  # background work is paused (its KV kept) while any request waits or runs
        if self.background_wait_s() > 0.0:
            return out  # an agent app's next request is usually a few ms behind the last answer
        return self._schedule_background()

    def _schedule_requests(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed, budget)
            while not self._allocate(seq, num_tokens):
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

    def _schedule_background(self) -> SchedulerOutput:
        """No request waits or runs: the next chunk of the oldest background sequence,
        alone in its step and at most its `max_chunk_tokens`, so that a request arriving
        meanwhile stops it within a layer. Newer background sequences give
        up their KV if it lacks room; with none to give, the step is empty (a transfer in
        flight may hold blocks) and it tries again next step, its progress kept."""
        if not self.background:
            return SchedulerOutput([], 0)
        seq = self.background[0]
        budget = self.config.max_num_batched_tokens
        if seq.max_chunk_tokens is not None:
            budget = min(budget, seq.max_chunk_tokens)
        chunk = self._background_chunk(seq, budget)
        if chunk is None and self._free_background(keep=seq):
            chunk = self._background_chunk(seq, budget)
        return SchedulerOutput([chunk] if chunk is not None else [], 0, background=True)

    def _background_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """A background sequence's next chunk with its slots reserved (admitting it first
        if it holds none); None when the pool cannot hold it now."""
        if seq.status is SequenceStatus.RUNNING:
            num_tokens = min(seq.num_uncomputed, budget)
            return ScheduledChunk(seq, num_tokens) if self.kv.allocate(seq, num_tokens) else None
        admission = self._admit(seq, budget)
        return admission.chunk if admission is not None else None

    def _allocate(self, seq: Sequence, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Reserve a request's slots; when the pool cannot supply them, background KV is
        freed before the caller would preempt a request. Not sooner: a warm engine's free
        blocks are nearly all cached prefixes, and freeing the probe whenever a request
        takes one would restart it on every arrival (it would finish only in long idle
        gaps); a probe's few blocks cost the LRU's oldest prefixes instead."""
        if self.kv.allocate(seq, num_tokens, prefix):
            return True
        return self._free_background() and self.kv.allocate(seq, num_tokens, prefix)

    def _free_background(self, keep: Sequence | None = None) -> bool:
        """Preempt every background sequence holding KV (but `keep`); whether any did."""
        victims = [bg for bg in self.background if bg.blocks and bg is not keep]
        for victim in victims:
            self._preempt(victim)
        return bool(victims)

    def _admit(self, seq: Sequence, budget: int) -> Admission | None:
        """Move a waiting sequence to running with its first chunk (a background sequence
        stays in `background`); None (nothing changed) when the pool cannot hold it now."""
        started = time.monotonic()
        plan = self.lifecycle.plan(seq, budget)
        planned = time.monotonic()
        allocate = self.kv.allocate if seq.background else self._allocate  # background never frees background
        if not allocate(seq, plan.num_new_tokens, plan.prefix):
            self.lifecycle.release(seq)
            return None
        placements = self.lifecycle.place(seq, plan)  # KV put in place at admission: part of the prefill
        if placements is None:
            self._undo_admission(seq)
            return None
        seq.status = SequenceStatus.RUNNING
        if not seq.background:
            self.waiting.remove(seq)
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
        self.kv.reset(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's KV, to be recomputed later: a request (already out of
        `running`) goes back to the head of the queue, background work stays in place."""
        self.lifecycle.release(seq)
        self.kv.reset(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        if not seq.background:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks (they stay cached for reuse)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for queue in (self.running, self.waiting, self.background):
            if seq in queue:
                queue.remove(seq)
                break
        self.lifecycle.release(seq)
        self.kv.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting, *self.background):
            if seq.request_id == request_id:
                return seq
        return None
