"""AnchorBank: KVCOMM's anchor pools, one per (tenant and app, placeholder name, chunk position), and its two acts.

Samples are chunks. A placeholder on real agent traffic is often a new document far
longer than anything measured before, and the paper's rule (an anchor serves a sample
only when it is at least as long) then leaves it without an eligible anchor, so it is
measured densely every time. So the assembler cuts a placeholder into chunks of
`chunk_tokens` and decides each chunk as a sample of its own, in the pool of its chunk
position: how a text's KV shifts behind another agent's prefix depends on how far the
text has gone from that prefix, and chunk j of one document is the best guide to chunk
j of the next. A chunk position no earlier sample reached (a longer document) is
predicted from the nearest earlier position that has eligible anchors (`fallback`): the
deepest chunks measured describe the deep ones best.

1. `decide`, at admission, for a chunk whose base KV the segment index holds:
   - the chunk is itself an anchor with this agent's offsets: use them alone (exact);
   - else the eligible anchors (at least as long, measured for this agent) are weighed
     by distance; if the entropy criterion holds, the anchors carrying 90% of the
     weight predict the chunk as base + sum of weights x their offsets (weights
     per token, from each one's distance at that token), and the fixed segment after it
     as its base + the same anchors' prefix offsets (whole-sample weights);
   - otherwise the chunk is measured: computed densely here and recorded.
   An anchor of the same text measured for other agents only is not a reason to
   measure: the chunk is predicted from this agent's other anchors like a new text,
   and gains this agent's offsets only when it must be measured anyway.
   Deciding changes nothing, so a request admitted twice (after a failed allocation)
   is decided twice without counting twice.
2. `commit`, once the prompt is computed: activation counts of the anchors a prediction
   used go up, and measured chunks become anchors (or gain this agent's offsets).
   What measuring cost is counted in tokens (`stats`).

All tensors live in cache blocks through a BlobStore: anchors share the engine's one
memory budget and LRU, and an anchor whose blocks were evicted is dropped when next seen.

Offsets are keyed to the exact base they were measured against. The segment index can
evict an entry and register the same tokens again with other KV (EntryIdentity,
kv/segment_index.py), and real - old base added to a new base is no longer the real KV.
So an offset is added to the index's KV only where it was measured against that very
version: an exact anchor's placeholder offsets against the same chunk of the
placeholder's entry, every anchor's prefix offsets against the fixed segment's entry.
Refused ones are counted in the decision's detail (`stale_anchors`,
`stale_prefix_offsets`), never applied silently. An anchor used as a neighbour for
another sample is not refused: its offsets are added to a different text's KV by
design, weighed by the distance from its own base copy, and that copy is the very KV
they were measured against whatever the index holds now.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from engine_ext.config import AnchorConfig
from engine_ext.kv.blobs import Blob, BlobStore
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import DEFAULT_TENANT, chain_hash, namespace_root
from engine_ext.kv.segment_index import EntryIdentity, SegmentEntry, SegmentIndex
from engine_ext.kvcomm import offsets
from engine_ext.kvcomm.anchors import AgentOffsets, Anchor, AnchorPool, SampleIdentity
from engine_ext.kvcomm.criterion import nucleus, predict
from engine_ext.kvcomm.offsets import Correction

PoolKey = tuple[str, str, str, int]  # (tenant, app id, placeholder name, chunk position)


class Decision(NamedTuple):
    """What to do with one chunk of a placeholder (and, for its last chunk, the fixed
    segment after it)."""

    predicted: bool  # False: compute densely and measure
    pool: PoolKey
    agent_id: str
    anchors: list[Anchor]  # predicted from (their activations go up on commit); none when measured
    placeholder: Correction | None
    prefix: Correction | None  # None: the following segment is not corrected
    detail: dict[str, Any]  # reported per placeholder
    prefix_base: EntryIdentity | None = None  # the fixed segment's entry `prefix` was measured against
    num_tokens: int = 0  # the chunk's tokens, when predicted
    source_agent: str | None = None  # whose offsets `anchors` apply (None: `agent_id`'s own)

    @property
    def offsets_agent(self) -> str:
        return self.source_agent or self.agent_id


class Measurement(NamedTuple):
    """A placeholder computed densely whose offsets are recorded after the prefill."""

    decision: Decision
    token_ids: tuple[int, ...]
    position: int  # where the chunk starts in the prompt
    base: SegmentEntry  # the placeholder's entry, pinned until the commit
    prefix_token_ids: tuple[int, ...] | None  # the fixed segment after it, if any (last chunk only)
    prefix_position: int
    tenant: str = DEFAULT_TENANT  # whose segment index holds its prefix
    offset: int = 0  # where the chunk starts within `base`

    @property
    def identity(self) -> SampleIdentity:
        return SampleIdentity(self.base.identity, self.offset)


@dataclass
class _Job:
    """One measured chunk being recorded: what it pins, the blobs allocated for it, and
    the rows of real and base KV whose difference goes into them."""

    m: Measurement
    pool: AnchorPool
    anchor: Anchor | None  # None: a new anchor, whose base is copied in
    stale: Anchor | None  # the anchor it replaces, if any
    prefix_entry: SegmentEntry | None
    pinned: list[Blob]
    new_blobs: list[Blob]  # allocated for it, sealed once written
    base: Blob
    placeholder: Blob
    prefix: Blob | None
    rows: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (real, at, base, out)

    def unpin(self, blobs: BlobStore) -> None:
        for blob in self.pinned:
            blobs.release(blob)
        self.pinned = []

    def undo(self, blobs: BlobStore) -> None:
        """Nothing written: give back its new blobs, unpin the rest."""
        _give_back(blobs, self.new_blobs, self.pinned)
        self.new_blobs, self.pinned = [], []


def _give_back(blobs: BlobStore, new_blobs: list[Blob], pinned: list[Blob]) -> None:
    """Abandon blobs allocated for a chunk that will not be recorded; release its pins."""
    for blob in new_blobs:
        blobs.abandon(blob)
    for blob in pinned:
        blobs.release(blob)


class AnchorBank:
    def __init__(self, config: AnchorConfig, index: SegmentIndex, kv_cache: KVCache, namespace: str) -> None:
        self.config = config
        self.index = index
        self.kv_cache = kv_cache
        self.shifter = index.shifter
        self.blobs = BlobStore(index.pool, kv_cache)
        self.root = namespace_root(f"{namespace}\x00anchor")
        self.pools: dict[PoolKey, AnchorPool] = {}
        self._ids = itertools.count()
        self._blob_ids = itertools.count()
        self.learning = True  # False: decide and predict, but record nothing (frozen pools)
        self.correction = config.correction  # the ablation switch, settable at run time
        self.num_predicted = 0
        self.num_measured = 0
        self.num_predicted_tokens = 0  # placed from anchors
        self.num_measured_tokens = 0  # computed densely to be measured: what learning costs
        self.num_skipped = 0  # measurements not recorded for lack of free blocks

    # -- deciding ----------------------------------------------------------------------
    def decide(self, pool_key: PoolKey, agent_id: str, token_ids: tuple[int, ...], base: SegmentEntry,
               prefix_token_ids: tuple[int, ...] | None, offset: int = 0,
               fallback: tuple[PoolKey, ...] = ()) -> Decision:
        """Predict or measure the chunk `token_ids`, which starts `offset` tokens into the
        index entry `base`. Neighbours come from `pool_key`'s pool or, where it has no
        eligible anchor, from the first of the `fallback` pools that has.

        An exact anchor measured against another version of `base` is refused: treated
        as absent (neither exact nor a neighbour for its own tokens), so the sample is
        predicted from the other anchors or measured, and a measurement then replaces the
        stale anchor in place (`record`). Re-measuring rather than dropping keeps the pool
        useful: until its sample is measured again, the stale anchor still serves other
        samples as a neighbour (its base copy matches its offsets), and the re-measured
        anchor keeps its place and activations, so a recurring sample is not pruned for
        having been evicted from the index."""
        pool = self._pool(pool_key)
        stale: dict[str, int] = {}
        exact = pool.find(token_ids) if pool is not None else None
        refused = None
        if exact is not None and not exact.exact_for(SampleIdentity(base.identity, offset)):
            refused, exact = exact, None
            stale["stale_anchors"] = 1
        prefix_base = self._current(prefix_token_ids, pool_key[0])
        if exact is not None and agent_id in exact.offsets:
            return self._predicted(pool_key, agent_id, [exact], torch.ones(1, len(token_ids)), torch.ones(1),
                                   prefix_token_ids, prefix_base, {"anchor": "exact", "anchors_used": 1})
        if self.config.new_samples == "readers":
            return self._from_readers(pool_key, agent_id, exact, base, len(token_ids), prefix_token_ids,
                                      prefix_base, stale)
        eligible, source = self._eligible((pool_key, *fallback), agent_id, len(token_ids), (exact, refused))
        if not eligible:
            label = "measured" if exact is not None else "new"
            return self._measure(pool_key, agent_id, {"anchor": label, "anchors_used": 0, "eligible": 0, **stale})
        base_slots = self.index.slots(base)[offset : offset + len(token_ids)]  # (n,)
        token_dist = offsets.token_distances(self.kv_cache, base_slots,
                                             [self.blobs.slots(a.base) for a in eligible])  # (A, n)
        pred = predict(offsets.sample_distances(token_dist), self.config.gamma, self.config.temperature)
        detail: dict[str, Any] = {"eligible": len(eligible), "entropy": round(pred.entropy, 4),
                                  "threshold": round(pred.threshold, 4), **stale}
        if source != pool_key:
            detail["from_chunk"] = source[3]
        if not pred.shareable:
            return self._measure(pool_key, agent_id, {"anchor": "new", "anchors_used": 0, **detail})
        # The anchors carrying the weight predict; per token, each weighs by its own distance there.
        used = nucleus(pred.weights)
        token_weights = torch.softmax(-token_dist[used] / self.config.temperature, dim=0)  # (U, n)
        detail = {"anchor": "hit", "anchors_used": len(used), **detail}
        return self._predicted(pool_key, agent_id, [eligible[i] for i in used], token_weights, pred.weights[used],
                               prefix_token_ids, prefix_base, detail)

    def _from_readers(self, pool_key: PoolKey, agent_id: str, exact: Anchor | None, base: SegmentEntry,
                      num_tokens: int, prefix_token_ids: tuple[int, ...] | None,
                      prefix_base: EntryIdentity | None, stale: dict[str, int]) -> Decision:
        """`new_samples="readers"`: serve a sample from KV that a prompt computed.

        Why not predict from other samples' anchors: an answer's base is the KV its writer
        decoded, in an assistant turn, far from what a reader's prompt computes, and the
        offsets of other answers predicted only part of that (on the long review boards,
        placed answers were off by 16-41% of their values against dense, guard KL 0.054),
        while two readers' own KV of one answer differ by 2-5%. So: another reader's
        measured KV of this very sample (its latest), else a base that a prompt computed,
        shifted alone (anchors measured on other texts made such a base worse), else
        measure: this agent computes the answer, and later readers take it from here."""
        if exact is not None and exact.offsets:
            reader = next(reversed(exact.offsets))
            decision = self._predicted(pool_key, reader, [exact], torch.ones(1, num_tokens), torch.ones(1),
                                       prefix_token_ids, prefix_base,
                                       {"anchor": "reader", "anchors_used": 1, **stale})
            return decision._replace(agent_id=agent_id, source_agent=reader)
        if not base.generated:
            return Decision(True, pool_key, agent_id, [], None, None,
                            {"anchor": "shift", "anchors_used": 0, **stale}, num_tokens=num_tokens)
        return self._measure(pool_key, agent_id, {"anchor": "new", "anchors_used": 0, **stale})

    def _pool(self, key: PoolKey) -> AnchorPool | None:
        """The pool of `key`, without the anchors whose blocks were evicted."""
        pool = self.pools.get(key)
        if pool is not None:
            self._drop_invalid(pool)
        return pool

    def _eligible(self, keys: tuple[PoolKey, ...], agent_id: str, num_tokens: int,
                  excluded: tuple[Anchor | None, ...]) -> tuple[list[Anchor], PoolKey]:
        """The eligible anchors of the first pool of `keys` that has any, and its key."""
        for key in keys:
            pool = self._pool(key)
            found = [a for a in pool.eligible(agent_id, num_tokens) if a not in excluded] if pool else []
            if found:
                return found, key
        return [], keys[0]

    def _current(self, token_ids: tuple[int, ...] | None, tenant: str) -> EntryIdentity | None:
        """The identity of the index's entry for a fixed segment now (None: none held).
        A peek, not a lookup: the assembler looks it up itself when it places it."""
        entry = self.index.peek(token_ids, tenant) if token_ids is not None else None
        return entry.identity if entry is not None else None

    @staticmethod
    def _measure(pool_key: PoolKey, agent_id: str, detail: dict[str, Any]) -> Decision:
        return Decision(False, pool_key, agent_id, [], None, None, detail)

    @staticmethod
    def measuring(decision: Decision) -> Decision:
        """The same chunk measured instead: another chunk of its placeholder must be
        measured, and a placeholder is computed densely whole (a chunk computed behind
        predicted ones would be measured against approximate KV)."""
        if not decision.predicted:
            return decision
        return Decision(False, decision.pool, decision.agent_id, [], None, None,
                        {**decision.detail, "anchor": "measured"})

    def _predicted(self, pool_key: PoolKey, agent_id: str, anchors: list[Anchor], token_weights: torch.Tensor,
                   weights: torch.Tensor, prefix_token_ids: tuple[int, ...] | None,
                   prefix_base: EntryIdentity | None, detail: dict[str, Any]) -> Decision:
        """A prediction from `anchors`. The fixed segment after the placeholder (whose
        entry is `prefix_base` now) is corrected by the prefix offsets measured against
        that very entry; those measured against another version of it are counted and
        left out, and with none left it is not corrected (the assembler computes it)."""
        mode = self.correction
        placeholder = None
        if mode != "rotation":
            placeholder = Correction([self.blobs.slots(a.offsets[agent_id].placeholder) for a in anchors],
                                     token_weights)
        prefix = None
        if mode == "full" and prefix_token_ids is not None:
            agents = [a.offsets[agent_id] for a in anchors]
            fits = [agent.prefix_for(prefix_token_ids, prefix_base) for agent in agents]
            # (anchor, its prefix offset) where that applies: prefix_for is True only with an offset
            measured = [(i, agent.prefix) for i, (agent, fit) in enumerate(zip(agents, fits))
                        if fit is True and agent.prefix is not None]
            num_stale = sum(1 for fit in fits if fit is False)
            if num_stale:
                detail = {**detail, "stale_prefix_offsets": num_stale}
            if measured:
                rows = [i for i, _ in measured]
                w = weights[rows] / weights[rows].sum()  # (A',)
                prefix = Correction([self.blobs.slots(blob) for _, blob in measured], w)
        return Decision(True, pool_key, agent_id, anchors, placeholder, prefix, detail,
                        prefix_base if prefix is not None else None, token_weights.shape[1])

    def blobs_of(self, decision: Decision) -> list[Blob]:
        """The blobs a decision reads: pinned from admission until the prefill is done."""
        if decision.predicted:
            return [b for a in decision.anchors for b in a.offsets[decision.offsets_agent].blobs()]
        return []

    # -- committing --------------------------------------------------------------------
    def commit(self, decision: Decision) -> None:
        """A prediction ran: its anchors were activated."""
        if decision.predicted and self.learning:
            self.num_predicted += 1
            self.num_predicted_tokens += decision.num_tokens
            for anchor in decision.anchors:
                anchor.num_activations += 1

    def record(self, m: Measurement, prompt_slots: torch.Tensor) -> bool:
        """Record one measured chunk (`record_all` of it alone); False when not recorded."""
        return self.record_all([m], prompt_slots) == 1

    def record_all(self, measurements: list[Measurement], prompt_slots: torch.Tensor) -> int:
        """Record a computed prompt's measured chunks (slots (P,)): each becomes an anchor,
        or its anchor gains this agent. Returns how many were recorded. An anchor of these
        tokens measured against another version of the base is replaced by this
        measurement (its other agents' offsets go with it: they too were measured against
        the old version). A chunk met twice in one prompt's pool is recorded once.

        The bookkeeping runs chunk by chunk, the tensor work for all of them in one pass
        per layer: chunk by chunk it was 5-13 ms of small tensor ops per 16-token chunk,
        0.06-0.11 s before the first token of every reader that measured a 128-token
        answer (8 chunks timed alone: 40-65 ms before, 11-13 ms batched). Runs before the
        sequence's pins are released: each chunk's base (and the fixed segment's entry)
        stays pinned while blobs are allocated for the others."""
        jobs: list[_Job] = []
        seen: set[tuple[PoolKey, tuple[int, ...]]] = set()
        try:
            for m in measurements:
                self.num_measured_tokens += len(m.token_ids)  # computed densely, whether recorded or not
                if (m.decision.pool, m.token_ids) in seen:
                    continue
                seen.add((m.decision.pool, m.token_ids))
                job = self._prepare(m, prompt_slots)
                if job is not None:
                    jobs.append(job)
            self._write(jobs)
        except BaseException:
            for job in jobs:
                job.undo(self.blobs)
            raise
        for job in jobs:
            job.unpin(self.blobs)
            for blob in job.new_blobs:
                self.blobs.seal(blob)
            self._install(job)
        return len(jobs)

    def _prepare(self, m: Measurement, prompt_slots: torch.Tensor) -> _Job | None:
        """One chunk's blobs, allocated and not yet written; None when it is not recorded."""
        if not self.learning or not self.index.is_current(m.base):
            return None
        pool = self.pools.setdefault(m.decision.pool, AnchorPool(self.config.max_anchors, self.config.prune_window))
        anchor = pool.find(m.token_ids)
        stale = None
        if anchor is not None and not anchor.exact_for(m.identity):
            stale, anchor = anchor, None
        if anchor is not None and (m.decision.agent_id in anchor.offsets or not self.blobs.valid(anchor.base)):
            return None  # another request measured it meanwhile, or its base was evicted
        prefix_token_ids = m.prefix_token_ids or ()  # () when the chunk has no fixed segment after it
        prefix_entry = self.index.lookup(prefix_token_ids, m.tenant) if prefix_token_ids else None
        # Allocating blobs must not evict what they are measured against.
        pinned = [m.base.blob] + ([prefix_entry.blob] if prefix_entry is not None else []) \
            + ([anchor.base] if anchor is not None else [])
        for blob in pinned:
            self.blobs.acquire(blob)
        n = len(m.token_ids)
        new_blobs: list[Blob] = []
        base = anchor.base if anchor is not None else self._blob(n, new_blobs)
        placeholder = self._blob(n, new_blobs)
        prefix = self._blob(len(prefix_token_ids), new_blobs) if prefix_entry is not None else None
        if base is None or placeholder is None or (prefix_entry is not None and prefix is None):
            _give_back(self.blobs, new_blobs, pinned)
            self.num_skipped += 1
            return None
        job = _Job(m, pool, anchor, stale, prefix_entry, pinned, new_blobs, base, placeholder, prefix)
        job.rows.append((prompt_slots[m.position : m.position + n], m.position, self.blobs.slots(base),
                         self.blobs.slots(placeholder)))
        if prefix is not None and prefix_entry is not None:
            p = len(prefix_token_ids)
            job.rows.append((prompt_slots[m.prefix_position : m.prefix_position + p], m.prefix_position,
                             self.index.slots(prefix_entry), self.blobs.slots(prefix)))
        return job

    def _write(self, jobs: list[_Job]) -> None:
        """Every job's tensors in one pass per layer: the new anchors' bases copied from the
        index into their chunk's own frame (it starts at position 0, as the offsets are
        measured in: they then apply to a chunk at any position, another chunk position
        included), then each real - base."""
        fresh = [job for job in jobs if job.anchor is None]
        if fresh:
            src = torch.cat([self.index.slots(j.m.base)[j.m.offset : j.m.offset + len(j.m.token_ids)]
                             for j in fresh])  # (N,)
            dst = torch.cat([self.blobs.slots(j.base) for j in fresh])  # (N,)
            deltas = torch.cat([torch.full((len(j.m.token_ids),), -j.m.offset, dtype=torch.long) for j in fresh])
            self.index.copy_shifted(src, dst, deltas)
        rows = [row for job in jobs for row in job.rows]
        if rows:
            positions = torch.cat([torch.full((real.shape[0],), at, dtype=torch.long) for real, at, _, _ in rows])
            offsets.measure(self.kv_cache, self.shifter, torch.cat([r[0] for r in rows]), positions,
                            torch.cat([r[2] for r in rows]), torch.cat([r[3] for r in rows]))

    def _install(self, job: _Job) -> None:
        """A written job's anchor joins its pool (or gains this agent's offsets)."""
        m, anchor = job.m, job.anchor
        if anchor is None:
            anchor = Anchor(next(self._ids), m.token_ids, job.base, base_identity=m.identity)
            if job.stale is not None:
                job.pool.replace(job.stale, anchor)
                self._discard(job.stale)
            else:
                for pruned in job.pool.add(anchor):
                    self._discard(pruned)
        prefix_base = job.prefix_entry.identity if job.prefix is not None and job.prefix_entry is not None else None
        anchor.offsets[m.decision.agent_id] = AgentOffsets(job.placeholder,
                                                           m.prefix_token_ids if job.prefix else None,
                                                           job.prefix, prefix_base)
        self.num_measured += 1

    def _blob(self, num_tokens: int, taken: list[Blob]) -> Blob | None:
        key = chain_hash(self.root, (next(self._blob_ids),))
        blob = self.blobs.allocate(key, num_tokens)
        if blob is not None:
            taken.append(blob)
        return blob

    # -- upkeep and accounting ---------------------------------------------------------
    def _drop_invalid(self, pool: AnchorPool) -> None:
        """Anchors whose base was evicted go; so do agents' offsets that were."""
        for anchor in list(pool.anchors):
            if not self.blobs.valid(anchor.base):
                pool.remove(anchor)
                self._discard(anchor)
                continue
            for agent_id, agent in list(anchor.offsets.items()):
                if not all(self.blobs.valid(b) for b in agent.blobs()):
                    del anchor.offsets[agent_id]
                    for blob in agent.blobs():
                        self.blobs.discard(blob)

    def _discard(self, anchor: Anchor) -> None:
        for blob in anchor.blobs():
            self.blobs.discard(blob)

    def stats(self) -> dict[str, int]:
        anchors = [a for pool in self.pools.values() for a in pool.anchors]
        live = [b for a in anchors for b in a.blobs() if self.blobs.valid(b)]
        return {"pools": len(self.pools), "anchors": len(anchors),
                "anchor_bytes": sum(self.blobs.num_bytes(b) for b in live),
                "predicted": self.num_predicted, "measured": self.num_measured, "skipped": self.num_skipped,
                "predicted_tokens": self.num_predicted_tokens, "measured_tokens": self.num_measured_tokens}
