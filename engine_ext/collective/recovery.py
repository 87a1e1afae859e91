"""Recovery: what corrects the chosen positions of placed segments, for a whole round.

TokenDance decouples collective reuse from the per-position recovery method: the
collector decides *which* positions each request recomputes (once for the round), a
recovery method computes *what* goes there. Any method that takes positions and
writes corrected K/V plugs in through `Recovery`; CacheBlend's selective recompute
(`BlendRecovery`) is the default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine_ext.collective.rows import PromptRows, RowsForward
from engine_ext.kv.cache import KVCache
from engine_ext.model import CausalLM


class RecoveryResult(NamedTuple):
    last_hidden: torch.Tensor  # (1, hidden): the prompt's last token, ready for the logits
    deviation: float  # summed key deviation of its recovered positions from their placed KV


class Recovery(ABC):
    """Contract: for each prompt, `rows` lists every position no placed segment covers
    plus the positions chosen for recovery (`watched`), sorted, ending with the last
    token. The method writes corrected K/V for those rows in every layer into the
    prompt's slots, leaves every other placed position's KV as it was placed, and
    returns each prompt's final hidden state and its deviation. The result for a
    prompt must not depend on which other prompts share the call."""

    @abstractmethod
    def recover(self, prompts: list[PromptRows]) -> list[RecoveryResult]: ...


class BlendRecovery(Recovery):
    """CacheBlend's recompute: the chosen positions are computed afresh in every layer,
    attending to the placed KV of the others; all prompts run as one batched forward."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, check_layers: tuple[int, ...]) -> None:
        self.forward = RowsForward(model, kv_cache, check_layers)

    def recover(self, prompts: list[PromptRows]) -> list[RecoveryResult]:
        result = self.forward.run(prompts)
        return [RecoveryResult(h, float(d.sum())) for h, d in zip(result.last_hidden, result.deviation)]


# config.CollectiveConfig.recovery -> how to build it from (model, kv cache, check layers).
RECOVERIES: dict[str, Callable[[CausalLM, KVCache, tuple[int, ...]], Recovery]] = {"blend": BlendRecovery}
