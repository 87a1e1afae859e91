"""LLMEngine: admit requests, run steps, report per-request progress. Synchronous and
single-threaded by design; `AsyncEngine` drives it from a background thread."""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine_ext.adapters.registry import AdapterRegistry
from engine_ext.collective import RECOVERIES, CollectivePrefill, KVCollector
from engine_ext.config import TORCH_DTYPES, EngineConfig, ModelConfig
from engine_ext.diffs import CacheImage, DiffStore, Restorer
from engine_ext.detokenizer import Detokenizer
from engine_ext.errors import (
    CapacityError,
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
)
from engine_ext.kv import KVCache, KVCacheManager
from engine_ext.kv.segment_index import SegmentIndex
from engine_ext.kvcomm import AnchorBank
from engine_ext.model import load_model
from engine_ext.model_runner import ModelRunner
from engine_ext.reuse.answers import Ending, answer_tokens
from engine_ext.reuse.assembler import Assembler
from engine_ext.reuse.prefill import ReusePrefill
from engine_ext.reuse.segments import (
    REUSE_METHODS,
    ReuseScope,
    SegmentOutcome,
    TokenSegment,
)
from engine_ext.rope import RopeShifter, RopeShiftError
from engine_ext.sampling import Sampler, SamplingParams
from engine_ext.scheduler import ScheduledChunk, Scheduler
from engine_ext.sequence import Sequence
from engine_ext.tiers import AgentKey, Prefetcher, TieredStore, WorkflowPolicy, WorkflowTable, with_sized_host_tier
from engine_ext.timeline import Interval, PrefillRate, PrefixShadow, Timeline
from engine_ext.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PLACED_METHODS = frozenset({"shift", "blend", "link", "kvcomm"})  # their reused tokens count as cached


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


class ScoreResult(NamedTuple):
    logits: torch.Tensor  # (num_tokens, vocab)
    reuse_outcomes: list[SegmentOutcome]


class LLMEngine:
    def __init__(self, model_dir: Path, config: EngineConfig, model_name: str | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, self.model_config, config.dtype)
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
        self.segment_index, no_index_reason = self._segment_index()
        self.anchor_bank = (AnchorBank(config.reuse.anchors, self.segment_index, self.kv_cache, self.model_name)
                            if self.segment_index else None)
        self.assembler = Assembler(config.reuse, self.segment_index, no_index_reason, self.anchor_bank)
        reuse = (ReusePrefill(self.model, self.kv_cache, self.segment_index, config.reuse)
                 if self.segment_index else None)
        self.collector, collective, self.diff_store, restorer = self._collective()
        self.last_step_empty = False
        # TTFT breakdowns price reuse against prefix caching alone: its dense prefill time,
        # and the prefix cache it would hold (engine_ext/timeline.py).
        self.prefill_rate = PrefillRate(config.max_num_batched_tokens)
        self.prefix_shadow = PrefixShadow(self.kv_cache.num_blocks)
        self.scheduler = Scheduler(config, self.kv, self.assembler, self.collector, restorer, self.tiers)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv, Sampler(), reuse, self.assembler,
                                  collective, self.diff_store)
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

    def _segment_index(self) -> tuple[SegmentIndex | None, str | None]:
        """The segment index, or None with the reason every segment will be computed densely."""
        reuse = self.config.reuse
        if not reuse.enabled:
            return None, "segment reuse is disabled (reuse.enabled=false)"
        if max(reuse.check_layers) >= self.model_config.num_layers:
            raise ModelLoadError(f"reuse.check_layers {reuse.check_layers} name a layer the model lacks "
                                 f"(it has {self.model_config.num_layers})")
        try:
            shifter = RopeShifter.for_model(self.model_config)
        except RopeShiftError as exc:
            logger.warning("segment reuse off: %s", exc)
            return None, str(exc)
        return SegmentIndex(self.kv.pool, self.kv_cache, shifter, self.model_name), None

    def _collective(self) -> tuple[KVCollector | None, CollectivePrefill | None, DiffStore | None, Restorer | None]:
        """TokenDance's parts (collector, collective prefill, diff store, restorer), when segment reuse is on."""
        settings = self.config.reuse.collective
        if self.segment_index is None or not settings.enabled:
            return None, None, None, None
        recovery = RECOVERIES[settings.recovery](self.model, self.kv_cache, self.config.reuse.check_layers)
        collective = CollectivePrefill(self.model, self.kv_cache, self.segment_index, self.config.reuse, recovery)
        if not settings.diff_store:
            return KVCollector(settings), collective, None, None
        store = DiffStore(self.segment_index.blobs, self.kv_cache, self.segment_index.shifter.inv_freq,
                          self.model_name, settings.diff_block_tokens, settings.diff_tolerance)
        return KVCollector(settings), collective, store, Restorer(store, self.kv_cache, self.config.reuse.default_method)

    def _tiers(self) -> tuple[TieredStore | None, Prefetcher | None]:
        """KVFlow's lower KV tiers and prefetcher, when configured. An automatic host tier
        is sized here (engine_ext/tiers/sizing.py), and the engine's config says its size."""
        self.config = with_sized_host_tier(self.config, self.kv_cache.bytes_per_block)
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
                                 settings.max_prefetches, lambda: self.scheduler.num_blocks_to_finish())

    def close(self) -> None:
        """Stop the KV transfer worker (the engine serves nothing afterwards)."""
        if self.tiers is not None:
            self.tiers.close()

    # -- admission -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        segments: list[TokenSegment] | None = None,
        publish: bool = True,
        scope: ReuseScope | None = None,
        adapter: str | None = None,
        timeline: Timeline | None = None,
    ) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError subclasses.

        `segments` (token ranges of the prompt, from the plan) enable reuse beyond the
        prefix cache, `scope` (the plan's app and agent) KVCOMM's anchors;
        `publish=False` keeps this request's blocks out of the prefix cache; `adapter`
        names a served LoRA adapter (engine_ext/adapters); `timeline` is the caller's,
        stamped from when it asked (a server's queue to the engine thread is queue time)."""
        served = self.adapters.get(adapter) if adapter is not None else None
        if served is not None and not served.is_icarus:
            segments = None  # cached segments hold the base model's K/V, not this adapter's
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
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
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            detokenizer=Detokenizer(self.tokenizer, sampling.stop),
            kv_transfer_params=kv_transfer_params,
            segments=_checked_segments(segments or [], num_prompt),
            scope=scope,
            num_exact_tokens=None if publish else 0,
            publish=publish,
            adapter=served,
            timeline=timeline,
        )
        self._observe_workflow(seq)
        self.scheduler.add(seq)
        return seq

    def _workflow_agent(self, seq: Sequence) -> AgentKey | None:
        """The agent the workflow policy tracks this request under, if it tracks one."""
        scope = seq.scope
        if self.config.tiers.policy != "workflow" or scope is None or scope.agent_id is None:
            return None
        return AgentKey(scope.app_id, scope.agent_id)

    def _observe_workflow(self, seq: Sequence) -> None:
        """Tell the workflow policy the agent's fixed prefix and the plan's steps-to-execution,
        which are its session's: each session (workflow instance) is at its own step."""
        agent = self._workflow_agent(seq)
        if agent is None:
            return
        fixed = next((s for s in seq.segments if s.kind == "fixed_prefix"), None)
        prefix = tuple(self.kv.prefix_hashes(seq, fixed.end)) if fixed is not None else None
        workflow = seq.scope.workflow
        self.workflows.observe(agent, prefix, workflow.steps_to_execution if workflow is not None else None,
                               seq.scope.session_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.timeline.finished = time.monotonic()
        self.scheduler.finish(seq, reason)
        agent = self._workflow_agent(seq)
        if agent is not None:
            self.workflows.finished(agent, seq.scope.session_id)

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

    # -- the loop body ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._transfers()
        step = self.scheduler.schedule()
        # Nothing could run: a round held for its siblings, or every waiting prefix still loading.
        self.last_step_empty = step.is_empty
        if step.is_empty:
            self._transfers(timeout=0.005)  # wake as soon as a load lands, without spinning
            return []
        started = time.monotonic()
        sampled = self.runner.run(step)
        computed = self.runner.last_forward_end  # the forward passes; sampling follows
        self._observe_prefill(step.chunks, computed - started)
        for seq, num_tokens in step.chunks:
            seq.num_computed_tokens += num_tokens
            if seq.timeline.prefilled is None:
                seq.timeline.prefill_steps.append(Interval(started, computed))
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    seq.timeline.prefilled = computed
            published = self.kv.publish(seq)
            if self.tiers is not None:
                self.tiers.backup(published)
            if seq.segments and seq.reuse_outcomes is None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                kept = time.monotonic()
                self._after_prefill(seq)
                seq.timeline.keep_s = time.monotonic() - kept  # reuse's bookkeeping, before its first token
        return [self._append(seq, token) for seq, token in sampled]

    def _transfers(self, timeout: float = 0.0) -> None:
        """Apply finished transfers (loaded prefixes become hits, backups unpin), then start
        the prefetches now due. Always both: a load that lands frees the prefetcher's slot,
        and an idle engine whose last load landed without the next one started would stop
        stepping (has_work) with agents still to bring back."""
        if self.tiers is not None:
            self.tiers.poll(timeout)
            if self.prefetcher is not None:
                self.prefetcher.run()

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
                exact = seq.restore.region_start if seq.restore is not None else seq.num_cached_tokens
                shadow = self.prefix_shadow.hit(self.kv.prefix_hashes(seq, (seq.num_prompt_tokens - 1) // bs * bs))
                hit = max(exact, shadow * bs)
                seq.timeline.baseline(hit, exact, self.prefill_rate.seconds(seq.num_prompt_tokens - hit, hit))
        if all(seq.timeline.prefilled is None and "collective" not in seq.timeline.assembly and
               (seq.assembly is None or not seq.assembly.placed) for seq, _ in chunks):
            self.prefill_rate.observe([(n, seq.num_computed_tokens) for seq, n in chunks], seconds)
        for seq, n in chunks:
            first, end = seq.num_computed_tokens // bs, (seq.num_computed_tokens + n) // bs
            if seq.publish and end > first:  # blocks this step fills
                self.prefix_shadow.add(self.kv.prefix_hashes(seq, end * bs)[first:])

    def _after_prefill(self, seq: Sequence) -> None:
        """Record what each segment got, and keep the reusable ones in the segment index."""
        assembly = seq.assembly  # set at admission for every sequence with segments
        seq.reuse_outcomes = assembly.outcomes()
        seq.assembly = None
        if seq.num_preemptions == 0:
            placed = sum(o.num_reused for o in seq.reuse_outcomes if o.method in PLACED_METHODS)
            seq.num_cached_tokens = assembly.num_prefix_tokens + placed
        if self.segment_index is None:
            return
        slots = self.kv.slots(seq, seq.num_prompt_tokens)  # (P,)
        for seg in seq.segments if self._keeps_segments(seq) else ():
            if seg.is_reusable and seg.num_tokens >= self.config.reuse.min_segment_tokens:
                self.segment_index.register(seq.token_ids[seg.start : seg.end], slots[seg.start : seg.end], seg.start,
                                            seq.tenant)
        self.assembler.commit(assembly, slots)
        self.assembler.release(assembly)
        approximate = seq.restore is not None or bool(assembly.placed)
        if approximate and assembly.collective is None:  # a round group stored itself already
            self._store_turn(seq, slots)

    def _store_turn(self, seq: Sequence, slots: torch.Tensor) -> None:
        """Keep a prompt that holds approximate KV (placed segments, or a restored round
        cache): its blocks from the first approximate token on are never published, so
        without this the agent's next turn, which extends this prompt, would lose its
        prefix hits there and compute (or place) all of it again. Stored, it restores
        the KV this prompt ran on. A mirror of the cache it was restored from when there
        is one. Only an optimisation: a failure is logged."""
        if self.diff_store is None or not seq.publish:
            return
        region_start = seq.num_exact_tokens // self.config.block_size * self.config.block_size
        spans = tuple((seg.start, seg.end) for seg in seq.segments)
        image = CacheImage(tuple(seq.prompt_token_ids), slots, region_start, [], spans, seq.tenant)
        try:
            self.diff_store.store(image, like=seq.restore.stored if seq.restore is not None else None)
        except Exception:
            logger.exception("storing request %s's turn failed; it goes on without it", seq.request_id)

    def _keeps_segments(self, seq: Sequence) -> bool:
        """Whether this request's segments and answer go into the segment index. Only
        approximate methods ever read it, so a request keeps them only when it opted
        into one (its plan, or this engine's default): an exact app pays nothing for
        reuse it never makes (copying its KV into the index, an extra row per answer
        cut by length). An app that opts in starts filling the index with its first
        opted-in request."""
        if self.config.reuse.default_method in PLACED_METHODS:
            return True
        return any(seg.method in PLACED_METHODS for seg in seq.segments)

    def _register_output(self, seq: Sequence, ending: Ending) -> None:
        """Keep a finished answer as a segment: the next agent reading it reuses its KV
        without ever prefilling it alone. The tokens kept are exactly the answer's text
        (engine_ext/reuse/answers.py); a last token that was sampled but never computed
        (an answer cut by length) is computed first, in one row of its own."""
        if (self.segment_index is None or not self.config.reuse.register_outputs or not seq.segments
                or not self._keeps_segments(seq)):
            return
        count = answer_tokens(seq.output_token_ids, seq.detokenizer.text, ending, self.tokenizer)
        if count < self.config.reuse.min_segment_tokens:
            return
        start = seq.num_prompt_tokens
        end = start + count
        if end > seq.num_computed_tokens and not self._compute_tail(seq, end):
            return
        slots = self.kv.slots(seq, end)[start:]  # (n,)
        self.segment_index.register(seq.token_ids[start:end], slots, start, seq.tenant)

    def _compute_tail(self, seq: Sequence, end: int) -> bool:
        """Compute the KV of the sequence's tokens up to `end` (its sampled, never
        computed last tokens) and publish it; False when the pool has no room now."""
        num_new = end - seq.num_computed_tokens
        if not self.kv.allocate(seq, num_new):
            return False
        self.runner.compute(seq, num_new)
        seq.num_computed_tokens = end
        published = self.kv.publish(seq)
        if self.tiers is not None:
            self.tiers.backup(published)
        return True

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
            self._register_output(seq, "stop_string" if text.stopped else "stop_token" if ended_on_token else "length")
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
        )

    # -- convenience for tests and benchmarks ----------------------------------------
    def generate(self, prompt_token_ids: list[int], sampling: SamplingParams,
                 segments: list[TokenSegment] | None = None, publish: bool = True,
                 record_logits: bool = False, scope: ReuseScope | None = None,
                 adapter: str | None = None) -> Sequence:
        """Run one request to completion synchronously (seq.logits holds each step's
        logits when record_logits is set)."""
        seq = self.add_request(f"gen-{uuid.uuid4().hex}", prompt_token_ids, sampling,
                               segments=segments, publish=publish, scope=scope, adapter=adapter)
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
        seq = self.add_request(f"score-{uuid.uuid4().hex}", prompt_token_ids, sampling,
                               segments=segments, publish=publish, scope=scope)
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
