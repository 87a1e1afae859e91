from __future__ import annotations

import torch

from engine_ext.fidelity import FidelityHarness, compare_logits
from engine_ext.reuse.segments import TokenSegment
from engine_ext.sampling import SamplingParams
from tests.helpers import make_engine


def test_compare_logits_identical_and_different():
    logits = torch.randn(5, 11)
    assert compare_logits(logits, logits) == (1.0, 0.0)
    flipped = logits.clone()
    flipped[0] = -flipped[0]
    top1, kl = compare_logits(logits, flipped)
    assert abs(top1 - 0.8) < 1e-6 and kl > 0.1


def test_exact_reuse_scores_perfectly_and_shift_does_not(llama_dir):
    eng = make_engine(llama_dir, num_blocks=64)
    harness = FidelityHarness(eng, num_tokens=12)
    doc = [7 + i % 90 for i in range(48)]
    eng.generate(doc, SamplingParams(max_tokens=1), segments=[TokenSegment(0, 48, "shared_block")], publish=False)
    prompt = [3, 5, 9, 11] * 5 + doc + [13, 17, 19]
    reference = harness.reference(prompt)
    dense = harness.measure(prompt, [], reference)
    assert dense.top1_agreement == 1.0 and dense.kl < 1e-4 and dense.greedy_match
    shifted = harness.measure(prompt, [TokenSegment(20, 68, "shared_block", None, "shift")], reference)
    assert [o.method for o in shifted.reuse_outcomes] == ["shift"]
    assert shifted.kl > 1e-4  # the document's KV was computed without the prefix: not exact
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
