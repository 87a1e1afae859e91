"""The engine's reports as the gateway reads them: every malformed field dropped, never an error."""

import pytest

from kvrelay.wire.reports import FidelityScore, TtftBreakdown


@pytest.mark.parametrize(("report", "kept"), [
    ({"ttft_s": 0.5, "queue_s": "soon", "saved_s": float("nan"), "extra": 1, "assembly_s": {"shift": 0.1, "x": "y"}},
     {"ttft_s": 0.5, "assembly_s": {"shift": 0.1}}),
    ({"queue_s": 0.1}, None),  # no TTFT: nothing to show
    ("not a dict", None),
    ({"ttft_s": True}, None),
    ({"ttft_s": 0.5, "saved_s": 10 ** 400}, {"ttft_s": 0.5}),  # past float's range: dropped, never an error
    # The saving is derived from the baseline's TTFT, whatever the upstream claims.
    ({"ttft_s": 0.5, "dense_ttft_s": 0.7, "saved_s": 9.0, "prefix_hit_tokens": 64},
     {"ttft_s": 0.5, "dense_ttft_s": 0.7, "saved_s": pytest.approx(0.2), "prefix_hit_tokens": 64}),
    # A dense TTFT without its baseline priced the whole prompt, prefix hits included: dropped.
    ({"ttft_s": 0.5, "dense_ttft_s": 2.5, "saved_s": 2.0, "prefill_tokens_per_s": 57.0}, {"ttft_s": 0.5}),
])
def test_an_upstream_s_breakdown_is_reduced_to_known_numbers(report, kept):
    read = TtftBreakdown.read(report)
    assert (None if read is None else read.to_json()) == kept


@pytest.mark.parametrize("item", [
    "not a dict",
    {"tenant": "t", "app": "a", "method": "blend", "top1": 1.5, "kl": 0.1},  # top-1 past 1
    {"tenant": "t", "app": "a", "method": "blend", "top1": 0.9, "kl": float("nan")},
    {"tenant": "t", "app": "a", "method": "blend", "top1": 0.9, "kl": -0.1},
    {"tenant": "", "app": "a", "method": "blend", "top1": 0.9, "kl": 0.1},
    {"tenant": 7, "app": "a", "method": "blend", "top1": 0.9, "kl": 0.1},
    {"tenant": "t" * 257, "app": "a", "method": "blend", "top1": 0.9, "kl": 0.1},
    {"app": "a", "method": "blend", "top1": 0.9, "kl": 0.1},
])
def test_a_malformed_fidelity_score_is_dropped(item):
    assert FidelityScore.read(item) is None


def test_a_fidelity_score_reads_back_what_the_engine_wrote():
    score = FidelityScore(seq=3, request_id="r", tenant="t", app="a", method="blend", top1=0.75, kl=0.02, tokens=16)
    assert FidelityScore.read(score.model_dump()) == score
