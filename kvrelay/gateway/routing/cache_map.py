"""CacheMap: which blocks a prompt will start with, and which replica holds them.

Two tables, both bounded:
- prompts: prefix key -> the block digests an engine reported for a prompt with that
  prefix (kvrelay/wire/cache_report.py). A shorter prefix of a reported prompt gets the
  share of its blocks its share of the characters covers (rounded down): the gateway has
  no tokenizer, and a block predicted too many only costs a misroute, never an answer.
- replicas: per upstream, the digests it holds, with a weight (1 on the device, less in
  a lower tier, which costs a copy). An engine's report (GET /v1/kvrelay/cache, polled)
  replaces its table. Between reports, what the gateway routed there is added: the
  blocks a request is predicted to start with, and the blocks its response reported,
  which the replica has just computed. An upstream that reports nothing (vLLM) is known
  only this way, bounded to the most recent `max_blocks`.
- an upstream that reports no blocks at all, not even per prompt (vLLM), is matched by
  prefix keys instead: the keys of the prompts routed there, the longest one a prompt
  shares counting its characters' worth of tokens (SGLang's router keeps such an
  approximate tree per worker). Nothing says when that replica evicts, so the table is
  bounded to the most recent `max_blocks` keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvrelay.gateway.routing.prefix_keys import PrefixKey
from kvrelay.wire.cache_report import CacheReport

DEFAULT_BLOCK_SIZE = 16  # the embedded engine's, until a report says otherwise
CHARS_PER_TOKEN = 4  # a prefix's size in tokens, estimated without a tokenizer


class ReplicaBlocks:
    def __init__(self, max_blocks: int, lower_weight: float) -> None:
        self.max_blocks = max_blocks
        self.lower_weight = lower_weight
        self.block_size = DEFAULT_BLOCK_SIZE
        self._blocks: OrderedDict[str, float] = OrderedDict()
        self._keys: OrderedDict[bytes, None] = OrderedDict()  # prefix keys routed here (for one without reports)
        self.reports_blocks = False  # whether any block of it was ever reported, per prompt or whole

    def __len__(self) -> int:
        return len(self._blocks)

    def replace(self, report: CacheReport) -> None:
        blocks: OrderedDict[str, float] = OrderedDict((d, self.lower_weight) for d in report.lower)
        blocks.update((d, 1.0) for d in report.device)
        self._blocks, self.block_size, self.reports_blocks = blocks, report.block_size, True

    def add(self, digests: Sequence[str], reported: bool = False) -> None:
        """Blocks now there: predicted (`reported` False) or named by the replica itself."""
        self.reports_blocks = self.reports_blocks or reported
        for d in digests:
            self._blocks[d] = 1.0
            self._blocks.move_to_end(d)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def add_keys(self, keys: Sequence[PrefixKey]) -> None:
        for prefix in keys:
            self._keys[prefix.key] = None
            self._keys.move_to_end(prefix.key)
        while len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)

    def key_hit_tokens(self, keys: Sequence[PrefixKey]) -> float:
        """Tokens of the longest of the prompt's prefixes routed here (estimated)."""
        return next((k.chars / CHARS_PER_TOKEN for k in reversed(keys) if k.key in self._keys), 0.0)

    def hit_tokens(self, digests: Sequence[str]) -> float:
        """Tokens of the prompt's start this replica holds, a lower-tier block counted at
        its weight; the run stops at the first block it lacks, as a prefix hit does."""
        total = 0.0
        for d in digests:
            weight = self._blocks.get(d)
            if weight is None:
                break
            total += weight
        return total * self.block_size


class CacheMap:
    def __init__(self, max_prompts: int = 200_000, max_blocks: int = 200_000, lower_weight: float = 0.7) -> None:
        self.max_prompts = max_prompts
        self.max_blocks = max_blocks
        self.lower_weight = lower_weight
        self._prompts: OrderedDict[bytes, tuple[tuple[str, ...], int]] = OrderedDict()  # key -> (blocks, how many)
        self._replicas: dict[str, ReplicaBlocks] = {}
        self.block_size = DEFAULT_BLOCK_SIZE  # the last reported (replicas of one model share it)

    def replace(self, url: str, report: CacheReport) -> None:
        """A replica's own report of what it holds."""
        self.replica(url).replace(report)
        self.block_size = report.block_size

    def replica(self, url: str) -> ReplicaBlocks:
        table = self._replicas.get(url)
        if table is None:
            table = self._replicas[url] = ReplicaBlocks(self.max_blocks, self.lower_weight)
        return table

    def hits(self, url: str, keys: Sequence[PrefixKey], predicted: Sequence[str]) -> float:
        """Tokens of the prompt's start the replica at `url` is believed to hold: by its
        blocks where it reports them, by the prompts routed there where it does not."""
        replica = self.replica(url)
        return replica.hit_tokens(predicted) if replica.reports_blocks else replica.key_hit_tokens(keys)

    def routed(self, url: str, keys: Sequence[PrefixKey], predicted: Sequence[str]) -> None:
        """A prompt went to `url`: its predicted blocks and its keys will be there."""
        replica = self.replica(url)
        replica.add(predicted)
        replica.add_keys(keys)

    def predict(self, keys: Sequence[PrefixKey]) -> list[str]:
        """The block digests the prompt is expected to start with: those of the longest
        of its prefixes a reported prompt shared (none known: empty)."""
        for prefix in reversed(keys):
            known = self._prompts.get(prefix.key)
            if known is not None:
                self._prompts.move_to_end(prefix.key)
                blocks, count = known
                return list(blocks[:count])
        return []

    def learn(self, keys: Sequence[PrefixKey], digests: Sequence[str]) -> None:
        """A prompt with these keys started with these blocks (its engine's report)."""
        if not keys or not digests:
            return
        blocks = tuple(digests)
        total = keys[-1].chars
        for prefix in keys:
            count = len(blocks) if prefix.chars >= total else len(blocks) * prefix.chars // total
            if count:
                self._prompts[prefix.key] = (blocks, count)
                self._prompts.move_to_end(prefix.key)
        while len(self._prompts) > self.max_prompts:
            self._prompts.popitem(last=False)
