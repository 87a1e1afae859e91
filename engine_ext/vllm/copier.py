"""BlockCopier: the worker-side half of the connector (vLLM's Worker process).

It carries out a StepPlan against vLLM's paged KV cache. Loads are asynchronous by
default (`load_async`): the request waits in vLLM's WAITING_FOR_REMOTE_KVS state while
its blocks are read, copied into its own blocks (which no other request reads) by the
background thread, and reported done through `finished_loads`; other requests keep
running meanwhile. Synchronous loads (`load`) run before the forward and are waited for
(vLLM reads those blocks in the same step). Saves copy the blocks
out of vLLM's cache at once (the blocks may be reused by the next step) and leave the
file writes to one background thread, which also runs the moves between tiers; that one
thread runs everything in the order the scheduler issued it, and loads go through it
too, so a load never overtakes the write or the move of the block it reads.

A load that fails (file gone, unreadable, wrong size) reports its vLLM block id, and
vLLM recomputes that block: a missing cache costs time, never a wrong answer. The
forward of that step (and, with async scheduling, of the next) still reads the block
before vLLM reschedules, so nothing that request computes is saved from then on. A
write or move that fails is logged; the scheduler learns of it when a later load of
that block fails.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine_ext.vllm.files import BlockFileError, BlockFiles
from engine_ext.vllm.index import BlockLoad, BlockMove, BlockSave, FileOp, TierName
from engine_ext.vllm.segment_plan import ReuseJob, SegmentDelete, SegmentSave
from engine_ext.vllm.segment_worker import SegmentWorker

log = logging.getLogger(__name__)
MAX_FAILED_REQUESTS = 4096


WorkerOp = FileOp | SegmentSave | SegmentDelete


class BlockCopier:
    def __init__(self, tiers: dict[TierName, BlockFiles], segments: SegmentWorker | None = None) -> None:
        self.tiers = tiers
        self.segments = segments
        self._layers: list[torch.Tensor] = []
        self._block_dim = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-kv-files")
        self._failed_requests: OrderedDict[str, None] = OrderedDict()  # bounded: the newest failures
        # Per request, its asynchronous loads and jobs: the vLLM blocks each fails, and its future.
        self._loading: dict[str, list[tuple[list[int], Future[None]]]] = {}
        self._released: set[str] = set()  # finished requests whose held blocks were copied
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished requests vLLM named (bounded)
        self.num_loaded = 0
        self.num_saved = 0

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """vLLM's per-layer caches. The block index is dim 0 in the CPU layout
        (num_blocks, kv_heads, block_size, 2 * head_dim) and dim 1 in the GPU one
        (2, num_blocks, block_size, kv_heads, head_dim)."""
        self._layers = list(kv_caches.values())
        if self.segments is not None:
            self.segments.register(self._layers, num_blocks)
        shape = self._layers[0].shape
        if shape[0] == num_blocks:
            self._block_dim = 0
        elif len(shape) > 1 and shape[1] == num_blocks:
            self._block_dim = 1
        else:
            raise ValueError(f"kvrelay connector: no block dimension of size {num_blocks} in KV cache {tuple(shape)}")

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer: (num_layers, *one layer's block)."""
        one = self._layers[0].select(self._block_dim, 0).shape
        return (len(self._layers), *one)

    def load(self, loads: list[BlockLoad]) -> set[int]:
        """Copy blocks from the tiers into vLLM's cache; the vLLM block ids that failed."""
        reads = [(load, self._executor.submit(self._read, load)) for load in loads]
        failed: set[int] = set()
        for load, future in reads:
            try:
                data = future.result()  # (L, *block)
            except BlockFileError as exc:
                self._load_failed(load, exc)
                failed.add(load.block_id)
                continue
            self._place(load, data)
        return failed

    def load_async(self, loads: list[BlockLoad]) -> None:
        """Start loading blocks into vLLM's cache in the background (after every write
        and move issued before them); `finished_loads` says when each request's are done."""
        for load in loads:
            self._loading.setdefault(load.request_id, []).append(
                ([load.block_id], self._executor.submit(self._load_one, load)))

    def run_job(self, job: ReuseJob, claimed_blocks: list[int]) -> None:
        """Start a ReuseJob behind everything issued before it (its request's loads
        included); if it fails, `claimed_blocks` are reported failed with the request."""
        segments = self._segments
        self._loading.setdefault(job.request_id, []).append(
            (claimed_blocks, self._executor.submit(segments.run, job)))

    def run_job_now(self, job: ReuseJob, claimed_blocks: list[int]) -> set[int]:
        """Synchronous loads: run the job before the forward; the blocks that failed."""
        try:
            self._executor.submit(self._segments.run, job).result()
        except Exception as exc:  # noqa: BLE001 - any failure means vLLM computes the claim itself
            log.warning("kvrelay connector: computing a claim in vLLM instead: %r", exc)
            return set(claimed_blocks)
        return set()

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """(requests whose asynchronous loads are all done, vLLM block ids that failed among them).
        vLLM needs a request's failed blocks no later than the step that reports it done."""
        done: set[str] = set()
        failed: set[int] = set()
        for request_id, pending in list(self._loading.items()):
            if not all(future.done() for _, future in pending):
                continue
            for block_ids, future in pending:
                exc = future.exception()
                if exc is not None:
                    if not isinstance(exc, BlockFileError):
                        log.warning("kvrelay connector: vLLM computes %d blocks itself after: %r", len(block_ids), exc)
                    failed.update(block_ids)
            done.add(request_id)
            del self._loading[request_id]
        return done, failed

    def save_and_move(self, ops: list[WorkerOp]) -> None:
        """Copy the saved blocks and segments out now; write them and run the moves and
        deletes in the background."""
        for op in ops:
            if isinstance(op, SegmentSave):
                try:
                    self._submit(self._segments.write, op, self._segments.save(op))
                finally:
                    if op.hold:  # copied (or failed): vLLM may free the finished request's blocks
                        self._released.add(op.request_id)
            elif isinstance(op, SegmentDelete):
                self._submit(self._segments.delete, op)
            elif isinstance(op, BlockSave):
                if op.request_id in self._failed_requests:
                    continue  # computed over a block that failed to load; the scheduler drops it too
                data = torch.stack([layer.select(self._block_dim, op.block_id) for layer in self._layers]).cpu()
                self._submit(self._write, op, data)
            else:
                self._submit(self._move, op)

    def released(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests whose answers are copied out; vLLM frees their blocks. Only ids
        vLLM has named as finished (in this call or an earlier one) may be reported."""
        for request_id in finished_req_ids:
            self._finished[request_id] = None
        done = {request_id for request_id in self._released if request_id in self._finished}
        self._released -= done
        for request_id in done:
            del self._finished[request_id]
        while len(self._finished) > MAX_FAILED_REQUESTS:  # the ones never held
            self._finished.popitem(last=False)
        return done

    def drain(self) -> None:
        """Wait for every write and move issued so far."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _submit(self, fn: Callable[..., None], *args: object) -> Future[None]:
        future = self._executor.submit(fn, *args)
        future.add_done_callback(_log_failure)
        return future

    @property
    def _segments(self) -> SegmentWorker:
        if self.segments is None:
            raise RuntimeError("kvrelay connector: segment placement is off in this worker")
        return self.segments

    def _read(self, load: BlockLoad) -> torch.Tensor:
        return self.tiers[load.tier].read(load.block_hash, self.block_shape, self._layers[0].dtype)

    def _load_one(self, load: BlockLoad) -> None:
        """Background thread: one block into vLLM's cache. The block belongs to a request
        that waits for it, so no forward reads it meanwhile."""
        try:
            data = self._read(load)
        except BlockFileError as exc:
            self._load_failed(load, exc)
            raise
        self._place(load, data)

    def _place(self, load: BlockLoad, data: torch.Tensor) -> None:
        for layer, block in zip(self._layers, data, strict=True):  # data: (L, *block)
            layer.select(self._block_dim, load.block_id).copy_(block)
        self.num_loaded += 1

    def _load_failed(self, load: BlockLoad, exc: BlockFileError) -> None:
        log.warning("kvrelay connector: recomputing a block: %s", exc)
        self._failed_requests[load.request_id] = None
        if len(self._failed_requests) > MAX_FAILED_REQUESTS:
            self._failed_requests.popitem(last=False)

    def _write(self, op: BlockSave, data: torch.Tensor) -> None:
        self.tiers[op.tier].write(op.block_hash, data)
        self.num_saved += 1

    def _move(self, op: BlockMove) -> None:
        source = self.tiers[op.source]
        if op.target is None:
            source.delete(op.block_hash)
        else:
            source.move(op.block_hash, self.tiers[op.target])


def _log_failure(future: Future[None]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("kvrelay connector: a KV file operation failed (later loads of the block recompute it): %s", exc)
