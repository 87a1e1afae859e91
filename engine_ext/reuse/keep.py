"""Keeper: what a request leaves for later ones once its prompt (or answer) is computed.

After a prompt with segments is prefilled: its outcomes are recorded, KVCOMM's anchors
commit what it predicted and measured, its reusable segments go into the segment index,
and a prompt holding approximate KV is stored whole (engine_ext/diffs) so its agent's
next turn restores it. A round group's caches are stored by the group. A finished
answer is kept as a segment too. All of it only saves later work: a store that fails
is logged and the request goes on.
"""

from __future__ import annotations

import logging

import torch

from engine_ext.collective.plan import CollectivePlan
from engine_ext.collective.prefill import GroupMember
from engine_ext.config import EngineConfig
from engine_ext.diffs import CacheImage
from engine_ext.kv.manager import KVCacheManager
from engine_ext.reuse.answers import Ending, answer_tokens
from engine_ext.reuse.methods import PLACED_METHODS
from engine_ext.reuse.parts import ReuseParts
from engine_ext.sequence import Sequence
from engine_ext.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Keeper:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, parts: ReuseParts, tokenizer: Tokenizer) -> None:
        self.config = config
        self.kv = kv
        self.parts = parts
        self.tokenizer = tokenizer

    def keep(self, seq: Sequence) -> None:
        """Record what each segment got, and keep the reusable ones in the segment index."""
        assembly = seq.assembly
        # Admission assembles every prompt with segments until its outcomes are recorded (here).
        assert assembly is not None, f"request {seq.request_id} has segments but no assembly"
        seq.reuse_outcomes = assembly.outcomes()
        seq.assembly = None
        if seq.num_preemptions == 0:
            placed = sum(o.num_reused for o in seq.reuse_outcomes if o.method in PLACED_METHODS)
            seq.num_cached_tokens = assembly.num_prefix_tokens + placed
        index = self.parts.segment_index
        if index is None:
            return
        keeps = self.keeps_segments(seq)
        approximate = seq.restore is not None or bool(assembly.placed)
        if not (keeps or approximate or assembly.decisions or assembly.measurements):
            seq.pins.release()
            return  # an exact prompt leaves nothing behind: not even its slots are looked up
        slots = self.kv.slots(seq, seq.num_prompt_tokens)  # (P,)
        for seg in seq.segments if keeps else ():
            if seg.is_reusable and seg.num_tokens >= self.config.reuse.min_segment_tokens:
                index.register(seq.token_ids[seg.start : seg.end], slots[seg.start : seg.end], seg.start, seq.tenant)
        self.parts.assembler.commit(assembly, slots)
        seq.pins.release()  # a measured anchor's base stayed pinned until the commit
        if approximate and assembly.collective is None:  # a round group stored itself already
            self._store_turn(seq, slots)

    def _store_turn(self, seq: Sequence, slots: torch.Tensor) -> None:
        """Keep a prompt that holds approximate KV (placed segments, or a restored round
        cache): its blocks from the first approximate token on are never published, so
        without this the agent's next turn, which extends this prompt, would lose its
        prefix hits there and compute (or place) all of it again. Stored, it restores
        the KV this prompt ran on. A mirror of the cache it was restored from when there
        is one. Only an optimisation: a failure is logged."""
        store, exact = self.parts.diff_store, seq.num_exact_tokens
        if store is None or not seq.publish or exact is None:  # None: every block is exact, nothing to restore
            return
        region_start = exact // self.config.block_size * self.config.block_size
        spans = tuple((seg.start, seg.end) for seg in seq.segments)
        image = CacheImage(tuple(seq.prompt_token_ids), slots, region_start, [], spans, seq.tenant)
        try:
            store.store(image, like=seq.restore.stored if seq.restore is not None else None)
        except Exception:
            logger.exception("storing request %s's turn failed; it goes on without it", seq.request_id)

    def store_round(self, seqs: list[Sequence], members: list[GroupMember], plan: CollectivePlan) -> None:
        """Keep the caches of the members that may publish: the round's lowest-deviation
        one as master, the others as its mirrors; a member alone joins its round's stored
        caches by similarity. Storage only saves later work, so a failure is logged and
        the requests go on."""
        keep = [i for i, seq in enumerate(seqs) if seq.publish]
        store, collective = self.parts.diff_store, self.parts.collective
        if store is None or collective is None or not keep:  # a diff store comes with the collective prefill
            return
        try:
            images = collective.images([members[i] for i in keep], plan)
            if len(images) == 1:
                store.store(images[0])
            else:
                master = min(range(len(keep)), key=lambda j: (plan.deviations[keep[j]], j))
                store.store_round(images, master)
        except Exception:
            logger.exception("storing round %s failed; its requests go on without it", plan.round_id)

    def keeps_segments(self, seq: Sequence) -> bool:
        """Whether this request's segments and answer go into the segment index. Only
        approximate methods ever read it, so a request keeps them only when it opted
        into one (its plan, or this engine's default): an exact app pays nothing for
        reuse it never makes (copying its KV into the index, an extra row per answer
        cut by length). An app that opts in starts filling the index with its first
        opted-in request."""
        if self.config.reuse.default_method in PLACED_METHODS:
            return True
        return any(seg.method in PLACED_METHODS for seg in seq.segments)

    def answer_end(self, seq: Sequence, ending: Ending) -> int | None:
        """Where a finished answer kept as a segment ends (None: not kept), so the next
        agent reading it reuses its KV without ever prefilling it alone. The tokens kept
        are exactly the answer's text (engine_ext/reuse/answers.py); a last token that was
        sampled but never computed (an answer cut by length) is the caller's to compute."""
        if (self.parts.segment_index is None or not self.config.reuse.register_outputs or not seq.segments
                or not self.keeps_segments(seq)):
            return None
        count = answer_tokens(seq.output_token_ids, seq.detokenizer.text, ending, self.tokenizer)
        return seq.num_prompt_tokens + count if count >= self.config.reuse.min_segment_tokens else None

    def keep_answer(self, seq: Sequence, end: int) -> None:
        """Put the answer's tokens, computed up to `end`, into the segment index."""
        index = self.parts.segment_index
        assert index is not None and end <= seq.num_computed_tokens, "keep_answer follows answer_end and its compute"
        start = seq.num_prompt_tokens
        slots = self.kv.slots(seq, end)[start:]  # (n,)
        index.register(seq.token_ids[start:end], slots, start, seq.tenant, generated=True)
