"""The entropy criterion: edge cases of N and gamma."""

from __future__ import annotations

import math

import pytest
import torch

from engine_ext.kvcomm.criterion import anchor_weights, entropy_bits, nucleus, predict


def test_no_eligible_anchor_is_never_shareable():
    for gamma in (0.0, 0.3, 1.0):
        assert not predict(torch.empty(0), gamma, 1.0).shareable


@pytest.mark.parametrize("gamma", [0.0, 0.3, 1.0])
def test_one_anchor_is_always_shareable(gamma):
    pred = predict(torch.tensor([123.0]), gamma, 1.0)
    assert pred.shareable and pred.entropy == 0.0 and pred.threshold == 0.0
    assert pred.weights.tolist() == [1.0]


def test_equidistant_anchors_have_uniform_entropy():
    pred = predict(torch.full((8,), 0.7), 0.3, 1.0)
    assert pred.entropy == pytest.approx(3.0, abs=1e-5)
    assert pred.threshold == pytest.approx(0.3 * 3.0)
    assert not pred.shareable


def test_gamma_one_shares_whenever_an_anchor_is_eligible():
    assert predict(torch.full((5,), 0.7), 1.0, 1.0).shareable
    assert predict(torch.tensor([0.1, 0.9, 3.0]), 1.0, 1.0).shareable


def test_gamma_zero_shares_only_when_weights_sit_on_one_anchor():
    assert predict(torch.tensor([0.0, 50.0, 60.0]), 0.0, 1.0).shareable  # one-hot up to rounding
    assert not predict(torch.tensor([0.0, 0.5, 60.0]), 0.0, 1.0).shareable


def test_one_near_anchor_among_many_is_shareable_at_default_gamma():
    distances = torch.tensor([0.01] + [0.5] * 9)
    pred = predict(distances, 0.3, 0.05)
    assert pred.shareable
    assert pred.weights.argmax().item() == 0
    spread = predict(torch.tensor([0.30, 0.31, 0.32, 0.33] * 2), 0.3, 0.05)
    assert not spread.shareable and spread.entropy > 0.3 * math.log2(8)


def test_temperature_sharpens_weights():
    d = torch.tensor([0.1, 0.2, 0.3])
    assert entropy_bits(anchor_weights(d, 0.01)) < entropy_bits(anchor_weights(d, 1.0))


def test_nucleus_keeps_the_anchors_carrying_the_weight():
    assert nucleus(torch.tensor([0.05, 0.9, 0.05])) == [1]
    assert sorted(nucleus(torch.tensor([0.5, 0.45, 0.05]))) == [0, 1]
    assert nucleus(torch.tensor([1.0])) == [0]
