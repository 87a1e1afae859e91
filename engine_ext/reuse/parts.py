"""ReuseParts: the optional pieces of reuse beyond the prefix cache, built once per engine.

Which pieces exist depends on the config and the model (segment reuse needs a RoPE the
shifter can move; TokenDance's collective prefill and diff store need segment reuse).
Built here, in one place, so the engine and the ReuseLifecycle only ask whether a piece
exists, never how to make it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from engine_ext.collective import RECOVERIES, CollectivePrefill, KVCollector
from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.diffs import DiffStore, Restorer
from engine_ext.errors import ModelLoadError
from engine_ext.kv import KVCache, KVCacheManager
from engine_ext.kv.segment_index import SegmentIndex
from engine_ext.kvcomm import AnchorBank
from engine_ext.model import CausalLM
from engine_ext.reuse.assembler import Assembler
from engine_ext.reuse.prefill import ReusePrefill
from engine_ext.rope import RopeShifter, RopeShiftError

logger = logging.getLogger(__name__)


class ReuseParts(NamedTuple):
    segment_index: SegmentIndex | None  # None: every segment is computed densely
    anchor_bank: AnchorBank | None  # KVCOMM's anchors (engine_ext/kvcomm)
    assembler: Assembler  # always there: without an index it says why each segment is dense
    reuse_prefill: ReusePrefill | None  # the prefill around placed segments
    collector: KVCollector | None  # TokenDance: groups a round's waiting requests
    collective: CollectivePrefill | None  # TokenDance: one prefill for a round group
    diff_store: DiffStore | None  # round caches, master and mirrors (engine_ext/diffs)
    restorer: Restorer | None  # serves prompts that extend a stored round cache


def build_parts(model: CausalLM, model_config: ModelConfig, kv_cache: KVCache, kv: KVCacheManager,
                config: EngineConfig, model_name: str) -> ReuseParts:
    index, no_index_reason = _segment_index(model_config, kv_cache, kv, config, model_name)
    reuse = config.reuse
    bank = AnchorBank(reuse.anchors, index, kv_cache, model_name) if index else None
    assembler = Assembler(reuse, index, no_index_reason, bank)
    prefill = ReusePrefill(model, kv_cache, index, reuse) if index else None
    settings = reuse.collective
    if index is None or not settings.enabled:
        return ReuseParts(index, bank, assembler, prefill, None, None, None, None)
    recovery = RECOVERIES[settings.recovery](model, kv_cache, reuse.check_layers)
    collective = CollectivePrefill(model, kv_cache, index, reuse, recovery)
    if not settings.diff_store:
        return ReuseParts(index, bank, assembler, prefill, KVCollector(settings), collective, None, None)
    store = DiffStore(index.blobs, kv_cache, index.shifter.inv_freq, model_name, settings.diff_block_tokens,
                      settings.diff_tolerance)
    restorer = Restorer(store, kv_cache, reuse.default_method)
    return ReuseParts(index, bank, assembler, prefill, KVCollector(settings), collective, store, restorer)


def _segment_index(model_config: ModelConfig, kv_cache: KVCache, kv: KVCacheManager, config: EngineConfig,
                   model_name: str) -> tuple[SegmentIndex | None, str | None]:
    """The segment index, or None with the reason every segment will be computed densely."""
    reuse = config.reuse
    if not reuse.enabled:
        return None, "segment reuse is disabled (reuse.enabled=false)"
    if max(reuse.check_layers) >= model_config.num_layers:
        raise ModelLoadError(f"reuse.check_layers {reuse.check_layers} name a layer the model lacks "
                             f"(it has {model_config.num_layers})")
    try:
        shifter = RopeShifter.for_model(model_config)
    except RopeShiftError as exc:
        logger.warning("segment reuse off: %s", exc)
        return None, str(exc)
    return SegmentIndex(kv.pool, kv_cache, shifter, model_name), None
