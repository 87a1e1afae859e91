"""The engine's reuse counters (engine /metrics) count what the methods did."""

from __future__ import annotations

import pytest

from engine_ext.server.reuse_metrics import reuse_metrics
from tests.engine_ext.collective.round_support import Round, engine, run_all


@pytest.fixture(scope="module")
def deep_llama(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4)


def _counters(text: str) -> dict[str, float]:
    return {name: float(value) for line in text.splitlines() if not line.startswith("#")
            for name, _, value in [line.rpartition(" ")]}


def test_a_collective_round_shows_in_the_counters(deep_llama):
    eng = engine(deep_llama)
    before = _counters(reuse_metrics(eng.reuse_counters()))
    assert before["kvrelay_engine_collective_rounds_total"] == 0
    assert before['kvrelay_engine_kvcomm_tokens_total{kind="predicted"}'] == 0
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    rnd.add(eng, publish=True)
    run_all(eng)
    after = _counters(reuse_metrics(eng.reuse_counters()))
    assert after["kvrelay_engine_collective_rounds_total"] == 1
    assert after["kvrelay_engine_collective_members_total"] == 3
    store = eng.diff_store
    assert store.num_rounds == 1 and store.mirror_bytes > 0
    assert after["kvrelay_engine_round_mirror_bytes_total"] == store.mirror_bytes
    # Mirrors keep the blocks that differ from the master's: less than their dense bytes.
    assert 0 < store.mirror_bytes < after["kvrelay_engine_round_mirrored_dense_bytes_total"]
    assert after["kvrelay_engine_background_steps_interrupted_total"] == 0
