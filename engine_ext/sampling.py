"""Sampling parameters and the sampler that turns a batch of logits into next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_ext.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine_ext.structured.grammar import TokenConstraint


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 (or under GREEDY_BELOW) means greedy."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The grammar the answer must follow (engine_ext/structured): stateful, one per request.
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError("temperature must be between 0 and 2", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0 (0 disables it)", param="top_k")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise InvalidRequestError("stop takes up to 4 non-empty strings", param="stop")
        if self.constraint is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with a constrained answer, which ends "
                                      "where its grammar ends", param="ignore_eos")
        if self.constraint is not None and self.stop:
            raise InvalidRequestError("stop cannot be combined with a constrained answer (tools, or a JSON "
                                      "response_format): a stop string would cut it short of its grammar",
                                      param="stop")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 (inf, then NaN probabilities
        # that fail the whole step); the distribution is argmax long before that.
        return self.temperature < GREEDY_BELOW


class Sampler:
    """Samples one token per row. Rows are handled one by one: batches are small
    (<= max_num_seqs) and each row may carry its own seeded generator."""

    def __init__(self, seed: int | None = None) -> None:
        self._default = torch.Generator()
        if seed is not None:
            self._default.manual_seed(seed)
        else:
            self._default.seed()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """logits (B, vocab) fp32 -> one token id per row. A row with a grammar
        constraint has the tokens its grammar forbids masked first (in place)."""
        if any(p.constraint is not None for p in params):
            logits = logits.clone()  # the model's output is an inference tensor: not writable here
            for row, p in zip(logits, params):
                if p.constraint is not None:
                    p.constraint.mask_(row)
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        out = []
        for row, p, gen in zip(logits, params, generators):
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            probs = self._probs(row / p.temperature, p)  # (vocab,)
            out.append(int(torch.multinomial(probs, 1, generator=gen or self._default)))
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()
