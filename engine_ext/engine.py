"""LLMEngine: admit requests, run steps, report per-request progress. Synchronous and
single-threaded by design; `AsyncEngine` drives it from a background thread."""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engine_ext.adapters.registry import AdapterRegistry
from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.model.dtypes import TORCH_DTYPES
from engine_ext.detokenizer import Detokenizer
from engine_ext.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
)
from engine_ext.kv import KVCache, KVCacheManager
from engine_ext.kv.block_pool import Block
from engine_ext.model import load_model
from engine_ext.model.llama import StepInterrupted
from engine_ext.model_runner import ModelRunner
from engine_ext.reuse.answers import Ending
from engine_ext.reuse.lifecycle import ReuseLifecycle
from engine_ext.reuse.parts import build_parts
from engine_ext.reuse.segments import (
    REUSE_METHODS,
    ReuseScope,
    SegmentOutcome,
    TokenSegment,
)
from engine_ext.sampling import Sampler, SamplingParams
from engine_ext.scheduler import ScheduledChunk, Scheduler
from engine_ext.sequence import Sequence
from engine_ext.served import MirrorCounters, ReuseCounters, ServedModel
from engine_ext.tiers import AgentKey, Prefetcher, TieredStore, WorkflowPolicy, WorkflowTable, with_sized_host_tier
from engine_ext.timeline import Interval, PrefillRate, PrefixShadow, Timeline
from engine_ext.tokenizer import Tokenizer
from engine_ext.request import EngineRequest

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    reuse_outcomes: list[SegmentOutcome] | None = None  # per plan segment, once the prompt is computed
    timeline: Timeline | None = None  # when the request passed each stage; on its last output only
    prompt_blocks: list[bytes] | None = None  # the prompt's full-block hashes; on its last output only


class ScoreResult(NamedTuple):
    logits: torch.Tensor  # (num_tokens, vocab)
    reuse_outcomes: list[SegmentOutcome]


class LLMEngine:
    def __init__(self, model_dir: Path, config: EngineConfig, model_name: str | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.model_config = ModelConfig.from_dir(self.model_dir)
        # One config for every part: an automatic host tier is sized (engine_ext/tiers/sizing.py)
        # before any part holds the config, so all of them read the same object.
        self.config = config = with_sized_host_tier(config, KVCache.block_bytes(self.model_config, config))
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, self.model_config, config.dtype, config.linear_kernel)
        self.adapters = AdapterRegistry(config.adapters, self.model_config, self.model_name, TORCH_DTYPES[config.dtype])
        self.kv_cache = KVCache(self.model_config, config)
        # KVFlow's view of the workflows, per session (engine_ext/tiers)
        self.workflows = WorkflowTable(config.tiers.workflow_idle_s, config.tiers.workflow_max_sessions)
        policy = WorkflowPolicy(self.workflows) if config.tiers.policy == "workflow" else None
        self.kv = KVCacheManager(self.kv_cache.num_blocks, config.block_size, self.model_name, policy)
        self.tiers, self.prefetcher = self._tiers()
        if self.tiers is not None:
            # The worker thread outlives an engine nobody closed (tests, scripts) and, through
            # the transfers it finished, keeps the tier storage alive: stop it with the engine.
            weakref.finalize(self, self.tiers.worker.stop)
        # Reuse beyond the prefix cache: its parts, and the one owner of a request's reuse.
        parts = build_parts(self.model, self.model_config, self.kv_cache, self.kv, self.config, self.model_name)
        self.lifecycle = ReuseLifecycle(self.config, self.kv, parts, self.tiers, self.tokenizer)
        self.segment_index, self.anchor_bank = parts.segment_index, parts.anchor_bank
        self.collector, self.diff_store = parts.collector, parts.diff_store
        self.last_step_empty = False
        self._transfer_wait_s = 0.005  # an empty step waits this long for a transfer (see `wake_on_transfers`)
        self.num_interrupted_steps = 0  # background steps a request's arrival stopped between layers
        # TTFT breakdowns price reuse against prefix caching alone: its dense prefill time,
        # and the prefix cache it would hold (engine_ext/timeline.py).
        self.prefill_rate = PrefillRate(config.max_num_batched_tokens)
        self.prefix_shadow = PrefixShadow(self.kv_cache.num_blocks)
        self.scheduler = Scheduler(config, self.kv, self.lifecycle)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv, Sampler(), parts.reuse_prefill,
                                  parts.collective)
        limits = [self.model_config.max_position_embeddings]
        if config.max_model_len:
            limits.append(config.max_model_len)
        if self.model_config.attention_window:
            logger.warning("sliding-window model: context capped at its window of %d tokens",
                           self.model_config.attention_window)
            limits.append(self.model_config.attention_window)
        self.max_model_len = min(limits)
        eos = set(self.model_config.eos_token_ids)
        eos_from_tokenizer = self.tokenizer.token_id(self.tokenizer.eos_token)
        if eos_from_tokenizer is not None:
            eos.add(eos_from_tokenizer)
        self.eos_token_ids = frozenset(eos)

    def _tiers(self) -> tuple[TieredStore | None, Prefetcher | None]:
        """KVFlow's lower KV tiers and prefetcher, when configured."""
        settings = self.config.tiers
        if not settings.has_lower_tier:
            return None, None
        try:
            store = TieredStore(settings, self.kv.pool, self.kv_cache, self.kv.pool.policy)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        if not settings.load_ahead:
            return store, None
        return store, Prefetcher(self.workflows, store, self.kv.pool.policy, settings.load_ahead,
                                 settings.max_prefetches)

    def served(self) -> ServedModel:
        """The model's facts the serving layer reads (engine_ext/served.py)."""
        return ServedModel(self.model_name, self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                           self.max_model_len, tuple(self.adapters.names), self.config.block_size)

    def reuse_counters(self) -> ReuseCounters:
        """A snapshot of what the reuse methods did since start, for /metrics. Read from
        outside the engine thread: each counter is one int, read whole."""
        bank, collective, store = self.anchor_bank, self.runner.collective, self.diff_store
        return ReuseCounters(
            kvcomm_tokens=None if bank is None else (bank.num_predicted_tokens, bank.num_measured_tokens),
            collective=None if collective is None else (collective.num_rounds, collective.num_members),
            mirrors=None if store is None else MirrorCounters(store.mirror_bytes, store.mirrored_dense_bytes,
                                                             store.mirrored_rows, store.mirror_rows),
            interrupted_steps=self.num_interrupted_steps)

    def resident_blocks(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes of the blocks held on the device, and of those only in a lower tier:
        what a router needs to send a prompt where its prefix is (kvrelay/wire/cache_report.py).
        Read from outside the engine thread; each list is a consistent copy."""
        device = self.kv.pool.cached_hashes()
        if self.tiers is None:
            return device, []
        on_device = set(device)
        lower = {h for tier in self.tiers.tiers for h in tier.ready_hashes() if h not in on_device}
        return device, list(lower)

    def close(self) -> None:
        """Stop the KV transfer worker (the engine serves nothing afterwards)."""
        if self.tiers is not None:
            self.tiers.close()

    # -- admission -------------------------------------------------------------------
    def add_request(self, request: EngineRequest, timeline: Timeline | None = None) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError subclasses.
        `timeline` is the caller's, stamped from when it asked (a server's queue to the
        engine thread is queue time); without one, the request arrives now."""
        prompt_token_ids, sampling, segments = request.prompt_token_ids, request.sampling, request.segments
        served = self.adapters.get(request.adapter) if request.adapter is not None else None
        if served is not None and not served.is_icarus:
            segments = None  # cached segments hold the base model's K/V, not this adapter's
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if request.max_chunk_tokens is not None and request.max_chunk_tokens < 1:
            raise InvalidRequestError("max_chunk_tokens must be >= 1")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if num_prompt >= self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {num_prompt}"
            )
        capacity = min(self.max_model_len, self.kv_cache.num_tokens)
        max_tokens = sampling.max_tokens or capacity - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt} and max_tokens asks for {max_tokens} more"
            )
        if max_tokens <= 0 or self.kv.num_blocks_for(num_prompt + max_tokens) > self.kv_cache.num_blocks:
            raise CapacityError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs more KV "
                f"memory than the engine's budget of {self.kv_cache.num_tokens} tokens"
            )
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            detokenizer=Detokenizer(self.tokenizer, sampling.stop),
            kv_transfer_params=request.kv_transfer_params,
            segments=_checked_segments(segments or [], num_prompt),
            scope=request.scope,
            num_exact_tokens=None if request.publish else 0,
            publish=request.publish,
            adapter=served,
            timeline=timeline if timeline is not None else Timeline(),
            background=request.background,
            max_chunk_tokens=request.max_chunk_tokens,
        )
        self._observe_workflow(seq)
        self.scheduler.add(seq)
        return seq

    def _workflow_agent(self, scope: ReuseScope) -> AgentKey | None:
        """The agent the workflow policy tracks a request of `scope` under, if it tracks one
        (a request without a scope has no agent)."""
        if self.config.tiers.policy != "workflow" or scope.agent_id is None:
            return None
        return AgentKey(scope.app_id, scope.agent_id)

    def _observe_workflow(self, seq: Sequence) -> None:
        """Tell the workflow policy the agent's fixed prefix and the plan's steps-to-execution,
        which are its session's: each session (workflow instance) is at its own step."""
        scope = seq.scope
        if scope is None or (agent := self._workflow_agent(scope)) is None:
            return
        fixed = next((s for s in seq.segments if s.kind == "fixed_prefix"), None)
        prefix = tuple(self.kv.prefix_hashes(seq, fixed.end)) if fixed is not None else None
        workflow = scope.workflow
        self.workflows.observe(agent, prefix, workflow.steps_to_execution if workflow is not None else None,
                               scope.session_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.timeline.finished = time.monotonic()
        self.scheduler.finish(seq, reason)
        scope = seq.scope
        if scope is not None and (agent := self._workflow_agent(scope)) is not None:
            self.workflows.finished(agent, scope.session_id)

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    @property
    def has_work(self) -> bool:
        """Requests to run, or KV transfers in flight: step() applies a landed transfer
        (a backed-up block is unpinned, a prefetched prefix published, the next prefetch
        started), so a loop that stops stepping when idle would leave them hanging."""
        return self.scheduler.has_work or (self.tiers is not None and self.tiers.worker.num_in_flight > 0)

    @property
    def has_sequences(self) -> bool:
        """Requests or background sequences to step (`has_work` less the transfers)."""
        return self.scheduler.has_work

    @property
    def background_wait_s(self) -> float:
        """Seconds before a waiting background sequence may run (Scheduler.background_wait_s):
        a driver may sleep that long unless a command or a transfer wakes it."""
        return self.scheduler.background_wait_s()

    def wake_on_transfers(self, notify: Callable[[], None]) -> None:
        """For a driver that sleeps on its own queue (AsyncEngine): each KV transfer that
        lands calls `notify` (on the transfer thread), and an empty step no longer waits
        for one. Without it, a step with nothing to run waits up to 5 ms for a transfer,
        and a request arriving meanwhile waited that long: after every answer the host
        tier's backups are in flight, so the next agent's request often did."""
        self._transfer_wait_s = 0.0
        if self.tiers is not None:
            self.tiers.worker.notify = notify

    # -- the loop body ---------------------------------------------------------------
    def step(self, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """One scheduled step. `interrupt` (asked between layers, from the engine thread)
        stops a step of background work alone when a request has arrived: the request then
        waits one layer, not the whole chunk; the chunk is computed again later."""
        self._transfers()
        step = self.scheduler.schedule()
        # Nothing could run: a round held for its siblings, or every waiting prefix still loading.
        self.last_step_empty = step.is_empty
        if step.is_empty:
            self._transfers(timeout=self._transfer_wait_s)  # wake as soon as a load lands, without spinning
            return []
        started = time.monotonic()
        # Prefills around placed KV: once computed (or failed), they let go of what they read.
        placing = [seq for seq, _ in step.chunks if seq.group is not None or seq.placement is not None]
        try:
            run = self.runner.run(step, interrupt)
            for computed_round in run.rounds:  # kept while the segments its members read are still pinned
                self.lifecycle.round_computed(*computed_round)
        except StepInterrupted:
            self.num_interrupted_steps += 1
            return []
        finally:
            for seq in placing:
                self.lifecycle.prefill_done(seq)
        computed = self.runner.last_forward_end  # the forward passes; sampling follows
        self._observe_prefill(step.chunks, computed - started)
        for seq, num_tokens in step.chunks:
            self.kv.computed(seq, seq.num_computed_tokens + num_tokens)
            if seq.timeline.prefilled is None:
                seq.timeline.prefill_steps.append(Interval(started, computed))
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    seq.timeline.prefilled = computed
            self._publish(seq)
            self.lifecycle.after_prefill(seq)
        return [self._append(seq, token) for seq, token in run.sampled]

    def _transfers(self, timeout: float = 0.0) -> None:
        """Apply finished transfers (loaded prefixes become hits, backups unpin), then start
        the prefetches now due. Always both: a load that lands frees the prefetcher's slot,
        and an idle engine whose last load landed without the next one started would stop
        stepping (has_work) with agents still to bring back."""
        if self.tiers is not None:
            self.tiers.poll(timeout)
            if self.prefetcher is not None:
                if due := self.prefetcher.due():  # the reserve is summed only when a load may start
                    self.prefetcher.run(due, self.scheduler.num_blocks_to_finish())

    def _observe_prefill(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        """What TTFT breakdowns price reuse against (engine_ext/timeline.py), before the
        step's chunks count as computed: at a prompt's first step, the longest prefix
        that prefix caching alone would have served then and the price of computing the
        rest; the dense prefill time, from steps of dense prefill chunks alone (a decode
        row or a reused prefill, which computes fewer tokens than its chunk, would skew
        it); and the blocks prefix caching alone would now hold."""
        bs = self.config.block_size
        for seq, _ in chunks:
            if seq.timeline.num_prefix_hit is None:
                exact = self.lifecycle.exact_hit(seq)
                shadow = self.prefix_shadow.hit(self.kv.prefix_hashes(seq, (seq.num_prompt_tokens - 1) // bs * bs))
                hit = max(exact, shadow * bs)
                seq.timeline.baseline(hit, exact, self.prefill_rate.seconds(seq.num_prompt_tokens - hit, hit))
        if all(seq.timeline.prefilled is None and self.lifecycle.runs_dense(seq) for seq, _ in chunks):
            self.prefill_rate.observe([(n, seq.num_computed_tokens) for seq, n in chunks], seconds)
        for seq, n in chunks:
            first, end = seq.num_computed_tokens // bs, (seq.num_computed_tokens + n) // bs
            if seq.publish and end > first:  # blocks this step fills
                self.prefix_shadow.add(self.kv.prefix_hashes(seq, end * bs)[first:])

    def _compute_tail(self, seq: Sequence, end: int) -> bool:
        """Compute the KV of the sequence's tokens up to `end` (its sampled, never
        computed last tokens) and publish it; False when the pool has no room now."""
        num_new = end - seq.num_computed_tokens
        if num_new <= 0:
            return True
        if not self.kv.allocate(seq, num_new):
            return False
        self.runner.compute(seq, num_new)
        self.kv.computed(seq, end)
        self._publish(seq)
        return True

    def _publish(self, seq: Sequence) -> list[Block]:
        """Offer the sequence's newly full blocks to the prefix cache, and back them up
        to the lower KV tiers when there are any."""
        published = self.kv.publish(seq)
        if self.tiers is not None:
            self.tiers.backup(published)
        return published

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.sampling.constraint is not None:
            seq.sampling.constraint.accept(token)
        if seq.timeline.first_token is None:
            seq.timeline.first_token = time.monotonic()
        params = seq.sampling
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        ended_on_token = reason == "stop"
        text = seq.detokenizer.update(seq.output_token_ids, final=reason is not None)
        if text.stopped:
            reason = "stop"
        if reason is not None:
            ending: Ending = "stop_string" if text.stopped else "stop_token" if ended_on_token else "length"
            if (end := self.lifecycle.answer_end(seq, ending)) is not None and self._compute_tail(seq, end):
                self.lifecycle.keep_answer(seq, end)
            self._finish(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=text.delta,
            new_token_ids=[token],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),
            reuse_outcomes=seq.reuse_outcomes,
            timeline=seq.timeline if reason is not None else None,
            prompt_blocks=self.kv.prefix_hashes(seq, seq.num_prompt_tokens) if reason is not None else None,
        )

    # -- convenience for tests and benchmarks ----------------------------------------
    def generate(self, prompt_token_ids: list[int], sampling: SamplingParams,
                 segments: list[TokenSegment] | None = None, publish: bool = True,
                 record_logits: bool = False, scope: ReuseScope | None = None,
                 adapter: str | None = None) -> Sequence:
        """Run one request to completion synchronously (seq.logits holds each step's
        logits when record_logits is set)."""
        seq = self.add_request(EngineRequest(f"gen-{uuid.uuid4().hex}", prompt_token_ids, sampling,
                                             segments=segments, publish=publish, scope=scope, adapter=adapter))
        seq.logits = [] if record_logits else None
        while not seq.is_finished:
            self.step()
        return seq

    def score(self, prompt_token_ids: list[int], continuation: list[int],
              segments: list[TokenSegment] | None = None, publish: bool = True,
              scope: ReuseScope | None = None) -> ScoreResult:
        """Teacher-force `continuation` after the prompt: the logits that predicted each
        of its tokens, (len(continuation), vocab), and what reuse did per segment."""
        sampling = SamplingParams(max_tokens=len(continuation), temperature=0.0, ignore_eos=True)
        seq = self.add_request(EngineRequest(f"score-{uuid.uuid4().hex}", prompt_token_ids, sampling,
                                             segments=segments, publish=publish, scope=scope))
        seq.forced_token_ids, seq.logits = list(continuation), []
        while not seq.is_finished:
            self.step()
        return ScoreResult(torch.stack(seq.logits), seq.reuse_outcomes or [])


def _checked_segments(segments: list[TokenSegment], num_prompt: int) -> list[TokenSegment]:
    """Segments must be in order, non-overlapping and inside the prompt."""
    end = 0
    for seg in segments:
        if not end <= seg.start < seg.end <= num_prompt:
            raise InvalidRequestError(f"segment [{seg.start}, {seg.end}) is out of order or outside "
                                      f"the prompt of {num_prompt} tokens", param="kv_transfer_params")
        if seg.method is not None and seg.method not in REUSE_METHODS:
            raise InvalidRequestError(f"unknown reuse method {seg.method!r}", param="kv_transfer_params")
        end = seg.end
    return list(segments)
