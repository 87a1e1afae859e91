"""KVCOMM's anchor prediction: may a new sample be predicted from the pool?

The weights of the eligible anchors are softmax(-distance / temperature). When they
concentrate on a few anchors (low entropy) the sample sits near measured examples and
their offsets are a fair guess; when they spread out (entropy near log2 N, the entropy
of uniform weights) no anchor is close and the sample must be measured instead:

    shareable  <=>  N >= 1  and  H(w) <= gamma * log2(N)      (H in bits)

So with one eligible anchor (H = 0 = gamma * log2 1) a sample is always predicted,
gamma = 0 predicts only when the weights sit on one anchor, and gamma = 1 predicts
whenever any anchor is eligible.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Entropy compares against gamma * log2(N) with this slack, so weights that are one-hot
# up to rounding count as one-hot.
_ENTROPY_SLACK = 1e-6


class Prediction(NamedTuple):
    shareable: bool
    weights: torch.Tensor  # (N,) softmax over the eligible anchors
    entropy: float  # bits
    threshold: float  # gamma * log2(N)


def anchor_weights(distances: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(-d / T) over the anchor dimension (dim 0), in fp32."""
    return torch.softmax(-distances.float() / temperature, dim=0)


def entropy_bits(weights: torch.Tensor) -> float:
    """Shannon entropy in bits of a distribution over dim 0 (zero weights contribute 0)."""
    w = weights.float()
    return float(-(w * torch.log2(w.clamp_min(1e-30))).sum())


def predict(distances: torch.Tensor, gamma: float, temperature: float) -> Prediction:
    """The entropy criterion over the eligible anchors' distances (N,)."""
    num_anchors = distances.shape[0]
    if num_anchors == 0:
        return Prediction(False, distances.float(), 0.0, 0.0)
    weights = anchor_weights(distances, temperature)
    entropy = entropy_bits(weights)
    threshold = gamma * math.log2(num_anchors)
    return Prediction(entropy <= threshold + _ENTROPY_SLACK, weights, entropy, threshold)


def nucleus(weights: torch.Tensor, top_p: float = 0.9) -> list[int]:
    """Indices of the fewest anchors carrying `top_p` of the weight: the ones a
    prediction really used, whose activation counts go up."""
    order = torch.argsort(weights, descending=True)
    cumulative = torch.cumsum(weights[order], dim=0)
    num = int((cumulative < top_p).sum()) + 1
    return order[: min(num, weights.shape[0])].tolist()
