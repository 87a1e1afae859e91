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
    tok = eng.tokenizer
    head, doc_text = tok.encode("the plan of the day:\n"), "the capital of France is Paris and the river is wide.\n"
    doc = tok.encode(doc_text)
    eng.generate(doc, SamplingParams(max_tokens=1), segments=[TokenSegment(0, len(doc), "shared_block", None, "shift")], publish=False)
    prompt = head + doc + tok.encode("why?")
    assert harness.canonical(prompt) == prompt
    reference = harness.reference(prompt)
    dense = harness.measure(prompt, [], reference)
    assert dense.top1_agreement == 1.0 and dense.kl < 1e-4 and dense.greedy_match and dense.tokens_drifted == 0
    doc_at = TokenSegment(len(head), len(head) + len(doc), "shared_block", None, "shift")
    shifted = harness.measure(prompt, [doc_at], reference)
    assert [o.method for o in shifted.reuse_outcomes] == ["shift"]
    assert shifted.kl > 1e-4  # the document's KV was computed without the prefix: not exact
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_a_path_that_tokenizes_differently_is_scored_against_the_canonical_ids(llama_dir):
    """Pieces tokenized apart (" the" split into " " + "the") are other ids for the same
    text: the reference runs on the canonical ids, so the drift counts against the path."""
    eng = make_engine(llama_dir, num_blocks=64)
    harness = FidelityHarness(eng, num_tokens=12)
    tok = eng.tokenizer
    text = "we read about the capital of France and the river"
    canonical = tok.encode(text)
    pieces = [i for piece in ("we read about", " ", "the capital of France and", " ", "the river") for i in tok.encode(piece)]
    assert pieces != canonical and tok.decode(pieces) == tok.decode(canonical)
    reference = harness.reference(pieces)
    assert reference.prompt_ids == canonical
    drifted = harness.measure(pieces, [], reference)
    assert drifted.tokens_drifted > 0
    assert drifted.kl > 1e-4  # other ids, other logits: no longer scored as perfect
    assert harness.measure(canonical, [], reference).kl < 1e-4
