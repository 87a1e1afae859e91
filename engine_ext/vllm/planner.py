"""ConnectorPlanner: the scheduler-side half of the connector (vLLM's EngineCore process).

For each request that carries a kvrelay plan it learns the agent's fixed prefix (the
full vLLM blocks inside the plan's fixed_prefix segment) and the workflow's
steps-to-execution; it answers vLLM's "how many more prompt tokens can you supply?"
from the tiers' index, turns vLLM's block allocation into loads, saves each prefix block
once vLLM has computed it, and moves the prefixes of the agents due next from disk to
host. Requests without a plan are left to vLLM alone: the connector changes nothing
for a client that does not go through the gateway.

The planner never touches KV: every decision comes out as a StepPlan that the
connector ships to the worker inside vLLM's connector metadata.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from pydantic import ValidationError

from engine_ext.kv.hashing import DEFAULT_TENANT, block_hashes, tenant_root
from kvrelay.wire.salt import salted_tenant
from kvrelay.wire.seal import SEAL_KEY, PlanSeal
from kvrelay.wire.plan import PLAN_KEY, SegmentPlan, read_plan
from engine_ext.tiers.policy import WorkflowPolicy
from engine_ext.tiers.workflow import AgentKey, WorkflowTable
from engine_ext.vllm.config import ConnectorConfig
from engine_ext.vllm.device import DeviceOrder
from engine_ext.vllm.index import BlockLoad, FileOp, TierIndex, TierName
from engine_ext.vllm.locator import PrefixLocator
from engine_ext.vllm.segment_plan import (
    PLACING_METHODS,
    Placement,
    ReuseJob,
    SegmentDelete,
    SegmentPlanner,
    SegmentSave,
)

log = logging.getLogger(__name__)


class StepPlan(NamedTuple):
    loads: list[BlockLoad]  # before the forward
    ops: list[FileOp | SegmentSave | SegmentDelete]  # saves, moves and deletes, in order, after the forward
    jobs: tuple[tuple[ReuseJob, list[int]], ...] = ()  # after the loads: each with the blocks it fills


class ScheduledBlocks(NamedTuple):
    """One scheduled request in a step, as vLLM's SchedulerOutput describes it."""

    request_id: str
    block_ids: list[int] | None  # new blocks (all of them when `replace`); None: no change
    replace: bool  # a new or resumed request: block_ids is its whole block table
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class PlannedRequest:
    agent: AgentKey | None
    hashes: list[bytes]  # every full block of the prompt but its last token
    prefix: tuple[bytes, ...]  # the fixed prefix's full blocks (a prefix of `hashes`)
    session: str | None = None  # the workflow instance whose steps-to-execution the plan gave
    block_ids: list[int] = field(default_factory=list)
    num_hit_blocks: int = 0  # leading blocks vLLM or the tiers hold, at the last lookup
    num_settled: int = 0  # prefix blocks kept or saved so far
    saved: list[bytes] = field(default_factory=list)  # blocks this request's computation was saved as
    loaded: Counter[TierName] = field(default_factory=Counter)  # blocks loaded, per tier
    failed: bool = False  # a load failed: its KV from then on is not trusted, nothing more is saved
    # Approximate segment reuse (engine_ext/vllm/segment_plan.py), for apps that opted in:
    tenant: str = DEFAULT_TENANT
    plan: SegmentPlan | None = None  # set when the plan names a placing method
    token_ids: list[int] = field(default_factory=list)
    num_local: int = 0  # vLLM's own hit at the last lookup
    placement: Placement | None = None
    num_harvested: int = 0  # placement.harvest entries saved so far
    approx_from: int | None = None  # first position whose KV is approximate: kept out of vLLM's prefix cache


@dataclass
class PlannerStats:
    num_requests: int = 0  # with a plan
    num_loaded_blocks: int = 0
    num_saved_blocks: int = 0
    num_promoted_blocks: int = 0
    num_failed_loads: int = 0


class ConnectorPlanner:
    def __init__(self, config: ConnectorConfig, block_size: int, root: bytes, locator: PrefixLocator,
                 num_host_blocks: int, num_disk_blocks: int, seal: PlanSeal | None = None,
                 segments: SegmentPlanner | None = None) -> None:
        self.config = config
        self.segments = segments  # None: approximate placement off
        self.seal = seal  # with one, only the gateway's sealed plans are followed (kvrelay/wire/seal.py)
        self.block_size = block_size
        self.root = root
        self.locator = locator
        self.table = WorkflowTable(config.workflow_idle_s)
        self.policy = WorkflowPolicy(self.table)
        self.index = TierIndex(num_host_blocks, num_disk_blocks, self.policy)
        self.device = DeviceOrder(self.table)  # bound to vLLM's BlockPool by the connector
        self._reorder_due = False  # a request finished: its blocks reach vLLM's free queue after the step
        self.stats = PlannerStats()
        self._requests: dict[str, PlannedRequest] = {}
        self._loads: list[BlockLoad] = []  # allocated since the last step
        # Ops for the next step: files of dropped blocks and segments to delete, answers to keep.
        self._pending: list[FileOp | SegmentSave | SegmentDelete] = []
        # Per step, vLLM block id -> load: a failure comes back one or two steps later
        # (async scheduling); more in flight only loses a chance to clean up early.
        self._recent_loads: deque[dict[int, BlockLoad]] = deque(maxlen=4)
        self._jobs: list[tuple[ReuseJob, list[int]]] = []  # claims allocated since the last step
        self._recent_claims: deque[dict[int, ReuseJob]] = deque(maxlen=4)  # block id -> its job, per step

    def num_matched_tokens(self, request_id: str, token_ids: Sequence[int], params: dict[str, Any] | None,
                           num_computed_tokens: int, device_hashes: Sequence[Hashable] = (),
                           salt: str | None = None) -> int:
        """Prompt tokens past `num_computed_tokens` (vLLM's own hits, block-aligned) whose
        KV the tiers hold, in whole blocks, never the last prompt token. `device_hashes`:
        vLLM's own hashes of the prompt's full blocks (for DeviceOrder); `salt`: the
        request's cache_salt, which splits its tenant's blocks as it splits vLLM's."""
        if self._reorder_due and self.config.device_order:  # before vLLM allocates for this step
            self._reorder_due = False
            self.device.reorder()
        state = self._requests.get(request_id)
        if state is None:
            state = self._admit(request_id, list(token_ids), params, device_hashes, salt)
        if state is None or state.failed:
            return 0
        num_hits = num_computed_tokens // self.block_size  # vLLM holds these itself
        while num_hits < len(state.hashes) and self.index.where(state.hashes[num_hits]) is not None:
            num_hits += 1
        state.num_hit_blocks = num_hits
        state.num_local = num_computed_tokens
        held = max(num_hits * self.block_size, num_computed_tokens)
        if self.segments is not None and state.plan is not None:
            state.placement = self.segments.place(state.tenant, state.token_ids, state.plan, held)
            if state.placement is not None and state.placement.spans:
                return state.placement.end - num_computed_tokens  # the worker fills the claim
        return held - num_computed_tokens

    def allocated(self, request_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks; `num_external_tokens` past its own hit come
        from the tiers (whole blocks) and then, when segments are placed, the claim."""
        state = self._requests.get(request_id)
        if state is None or num_external_tokens <= 0:
            return
        first = state.num_local // self.block_size
        last = max(first, state.num_hit_blocks)
        placement, segments = state.placement, self.segments
        state.num_harvested = 0
        if placement and placement.spans and segments and state.num_local + num_external_tokens == placement.end:
            held = max(last * self.block_size, state.num_local)
            job = segments.job(request_id, placement, state.token_ids, block_ids, held)
            self._jobs.append((job, block_ids[held // self.block_size : (placement.end - 1) // self.block_size + 1]))
            state.approx_from = placement.spans[0].start
        state.loaded = Counter()  # this admission's loads (a preempted request is admitted again)
        for i in range(first, last):
            block_hash = state.hashes[i]
            # The index only changes in step(), after every allocation of the pass, so the
            # block is still there; were it not, the worker finds no file and vLLM recomputes.
            tier = self.index.where(block_hash) or "disk"
            self._loads.append(BlockLoad(block_hash, tier, block_ids[i], request_id))
            state.loaded[tier] += 1
        self.index.touch_chain(state.hashes[first:last])

    def hit_sources(self, request_id: str) -> dict[TierName, int]:
        """Tokens the tiers supplied to the request, per tier."""
        state = self._requests.get(request_id)
        return {} if state is None else {tier: n * self.block_size for tier, n in state.loaded.items() if n}

    def step(self, scheduled: list[ScheduledBlocks]) -> StepPlan:
        """This step's loads, then the saves of prefix blocks computed by its end, then
        the prefetch of the agents due next."""
        ops, self._pending = self._pending, []
        for item in scheduled:
            state = self._requests.get(item.request_id)
            if state is None:
                continue
            if item.block_ids is not None:
                state.block_ids = list(item.block_ids) if item.replace else state.block_ids + list(item.block_ids)
            num_done = item.num_computed_tokens + item.num_scheduled_tokens
            ops += self._settle(item.request_id, state, num_done)
            ops += self._harvest(item.request_id, state, num_done)
            if state.approx_from is not None:  # vLLM publishes full blocks as it computes them
                self.device.unpublish(state.block_ids[state.approx_from // self.block_size :])
        ops += self._prefetch()
        if self.config.device_order:
            self.device.reorder()
        loads, self._loads = self._loads, []
        jobs, self._jobs = self._jobs, []
        self._recent_loads.append({load.block_id: load for load in loads})
        self._recent_claims.append({block_id: job for job, blocks in jobs for block_id in blocks})
        self.stats.num_loaded_blocks += len(loads)
        return StepPlan(loads, ops, tuple(jobs))

    def finished(self, request_id: str, output_ids: Sequence[int] = (), block_ids: Sequence[int] = ()) -> bool:
        """The request is done; True when its answer is being kept from its blocks (vLLM
        must hold them until the worker reports the copy, which the next step makes)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        if state.agent is not None:
            self.table.finished(state.agent, state.session)
            self._reorder_due = True
        if self.segments is None or state.plan is None or state.failed:
            return False
        ops = self.segments.output_finished(request_id, state.tenant, len(state.token_ids), output_ids,
                                            list(block_ids))
        self._pending += ops
        return any(isinstance(op, SegmentSave) for op in ops)

    def load_failed(self, block_ids: set[int]) -> None:
        """The worker could not read these blocks and vLLM recomputes them. Their files go,
        and so does every block the requests concerned saved: the worker stopped saving
        them (what they computed after the failure read a bad block), and one they did
        save is cheaper to recompute later than to tell apart. A block id found in
        several recent steps drops each candidate: a good block lost is only a miss. A
        failed claim drops the segments its job read."""
        for claims in self._recent_claims:
            for job in {id(claims[b]): claims[b] for b in block_ids & claims.keys()}.values():
                for span in job.spans:
                    self._pending += self.segments.drop(span.key) if self.segments is not None else []
                state = self._requests.get(job.request_id)
                if state is not None:
                    state.failed = True  # its KV is vLLM's own from here on: nothing more is harvested
        for recent in self._recent_loads:
            for block_id in block_ids & recent.keys():
                load = recent[block_id]
                self._pending += self.index.drop(load.block_hash)
                self.stats.num_failed_loads += 1
                state = self._requests.get(load.request_id)
                if state is not None and not state.failed:
                    state.failed = True
                    for block_hash in state.saved:
                        self._pending += self.index.drop(block_hash)

    def _admit(self, request_id: str, token_ids: list[int], params: dict[str, Any] | None,
               device_hashes: Sequence[Hashable], salt: str | None) -> PlannedRequest | None:
        plan = _read_plan(request_id, params, self.seal)
        if plan is None:
            return None
        # The tiers keep each tenant's blocks apart, and each salt's within a tenant.
        tenant = salted_tenant(plan.tenant or plan.app_id or DEFAULT_TENANT, salt)
        hashes = block_hashes(tenant_root(self.root, tenant), token_ids[:-1], self.block_size)
        fixed = next((s for s in plan.segments if s.kind == "fixed_prefix"), None)
        num_prefix = self.locator.num_prefix_blocks(token_ids, fixed, self.block_size) if fixed is not None else 0
        prefix = tuple(hashes[:num_prefix])
        agent = AgentKey(plan.app_id or plan.session_id, plan.agent_id) if plan.agent_id else None
        if agent is not None:
            steps = plan.workflow.steps_to_execution if plan.workflow is not None else None
            self.table.observe(agent, prefix or None, steps, plan.session_id)
            self.device.observe(agent, device_hashes[:num_prefix])
        state = PlannedRequest(agent, hashes, prefix, plan.session_id, tenant=tenant)
        if self.segments is not None and any(seg.method in PLACING_METHODS for seg in plan.segments):
            state.plan, state.token_ids = plan, token_ids  # the app opted into approximate reuse
        self._requests[request_id] = state
        self.stats.num_requests += 1
        return state

    def _settle(self, request_id: str, state: PlannedRequest, num_done_tokens: int) -> list[FileOp]:
        """Save the prefix blocks that are computed by the end of this step."""
        ops: list[FileOp] = []
        if state.failed:
            return ops
        first = state.num_settled
        while state.num_settled < len(state.prefix):
            i = state.num_settled
            if (i + 1) * self.block_size > num_done_tokens or i >= len(state.block_ids):
                break
            saved = self.index.add(state.prefix[i], state.block_ids[i], request_id)
            if saved:
                state.saved.append(state.prefix[i])
                self.stats.num_saved_blocks += 1
            ops += saved
            state.num_settled += 1
        if state.num_settled > first:
            self.index.touch_chain(state.prefix[:state.num_settled])
        return ops

    def _harvest(self, request_id: str, state: PlannedRequest, num_done_tokens: int) -> list[SegmentSave | SegmentDelete]:
        """Keep the quoted answers this request has now computed, for the next prompts."""
        placement = state.placement
        if placement is None or self.segments is None or state.failed:
            return []
        ops: list[SegmentSave | SegmentDelete] = []
        while state.num_harvested < len(placement.harvest):
            start, end, key = placement.harvest[state.num_harvested]
            if end > num_done_tokens or end > len(state.block_ids) * self.block_size:
                break
            ops.append(SegmentSave(key, list(state.block_ids), start, end, request_id,
                                   token_ids=tuple(state.token_ids[start:end])))
            ops += self.segments.saved(key, start, end - start)
            state.num_harvested += 1
        return ops

    def _prefetch(self) -> list[FileOp]:
        """KVFlow's prefetch, one tier up: the disk blocks of agents due within
        `load_ahead` steps move to host, soonest agent first, only into room the
        workflow policy would give up for that agent."""
        ops: list[FileOp] = []
        budget = self.config.max_promotions_per_step
        for upcoming in self.table.upcoming(self.config.load_ahead):
            for block_hash in upcoming.prefix:
                if budget <= 0:
                    return ops
                tier = self.index.where(block_hash)
                if tier is None:
                    break  # the chain is broken here: the blocks after it cannot be hits
                if tier == "host":
                    continue
                moved = self.index.promote(block_hash, partial(self.policy.spares, steps=upcoming.steps))
                if not moved:
                    return ops  # no room for this agent; a later agent has even less claim
                ops += moved
                budget -= 1
                self.stats.num_promoted_blocks += 1
        return ops


def _read_plan(request_id: str, params: dict[str, Any] | None, seal: PlanSeal | None) -> SegmentPlan | None:
    """The request's plan; a malformed one, or with a seal configured one the gateway did
    not seal, is ignored (vLLM then runs the request as it would)."""
    if seal is not None and isinstance(params, dict) and PLAN_KEY in params:
        check = seal.check(params[PLAN_KEY], params.get(SEAL_KEY))
        if not check.accepted:
            log.warning("kvrelay connector: ignoring the %s plan of %s", check.reason, request_id)
            return None
    try:
        return read_plan({"kv_transfer_params": params})
    except ValidationError as exc:
        log.warning("kvrelay connector: ignoring the malformed plan of %s: %s", request_id,
                    str(exc).splitlines()[0])
        return None
