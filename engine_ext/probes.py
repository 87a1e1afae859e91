"""Fidelity probes: approximate requests scored again densely on the engine's spare capacity.

The gateway's fidelity guard (kvrelay/gateway/fidelity_guard.py) asks for a sample of the
approximate requests to be checked (`SegmentPlan.probe`). For such a request the engine
keeps the logits of its first generated tokens; if the request really placed
approximate KV, its finish queues a `ProbeJob`. A job is a dense, teacher-forced score
of the same prompt and the same output tokens (no segments, publishing nothing), and
`compare_logits` turns the two sets of logits into top-1 agreement and KL(dense ||
approx): the fidelity of what was actually served, measured without changing it.

A guard must not cost the requests it guards, so a score is background work for the
scheduler (engine_ext/scheduler.py): the prompt and the answer's tokens (but its last)
form one sequence, prefilled in chunks of at most `chunk_tokens`, alone in their step,
and only in steps no request wants; its logits are kept from the prompt's last position
on, one per answer token, so no decode step is needed. A request arriving during a
probe's step stops it before its next layer (the chunk is computed again later), so it
waits one layer at most, and the probe is paused, its KV and progress kept, until the
engine is idle again. When a request could get its KV
blocks in no other way, the probe's go first (before any request is preempted) and it
starts over later. Only the engine thread calls `Probes`' engine methods;
`results_after` is read from the server's event loop, hence the lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine_ext.fidelity import compare_logits
from engine_ext.reuse.segments import DEFAULT_APP, ReuseScope
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import SequenceStatus
from kvrelay.wire.reports import FidelityScore
from engine_ext.request import EngineRequest

if TYPE_CHECKING:
    from engine_ext.engine import LLMEngine
    from engine_ext.sequence import Sequence

logger = logging.getLogger(__name__)

PROBED_METHODS = frozenset({"shift", "blend", "link", "kvcomm"})  # approximate: placed KV from elsewhere
PROBE_PREFIX = "probe-"  # request ids of the dense scores
DEFAULT_CHUNK_TOKENS = 64  # EngineConfig.probe_chunk_tokens: the most a probe computes in one step


class CappedLogits(list[torch.Tensor]):
    """A `Sequence.logits` that keeps only the first `cap` rows: the model runner appends
    every step's logits, and a long answer must not hold vocab-sized rows per token."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def append(self, row: torch.Tensor) -> None:
        if len(self) < self.cap:
            super().append(row)


class ProbeJob(NamedTuple):
    request_id: str
    tenant: str  # whose caches the dense score runs in
    app: str
    method: str
    prompt_ids: list[int]
    output_ids: list[int]  # the tokens the approximate request produced (first `cap` of them)
    logits: torch.Tensor  # (len(output_ids), vocab): the approximate logits that chose them
    named_tenant: str | None = None  # the plan's tenant, unsalted: what the score is reported under


@dataclass
class _Running:
    """The job being scored, and what the last step left of its dense sequence (so that
    a step that did not advance it, or took its KV, is seen and counted)."""

    job: ProbeJob
    seq: Sequence
    num_computed: int = 0
    num_preemptions: int = 0
    paused: bool = False


class Probes:
    """Probe bookkeeping for one engine: which sequences record logits, queued and
    running jobs, and the results, bounded everywhere (oldest dropped, counted)."""

    def __init__(self, max_tokens: int = 32, max_jobs: int = 16, max_results: int = 1024,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        if max_tokens < 1 or max_jobs < 1 or max_results < 1 or chunk_tokens < 1:
            raise ValueError("probe bounds must be >= 1")
        self.max_tokens = max_tokens
        self.chunk_tokens = chunk_tokens
        self._jobs: deque[ProbeJob] = deque(maxlen=max_jobs)
        self._results: deque[FidelityScore] = deque(maxlen=max_results)
        self._watched: dict[str, Sequence] = {}  # probed requests in flight
        self._running: _Running | None = None
        self._seq = itertools.count(1)
        self._last_seq = 0
        self._lock = threading.Lock()
        self.num_dropped = 0  # jobs pushed out of a full queue
        self.num_failed = 0  # jobs that raised
        self.num_paused = 0  # times a started score yielded to requests (its progress kept)
        self.num_preempted = 0  # times a score lost its KV to requests short of memory (and started over)
        self.num_chunks = 0  # steps that advanced a score
        self.num_skipped = 0  # probed requests that placed no approximate KV

    # -- the probed request ---------------------------------------------------------------
    def watch(self, seq: Sequence) -> None:
        """Record the first logits of a probed request with segments (only those can
        place approximate KV); recording only reads what the step computed anyway."""
        if seq.segments and seq.logits is None:
            seq.logits = CappedLogits(self.max_tokens)
            self._watched[seq.request_id] = seq

    def forget(self, request_id: str) -> None:
        """An aborted or failed request: nothing to probe."""
        self._watched.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """A request finished: queue its job if it was probed and placed approximate KV."""
        seq = self._watched.pop(request_id, None)
        if seq is None:
            return
        method = _placed_method(seq)
        logits = seq.logits
        seq.logits = None
        if method is None or not logits:
            self.num_skipped += 1
            return
        scope = seq.scope
        if len(self._jobs) == self._jobs.maxlen:
            self.num_dropped += 1
        self._jobs.append(ProbeJob(seq.request_id, seq.tenant, scope.app_id if scope is not None else DEFAULT_APP,
                                   method, list(seq.prompt_token_ids), seq.output_token_ids[:len(logits)],
                                   torch.stack(list(logits)), scope.named_tenant if scope is not None else None))

    # -- the dense scores, on spare capacity ----------------------------------------------
    @property
    def has_jobs(self) -> bool:
        """Cheap: whether the engine thread has probe work (queued or running)."""
        return bool(self._jobs) or self._running is not None

    @property
    def has_pending(self) -> bool:
        """Whether a score may still come: a probed request not finished yet (its answer
        reaches the client just before its job is queued), or a job queued or running."""
        return bool(self._watched) or self.has_jobs

    def tick(self, engine: LLMEngine) -> None:
        """Before a loop iteration's step: with no score running, the next job's starts.
        The scheduler runs it only in steps that no request wants, so it may start while
        requests run. A job that cannot start is dropped (counted)."""
        if self._running is not None or not self._jobs:
            return
        job = self._jobs.popleft()
        try:
            self._running = _Running(job, _start_score(engine, job, self.chunk_tokens))
        except Exception:
            logger.exception("fidelity probe of request %s could not start; dropped", job.request_id)
            self.num_failed += 1

    def after_step(self) -> None:
        """After a step: count what it did to the running score (a chunk, a pause, its KV
        taken); a finished score becomes a result. A failure is logged and counted; the
        engine loop goes on."""
        running = self._running
        if running is None:
            return
        self._observe(running)
        if not running.seq.is_finished:
            return
        try:
            self._store(running)
        finally:
            # Only now: until its result is readable, `has_pending` must still say a score may come.
            self._running = None

    def _store(self, running: _Running) -> None:
        """The finished score's result, for the pollers; a failure is logged and counted."""
        job, dense = running.job, running.seq
        try:
            if dense.finish_reason == "abort" or dense.logits is None or len(dense.logits) != len(job.output_ids):
                raise RuntimeError(f"the dense score ended early ({dense.finish_reason})")
            top1, kl = compare_logits(torch.stack(dense.logits), job.logits)
            score = FidelityScore(request_id=job.request_id, tenant=job.named_tenant or job.tenant, app=job.app,
                                  method=job.method, top1=top1, kl=kl, tokens=len(job.output_ids))
        except Exception:
            logger.exception("fidelity probe of request %s failed; dropped", job.request_id)
            self.num_failed += 1  # after the log: a reader of the count finds the line
            return
        with self._lock:
            self._last_seq = next(self._seq)
            self._results.append(score.model_copy(update={"seq": self._last_seq}))

    def _observe(self, running: _Running) -> None:
        """Compare the score's sequence with the last step's view: advanced (a chunk),
        holding KV but not advanced (paused: the step was the requests'; one count per
        pause), or preempted (its KV freed; it starts over)."""
        seq = running.seq
        if seq.num_preemptions > running.num_preemptions:
            self.num_preempted += seq.num_preemptions - running.num_preemptions
            running.num_preemptions, running.paused = seq.num_preemptions, False
        elif seq.num_computed_tokens != running.num_computed or seq.is_finished:
            self.num_chunks += 1
            running.paused = False
        elif seq.status is SequenceStatus.RUNNING and not running.paused:
            self.num_paused += 1
            running.paused = True
        running.num_computed = seq.num_computed_tokens

    def reset(self, engine: LLMEngine) -> None:
        """The engine failed a step: drop the running job and every watched request."""
        self._watched.clear()
        running, self._running = self._running, None
        if running is not None:
            if not running.seq.is_finished:
                engine.abort(running.seq.request_id)
            self.num_failed += 1

    # -- results, for the server's event loop ---------------------------------------------
    def results_after(self, after: int, limit: int = 1000) -> tuple[list[FidelityScore], int]:
        """Results with seq > after (oldest first, at most `limit`) and the seq to ask
        after next; a `next` below `after` tells a poller the engine restarted."""
        with self._lock:
            found = [r for r in self._results if r.seq > after][:limit]
            last = self._last_seq
        return found, found[-1].seq if found else last

    def counters(self) -> dict[str, int]:
        return {"dropped": self.num_dropped, "failed": self.num_failed, "paused": self.num_paused,
                "preempted": self.num_preempted, "chunks": self.num_chunks, "skipped": self.num_skipped,
                "queued": len(self._jobs), "running": int(self._running is not None)}


def _placed_method(seq: Sequence) -> str | None:
    """The approximate method that placed the most tokens of the request, if any did. KV
    restored from a stored turn (`restored`) is the approximate KV that turn ran on: it
    counts for the method the plan asked for."""
    reused: dict[str, int] = {}
    for outcome in seq.reuse_outcomes or []:
        method = outcome.segment.method if outcome.method == "restored" else outcome.method
        if method in PROBED_METHODS and outcome.num_reused > 0:
            reused[method] = reused.get(method, 0) + outcome.num_reused
    return max(reused, key=reused.__getitem__) if reused else None


def _start_score(engine: LLMEngine, job: ProbeJob, chunk_tokens: int) -> Sequence:
    """Queue the dense, teacher-forced score of a job as background work: the prompt and
    the answer's tokens but its last as one prompt, prefilled in chunks of at most
    `chunk_tokens`, keeping the logits of every position from the prompt's last on (they
    predicted the answer's tokens, one each). No segments (exact prefix hits of the
    request's own tenant at most, and none reaching those positions), nothing published,
    so it neither reads nor leaves approximate KV."""
    num_prompt = len(job.prompt_ids)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    scope = ReuseScope(job.app, None, tenant=job.tenant)
    seq = engine.add_request(EngineRequest(f"{PROBE_PREFIX}{job.request_id}", job.prompt_ids + job.output_ids[:-1],
                                           sampling, publish=False, scope=scope, background=True,
                                           max_chunk_tokens=chunk_tokens))
    seq.forced_token_ids, seq.logits, seq.logits_from = job.output_ids[-1:], [], num_prompt - 1
    return seq
