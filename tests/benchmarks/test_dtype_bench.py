"""bench dtype's judges on a tiny Llama: an engine against itself passes the exact bar,
and a change of dtype is seen."""

from __future__ import annotations

import torch

from benchmarks.dtype import EXACT_KL, cross_fidelity, self_exactness
from engine_ext.fidelity import FidelityHarness
from tests.helpers import make_engine


def _prompts() -> list[list[int]]:
    return [torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 57, 73)]


def test_fp32_prefix_hits_and_batches_meet_the_exact_bar_against_its_own_dense_runs(llama_dir):
    engine = make_engine(llama_dir, num_blocks=64)
    result = self_exactness(engine, FidelityHarness(engine, num_tokens=8), _prompts())
    assert result["prefix_hit_top1"] == 1.0 and result["prefix_hit_kl"] < EXACT_KL
    assert result["batched_top1"] == 1.0 and result["batched_kl"] < EXACT_KL
    assert result["prefix_hit_greedy"] == result["batched_greedy"] == 1.0


def test_cross_fidelity_is_perfect_for_the_same_dtype_and_sees_bf16(llama_dir):
    fp32 = FidelityHarness(make_engine(llama_dir, num_blocks=64), num_tokens=8)
    same = cross_fidelity(fp32, FidelityHarness(make_engine(llama_dir, num_blocks=64), num_tokens=8), _prompts())
    assert same["top1_min"] == 1.0 and same["kl_max"] < 1e-9 and same["greedy_match"] == 1.0
    bf16 = FidelityHarness(make_engine(llama_dir, num_blocks=64, dtype="bfloat16"), num_tokens=8)
    changed = cross_fidelity(fp32, bf16, _prompts())
    assert changed["kl_max"] > 1e-6  # bf16 rounding shows in the distributions
