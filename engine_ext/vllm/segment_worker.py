"""SegmentWorker: the worker-side half of approximate segment reuse inside vLLM.

It keeps segments (SegmentSave: copied out of vLLM's cache at once, written in the
background; SegmentDelete) and runs ReuseJobs (ModelBridge) on the copier's one ordered
thread, so a job runs after the tier loads of its own request and after the writes of
the segments it reads. kvrelay's model is loaded on the first job: a replica whose apps
never opt into approximation never pays for it.

A job that fails for any reason (a segment file gone or cut short, the layout check)
reports the request's claimed blocks as failed; vLLM then computes them itself, so a
failure costs time, never a wrong answer beyond the approximation the app opted into.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import torch

from engine_ext.config import ModelConfig
from engine_ext.vllm.bridge import LayoutMismatch, ModelBridge, SegmentKV
from engine_ext.vllm.files import BlockFiles
from engine_ext.vllm.paged import PagedKV
from engine_ext.vllm.segment_plan import PlacedSpan, ReuseJob, SegmentDelete, SegmentSave

log = logging.getLogger(__name__)


class SegmentWorker:
    def __init__(self, files: BlockFiles, model_dir: Path) -> None:
        self.files = files
        self.model_dir = model_dir
        self.config = ModelConfig.from_dir(model_dir)
        self.paged: PagedKV | None = None
        self._bridge: ModelBridge | None = None
        self._disabled: str | None = None  # why placing is off for this process
        self._lock = threading.Lock()
        self.num_jobs = 0

    def register(self, layers: list[torch.Tensor], num_blocks: int) -> None:
        self.paged = PagedKV(layers, num_blocks, self.config.num_kv_heads, self.config.head_dim)

    def save(self, op: SegmentSave) -> torch.Tensor:
        """Copy the segment out of vLLM's cache now (its blocks may be reused after this
        step); the caller writes the returned (2, L, n, H, D) tensor in the background."""
        paged = self._paged
        pairs = [paged.read(layer, op.block_ids, op.start, op.end) for layer in range(len(paged.layers))]
        return torch.stack((torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs]))).cpu()

    def write(self, op: SegmentSave, data: torch.Tensor) -> None:
        """Background thread: store the segment; the first one vLLM computed also checks
        vLLM's cache layout (so a later claim that starts at position 0 can be trusted)."""
        self.files.write(op.key, data)
        if op.token_ids and self._disabled is None and (self._bridge is None or not self._bridge.checked):
            with suppress(LayoutMismatch):  # logged, and placement is now off: no answer depends on it
                self._checked(self._load_bridge().check_layer0, op.token_ids, op.start, data[0][0], data[1][0])

    def delete(self, op: SegmentDelete) -> None:
        self.files.delete(op.key)

    def run(self, job: ReuseJob) -> None:
        """Fill the job's claim; raises on any failure (the caller fails its blocks)."""
        if self._disabled is not None:
            raise LayoutMismatch(self._disabled)
        bridge = self._bridge_for(job)
        segments = [self._read(span) for span in job.spans]
        bridge.run(job, segments)
        self.num_jobs += 1

    def _read(self, span: PlacedSpan) -> SegmentKV:
        cfg = self.config
        shape = (2, cfg.num_layers, span.num_stored, cfg.num_kv_heads, cfg.head_dim)
        data = self.files.read(span.key, shape, self._paged.layers[0].dtype).float()
        return SegmentKV(data[0], data[1], span.position)

    def _load_bridge(self) -> ModelBridge:
        with self._lock:
            if self._bridge is None:
                log.info("kvrelay connector: loading kvrelay's model for segment placement from %s", self.model_dir)
                self._bridge = ModelBridge.load(self.model_dir, self._paged)
            return self._bridge

    def _bridge_for(self, job: ReuseJob) -> ModelBridge:
        bridge = self._load_bridge()
        with self._lock:
            if not bridge.checked:
                if job.num_computed == 0:
                    raise LayoutMismatch("no computed tokens to check vLLM's cache layout against yet")
                self._checked(bridge.check_layout, job.token_ids[: job.num_computed], job.block_ids)
            return bridge

    def _checked(self, check: Callable[..., None], *args: object) -> None:
        """Run a layout check; a mismatch turns placement off for the process, logged once."""
        try:
            check(*args)
        except LayoutMismatch as exc:
            self._disabled = str(exc)
            log.warning("kvrelay connector: %s", exc)
            raise

    @property
    def _paged(self) -> PagedKV:
        if self.paged is None:
            raise RuntimeError("kvrelay connector: vLLM has not registered its KV caches yet")
        return self.paged
