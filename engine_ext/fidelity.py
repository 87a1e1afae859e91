"""Fidelity harness: how much of the dense answer a reuse path preserves.

For one prompt, the dense path (every token computed) is the reference. Metrics, as
DESIGN.md defines them:
- `top1_agreement`: teacher-forced over the dense greedy continuation, the fraction of
  positions where both paths pick the same next token;
- `kl`: mean KL(dense || reuse) of the next-token distributions over those positions;
- `greedy_match`: whether free-running greedy decoding gives the identical tokens.

The reference runs on the canonical tokenization of the prompt's text (the ids the
engine gives the same text without a plan), not on the ids the reuse path runs: a path
that tokenizes differently (pieces tokenized apart, say) then pays for it in these
figures instead of hiding it. `tokens_drifted` says how many prompt ids differed.

Both paths run through the real engine (scheduler, assembler, reuse prefill), not a
side model, so what is measured is what is served. The dense runs never publish to the
prefix cache: they must not hand the reuse runs an exact copy of the prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine_ext.engine import LLMEngine
from engine_ext.reuse.segments import SegmentOutcome, TokenSegment
from engine_ext.sampling import SamplingParams


class FidelityResult(NamedTuple):
    top1_agreement: float
    kl: float
    greedy_match: bool
    reuse_outcomes: list[SegmentOutcome]  # of the teacher-forced run: what was actually reused
    tokens_drifted: int = 0  # prompt ids of the reuse path that differ from the canonical ones


class DenseReference(NamedTuple):
    continuation: list[int]  # dense greedy tokens after the prompt
    logits: torch.Tensor  # (num_tokens, vocab): the logits that chose them
    prompt_ids: list[int] = []  # the canonical ids the reference ran on


def compare_logits(dense: torch.Tensor, reuse: torch.Tensor) -> tuple[float, float]:
    """top1 agreement and mean KL(dense || reuse) over rows of (n, vocab) logits."""
    dense_log = torch.log_softmax(dense.float(), dim=-1)  # (n, vocab)
    reuse_log = torch.log_softmax(reuse.float(), dim=-1)
    top1 = (dense_log.argmax(-1) == reuse_log.argmax(-1)).float().mean().item()
    kl = (dense_log.exp() * (dense_log - reuse_log)).sum(-1).mean().item()
    return top1, max(kl, 0.0)


class FidelityHarness:
    def __init__(self, engine: LLMEngine, num_tokens: int = 32) -> None:
        if num_tokens < 1:
            raise ValueError("num_tokens must be >= 1")
        self.engine = engine
        self.num_tokens = num_tokens

    def _greedy(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.num_tokens, temperature=0.0, ignore_eos=True)

    def canonical(self, prompt_ids: list[int]) -> list[int]:
        """The ids the engine gives the text of `prompt_ids` when it tokenizes it whole."""
        tok = self.engine.tokenizer
        return tok.encode(tok.decode(prompt_ids, skip_special_tokens=False))

    def reference(self, prompt_ids: list[int]) -> DenseReference:
        """Dense greedy decoding of the prompt's text, tokenized canonically."""
        canonical = self.canonical(prompt_ids)
        seq = self.engine.generate(canonical, self._greedy(), publish=False, record_logits=True)
        assert seq.logits is not None  # record_logits: the engine kept every step's logits
        return DenseReference(seq.output_token_ids, torch.stack(seq.logits), canonical)

    def measure(self, prompt_ids: list[int], segments: list[TokenSegment],
                reference: DenseReference) -> FidelityResult:
        """Score the reuse path (the prompt with its segments) against the dense reference."""
        scored = self.engine.score(prompt_ids, reference.continuation, segments, publish=False)
        top1, kl = compare_logits(reference.logits, scored.logits)
        free = self.engine.generate(prompt_ids, self._greedy(), segments=segments, publish=False)
        drifted = _differing(prompt_ids, reference.prompt_ids)
        return FidelityResult(top1, kl, free.output_token_ids == reference.continuation, scored.reuse_outcomes,
                              drifted)


def _differing(a: list[int], b: list[int]) -> int:
    """Positions where two id lists differ, a length difference counted in full."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
