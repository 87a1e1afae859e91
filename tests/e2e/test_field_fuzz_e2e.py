"""Field fuzzing through real processes (benchmarks/field_fuzz.py): a gateway recording to
SQLite in front of an engine on the tiny model, both started with the CLI, 800 hostile
bodies (derandomized: the same ones every run) sent in batches of 50 to the gateway, and
those it does not answer with 200 straight to the engine too. After each batch: no server
error from either, every request to the gateway recorded exactly once, /ready, /health
and /metrics answer 200, and a normal request still gets an answer.
`kvrelay bench reliability` runs 5,000 such cases on the real model."""

from __future__ import annotations

import pytest

from benchmarks.field_fuzz import run_field_fuzz

pytestmark = pytest.mark.slow

NUM_CASES, BATCH = 800, 50


def test_hostile_fields_never_break_the_stack(llama_dir, tmp_path):
    result = run_field_fuzz(str(llama_dir), tmp_path, NUM_CASES, BATCH, seed=0)
    report = result.summary()
    assert result.cases == NUM_CASES and NUM_CASES < result.requests < 2 * NUM_CASES
    assert result.server_errors == 0, report
    assert result.records_lost == 0 and result.records_extra == 0, report
    assert result.broken_batches == 0, report
    assert result.timeouts == 0, report
