"""KvrelayConnector: the KVConnectorBase_V1 subclass vLLM loads (imports vLLM).

vLLM builds one instance per role: in the scheduler process it delegates to a
ConnectorPlanner, in each worker process to a BlockCopier; the StepPlan travels
between them as the step's connector metadata. This module only translates vLLM's
objects into the planner's and copier's terms, so both stay testable without vLLM.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import AutoTokenizer
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_ext.kv.hashing import namespace_root
from kvrelay.wire.seal import PlanSeal
from engine_ext.vllm.config import ConnectorConfig
from engine_ext.vllm.copier import BlockCopier
from engine_ext.vllm.files import BlockFiles
from engine_ext.vllm.locator import PrefixLocator
from engine_ext.vllm.planner import ConnectorPlanner, ScheduledBlocks, StepPlan
from engine_ext.vllm.segment_plan import SegmentPlanner, SegmentSettings, Tokenizer
from engine_ext.vllm.segment_worker import SegmentWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvrelay")  # under vLLM's logger, so its handlers print our lines


@dataclass
class KvrelayMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=lambda: StepPlan([], []))


class KvrelayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError('kvrelay connector: set "kv_load_failure_policy": "recompute" in --kv-transfer-config, '
                             "so a block that cannot be loaded is recomputed instead of failing its request")
        _check_supported(vllm_config, kv_cache_config)
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config, str(transfer.engine_id))
        group = kv_cache_config.kv_cache_groups[0]
        block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)  # all layers of one block
        model, cache = vllm_config.model_config, vllm_config.cache_config
        self.block_size = group.kv_cache_spec.block_size
        # Everything that changes a block's bytes for the same tokens is in its hash.
        tp = vllm_config.parallel_config.tensor_parallel_size
        root = namespace_root(f"vllm|{model.model}|{model.revision}|{model.dtype}|{model.quantization}|"
                              f"{cache.cache_dtype}|{self.block_size}|{block_bytes}|{len(group.layer_names)}|tp{tp}")
        self.shards = [{tier: BlockFiles(path) for tier, path in self.config.shard_dirs(rank, tp).items()}
                       for rank in range(tp)]
        self.planner: ConnectorPlanner | None = None
        self.copier: BlockCopier | None = None
        self._failed_blocks: set[int] = set()
        segment_dir = Path(self.config.host_dir) / "segments"  # not a block file name: the host tier skips it
        placing = self.config.segment_mb > 0 and Path(model.model).is_dir()
        if placing and tp > 1:
            placing = False  # kvrelay's model would have to compute each worker's heads apart
            log.warning("kvrelay connector: segment placement is off under tensor parallelism (one worker only)")
        if role == KVConnectorRole.SCHEDULER:
            # transformers types decode as `str | list[str]` for every input; for one sequence of
            # ids (all the locator and planner pass) it is the str they take.
            tokenizer = cast(Tokenizer, AutoTokenizer.from_pretrained(model.tokenizer,
                                                                      trust_remote_code=model.trust_remote_code))
            settings = SegmentSettings(int(self.config.segment_mb * 2**20 * self.block_size // block_bytes),
                                       self.config.blend_ratio, self.config.check_layer)
            self.planner = ConnectorPlanner(
                self.config, self.block_size, root, PrefixLocator(tokenizer),
                num_host_blocks=int(self.config.host_mb * 2**20 // block_bytes),
                num_disk_blocks=int(self.config.disk_mb * 2**20 // block_bytes),
                seal=PlanSeal.from_env(),
                segments=SegmentPlanner(tokenizer, root, settings) if placing else None)
            self._adopt_files()
        else:
            segments = SegmentWorker(BlockFiles(segment_dir), Path(model.model)) if placing else None
            self.copier = BlockCopier(self.shards[_tensor_parallel_rank() if tp > 1 else 0], segments)
        log.info("kvrelay connector (%s): host %s (%.0f MB), disk %s (%.0f MB), block %d tokens, %d bytes",
                 role.name, self.config.host_dir, self.config.host_mb, self.config.disk_dir, self.config.disk_mb,
                 self.block_size, block_bytes)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is only a later miss

    # Scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _tokens_alone_decide_kv(request):
            return 0, False
        num = self._planner.num_matched_tokens(request.request_id, request.prompt_token_ids or [],
                                               request.kv_transfer_params, num_computed_tokens,
                                               request.block_hashes, request.cache_salt)
        return num, num > 0 and self.config.async_loads

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        sources = self._planner.hit_sources(request.request_id)
        return {CacheHitSource.HOST if tier == "host" else CacheHitSource.DISK: n for tier, n in sources.items()}

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._planner.device.bind(gpu_block_pool)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._planner.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled = [ScheduledBlocks(new.req_id, list(new.block_ids[0]), True, new.num_computed_tokens,
                                     num_scheduled[new.req_id])
                     for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_block_ids = cached.new_block_ids[i]
            scheduled.append(ScheduledBlocks(req_id, list(new_block_ids[0]) if new_block_ids else None,
                                             req_id in cached.resumed_req_ids, cached.num_computed_tokens[i],
                                             num_scheduled[req_id]))
        return KvrelayMetadata(self._planner.step(scheduled))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.invalid_block_ids:
            self._planner.load_failed(set(connector_output.invalid_block_ids))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        held = self._planner.finished(request.request_id, request.output_token_ids, block_ids)
        return held, None  # held: freed once the worker has copied the answer's KV (get_finished)

    # Worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._copier.register(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KvrelayMetadata):
            return
        plan = metadata.plan
        if self.config.async_loads:
            self._copier.load_async(plan.loads)
            for job, claimed in plan.jobs:
                self._copier.run_job(job, claimed)
        else:
            self._failed_blocks |= self._copier.load(plan.loads)
            for job, claimed in plan.jobs:
                self._failed_blocks |= self._copier.run_job_now(job, claimed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished requests whose held blocks may be freed, requests whose asynchronous
        loads are done); failed blocks go out in the same step (get_block_ids_with_load_errors
        is asked right after)."""
        done, failed = self._copier.finished_loads()
        self._failed_blocks |= failed
        return self._copier.released(finished_req_ids) or None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv loaded every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: wait_for_save copies whole blocks of every layer at once."""

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, KvrelayMetadata) and metadata.plan.ops:
            self._copier.save_and_move(metadata.plan.ops)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self.copier is not None:
            self.copier.close()
            if self.config.private_host_dir:  # tmpfs is memory: an engine's own tier goes with it
                shutil.rmtree(self.config.host_dir, ignore_errors=True)

    # Helpers

    @property
    def _planner(self) -> ConnectorPlanner:
        if self.planner is None:
            raise RuntimeError("kvrelay connector: a scheduler-side call on a worker-side connector")
        return self.planner

    @property
    def _copier(self) -> BlockCopier:
        if self.copier is None:
            raise RuntimeError("kvrelay connector: a worker-side call on a scheduler-side connector")
        return self.copier

    def _adopt_files(self) -> None:
        """Start-up: blocks already in the tiers' directories (a restarted replica with
        fixed directories) are kept, newest first, up to each tier's budget, where every
        tensor-parallel worker holds its shard; the rest are deleted. Their sizes are
        checked when they are loaded."""
        for tier in ("host", "disk"):
            shards = [files[tier] for files in self.shards]
            for files in shards:
                files.clear_partial()
            everywhere = set.intersection(*(set(files.hashes()) for files in shards))
            found = [block_hash for block_hash in shards[0].hashes() if block_hash in everywhere]  # oldest first
            num_drop = max(0, len(found) - self._planner.index.capacity[tier])
            kept = {block_hash for block_hash in found[num_drop:] if self._planner.index.adopt(block_hash, tier)}
            for files in shards:  # too many, a move cut short (in both tiers), or a shard missing
                for block_hash in set(files.hashes()) - kept:
                    files.delete(block_hash)
            if kept:
                log.info("kvrelay connector: kept %d %s blocks from an earlier run", len(kept), tier)


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse what the connector would get wrong rather than serve wrong KV."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("kvrelay connector: pipeline parallelism is not supported (tensor parallelism is: "
                         "each worker keeps its own shard of every block)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("kvrelay connector: only models with one full-attention KV cache group are supported "
                         "(no sliding window, no hybrid attention)")


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    rank: int = get_tensor_model_parallel_rank()  # vLLM is untyped (Any) where it is absent
    return rank


def _tokens_alone_decide_kv(request: Request) -> bool:
    """Whether a block's KV is a function of its tokens (and the model) alone: not with a
    LoRA adapter, multimodal inputs or prompt embeddings. (A cache salt changes who may
    share the KV, not the KV: the tiers key blocks by tenant and salt.)"""
    return not (request.lora_request or request.mm_features or request.prompt_embeds is not None)
