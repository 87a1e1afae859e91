"""CollectivePrefill: TokenDance's collective reuse of one All-Gather round.

Every member of the round holds the same shared segments at its own positions. Per
request (ReusePrefill), each prompt pays for moving them, for a deviation pass over
all their tokens on the check layers, and for the recompute of its selection. Here:

1. Place: every placed segment of every member is shifted to its position in one
   batched gather-rotate-scatter per layer (engine_ext.kernels.shift_copy).
2. Select once: one deviation pass runs the probe member's prompt (the one holding
   the most placed tokens) through the check layers; its key deviations pick, per
   shared segment, the offsets every member recomputes. A segment the probe lacks (in
   an All-Gather without self, its own output) is selected by one more pass over the
   member holding the most such segments, and so on until every segment has its
   offsets: two passes for such a round, however many members it has. Offsets are
   picked in whole blocks of `diff_block_tokens` (highest mean deviation first, the last block trimmed to its best tokens), so the members'
   caches later differ from the master's in few blocks (DiffStore). The budget is
   blend's: ceil(blend_ratio * n) tokens per segment, summed over the segments.
3. Recover: the probe's placement is restored where the deviation pass overwrote it,
   then the recovery method (blend: recompute) refreshes each member's chosen
   positions, plus everything no segment covers, in one batched forward.

Each member's deviation (of its recomputed keys from the placed ones) names the
master: the one closest to the shared cached blocks.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import NamedTuple

import torch

from engine_ext.collective.plan import CollectivePlan, lowest
from engine_ext.collective.recovery import Recovery
from engine_ext.collective.rows import PromptRows, RowsForward
from engine_ext.config import ReuseConfig
from engine_ext.diffs.images import CacheImage, CanonicalRun
from engine_ext.kv.cache import KVCache
from engine_ext.kv.hashing import DEFAULT_TENANT
from engine_ext.kv.segment_index import SegmentIndex
from engine_ext.model import CausalLM
from engine_ext.reuse.assembler import Assembly
from engine_ext.timeline import Interval
from engine_ext.kernels.shift_copy import shift_copy


MAX_REMEMBERED_ROUNDS = 256


class GroupMember(NamedTuple):
    request_id: str
    assembly: Assembly
    token_ids: list[int]
    slots: torch.Tensor  # (T,) the member's cache slots
    num_exact_tokens: int | None = None  # KV from here on is approximate (restored or placed); None: exact
    tenant: str = DEFAULT_TENANT  # whose caches its stored image joins


class CollectiveResult(NamedTuple):
    last_hidden: list[torch.Tensor]  # per member, (1, hidden)
    plan: CollectivePlan
    placed: Interval  # when every member's segments were put in place (one batched copy)


class CollectivePrefill:
    def __init__(self, model: CausalLM, kv_cache: KVCache, index: SegmentIndex, config: ReuseConfig,
                 recovery: Recovery) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.index = index
        self.config = config
        self.recovery = recovery
        self.last_check = max(config.check_layers)
        self.probe_forward = RowsForward(model, kv_cache, config.check_layers)
        # Per recent round, the offsets it recomputes: a member arriving after its
        # round's group ran recomputes the same ones, without a deviation pass.
        self.selections: OrderedDict[str, dict[bytes, torch.Tensor]] = OrderedDict()
        self.num_rounds = 0  # groups prefilled collectively (engine /metrics)
        self.num_members = 0  # requests in them

    @torch.inference_mode()
    def run(self, round_id: str, members: list[GroupMember],
            selected: dict[bytes, torch.Tensor] | None = None) -> CollectiveResult:
        """Prefill every member's prompt around its placed segments. members[0] is the
        probe; `selected` (segment key -> offsets) skips the deviation pass and
        recomputes exactly those offsets (the per-request path of the same plan); by
        default the round's earlier selection is reused when it covers every member."""
        started = time.monotonic()
        self.num_rounds += 1
        self.num_members += len(members)
        self.place(members)
        placed = Interval(started, time.monotonic())
        reused = False
        if selected is None:
            selected = self._remembered(round_id, members)
            reused = selected is not None
        if selected is None:
            selected = self._select_covering(members)
            self.selections[round_id] = selected
            while len(self.selections) > MAX_REMEMBERED_ROUNDS:
                self.selections.popitem(last=False)
        prompts = [self._rows(m, selected) for m in members]
        results = self.recovery.recover(prompts)
        ratios = [self._count_selected(m, selected) for m in members]
        deviations = [r.deviation for r in results]
        num_candidates = sum(p.segment.num_tokens for p in members[0].assembly.placed)
        num_selected = sum(int(o.numel()) for o in selected.values())
        plan = CollectivePlan(round_id, [m.request_id for m in members], deviations, lowest(deviations),
                              selected, num_candidates, num_selected, ratios, reused)
        return CollectiveResult([r.last_hidden for r in results], plan, placed)

    def _remembered(self, round_id: str, members: list[GroupMember]) -> dict[bytes, torch.Tensor] | None:
        """The round's earlier selection, if it covers every member's segments."""
        selected = self.selections.get(round_id)
        if selected is None or any(p.entry.key not in selected for m in members for p in m.assembly.placed):
            return None
        self.selections.move_to_end(round_id)
        return selected

    def place(self, members: list[GroupMember], num_layers: int | None = None) -> None:
        """Copy every placed segment of every member into its slots, keys shifted from the
        canonical frame to the segment's start: one batched call per layer."""
        src, dst, delta = [], [], []
        for m in members:
            for p in m.assembly.placed:
                seg = p.segment
                src.append(self.index.slots(p.entry))  # (n,)
                dst.append(m.slots[seg.start : seg.end])
                delta.append(torch.full((seg.num_tokens,), seg.start, dtype=torch.long))
        if not src:
            return
        src_all, dst_all, delta_all = torch.cat(src), torch.cat(dst), torch.cat(delta)  # each (N,)
        inv_freq = self.index.shifter.inv_freq
        for k_cache, v_cache in self.kv_cache.layers[:num_layers]:
            shift_copy(k_cache, v_cache, src_all, dst_all, delta_all, inv_freq)

    def _select_covering(self, members: list[GroupMember]) -> dict[bytes, torch.Tensor]:
        """Offsets for every member's segments: the probe's pass first, then one more
        pass over whichever member holds the most segments still without offsets (a
        segment keeps the offsets of the first pass that scored it)."""
        selected: dict[bytes, torch.Tensor] = {}
        probes: list[GroupMember] = []
        probe = members[0]
        while _num_missing(probe, selected):
            for key, offsets in self._select(probe).items():
                selected.setdefault(key, offsets)
            probes.append(probe)
            probe = max(members, key=lambda m: _num_missing(m, selected))
        self.place(probes, num_layers=self.last_check + 1)  # undo the deviation passes' writes
        return selected

    def _select(self, probe: GroupMember) -> dict[bytes, torch.Tensor]:
        """The offsets each shared segment recomputes, from one deviation pass over the probe."""
        assembly = probe.assembly
        full = assembly.full_positions()  # (R,)
        blend = assembly.blend_positions()  # per placed segment, (n_i,)
        candidates = torch.cat(blend) if blend else torch.empty(0, dtype=torch.long)  # (C,)
        rows, _ = torch.sort(torch.cat((full, candidates)))  # (R + C,)
        watched = torch.isin(rows, candidates)
        scored = self.probe_forward.run([PromptRows(probe.token_ids, probe.slots, rows, watched)],
                                        num_layers=self.last_check + 1)
        deviation = torch.split(scored.deviation[0], [b.numel() for b in blend])  # per placed segment, (n_i,)
        blocks: list[tuple[float, bytes, torch.Tensor, torch.Tensor]] = []  # (score, key, offsets, deviation)
        budget = 0
        size = self.config.collective.diff_block_tokens
        for p, positions, dev in zip(assembly.placed, blend, deviation):
            offsets = positions - p.segment.start  # (n_i,)
            budget += min(offsets.numel(), math.ceil(self.config.blend_ratio * offsets.numel()))
            for lo in range(0, offsets.numel(), size):
                block_dev = dev[lo : lo + size]
                blocks.append((float(block_dev.mean()), p.entry.key, offsets[lo : lo + size], block_dev))
        chosen: dict[bytes, list[torch.Tensor]] = {p.entry.key: [torch.empty(0, dtype=torch.long)]
                                                   for p in assembly.placed}  # every scored segment, even unchosen
        for _, key, offsets, dev in sorted(blocks, key=lambda b: -b[0]):
            if budget <= 0:
                break
            if offsets.numel() > budget:
                offsets = offsets[dev.topk(budget).indices]  # the last block: its best tokens only
            chosen[key].append(offsets)
            budget -= offsets.numel()
        return {key: torch.unique(torch.cat(parts)) for key, parts in chosen.items()}  # sorted

    def images(self, members: list[GroupMember], plan: CollectivePlan) -> list[CacheImage]:
        """Each member's cache as the DiffStore keeps it: from the block holding its first
        placed token on, each placed token that no member recomputed marked canonical."""
        block_size = self.kv_cache.block_size
        images = []
        for m in members:
            last = m.assembly.num_tokens - 1
            runs = []
            for p in m.assembly.placed:
                seg = p.segment
                exact = torch.ones(seg.num_tokens, dtype=torch.bool)  # (n,)
                offsets = plan.selected.get(p.entry.key)
                if offsets is not None:
                    exact[offsets] = False
                if seg.end > last:
                    exact[last - seg.start] = False  # the last prompt token is always computed
                runs.append(CanonicalRun(seg.start, p.entry.key, self.index.slots(p.entry), exact))
            # The first token whose KV is not exact (a member has placed segments: there is one).
            first = min(n for n in (m.assembly.first_approximate, m.num_exact_tokens) if n is not None)
            region_start = first // block_size * block_size  # before it: published prefix-cache blocks
            images.append(CacheImage(tuple(m.token_ids), m.slots, region_start, runs, tenant=m.tenant))
        return images

    @staticmethod
    def _rows(member: GroupMember, selected: dict[bytes, torch.Tensor]) -> PromptRows:
        """The member's rows: everything no placed segment covers, plus the chosen
        offsets of each of its segments (at the segment's own start)."""
        full = member.assembly.full_positions()  # (R,)
        parts = [p.segment.start + selected[p.entry.key] for p in member.assembly.placed
                 if p.entry.key in selected]
        chosen = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)  # (S,)
        chosen = chosen[~torch.isin(chosen, full)]  # the last token is computed in full anyway
        rows, _ = torch.sort(torch.cat((full, chosen)))
        return PromptRows(member.token_ids, member.slots, rows, torch.isin(rows, chosen))

    @staticmethod
    def _count_selected(member: GroupMember, selected: dict[bytes, torch.Tensor]) -> float:
        """Record per placed segment how many of its tokens were recomputed (for its
        outcome); returns the member's recomputed share of its placed tokens."""
        last = member.assembly.num_tokens - 1
        for i, p in enumerate(member.assembly.placed):
            offsets = selected.get(p.entry.key)
            num = 0 if offsets is None else int((p.segment.start + offsets < last).sum())
            member.assembly.num_selected[i] = num
        num_placed = sum(p.segment.num_tokens for p in member.assembly.placed)
        return sum(member.assembly.num_selected.values()) / max(num_placed, 1)


def _num_missing(member: GroupMember, selected: dict[bytes, torch.Tensor]) -> int:
    """Placed tokens of `member` in segments no pass has selected offsets for yet."""
    return sum(p.segment.num_tokens for p in member.assembly.placed if p.entry.key not in selected)
