"""Benchmarks, one module each, run as `kvrelay bench NAME [--quick] [--json PATH]`.

Each module exposes `run(quick: bool, model: str | None) -> BenchResult` and measures
kvrelay and its baseline side by side in the same process and run, so the ratios hold
on a noisy machine even when absolute times drift.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from benchmarks.common import BenchResult
from benchmarks.common import report as write_report  # not `report`: that name is the benchmarks.report module

BENCHMARKS: dict[str, str] = {
    "agents": "benchmarks.agents",
    "collective": "benchmarks.collective",
    "dtype": "benchmarks.dtype",
    "engine": "benchmarks.engine",
    "faithful": "benchmarks.faithful",
    "gateway": "benchmarks.gateway",
    "grammars": "benchmarks.grammars",
    "icarus": "benchmarks.icarus",
    "inference": "benchmarks.inference",
    "kvcomm": "benchmarks.kvcomm",
    "kvflow": "benchmarks.kvflow",
    "pic": "benchmarks.pic",
    "reliability": "benchmarks.reliability",
    "vllm": "benchmarks.vllm",
}


def run_benchmark(name: str, quick: bool, json_path: Path | None, model: str | None) -> BenchResult:
    module = importlib.import_module(BENCHMARKS[name])
    result: BenchResult = module.run(quick=quick, model=model)
    write_report(result, json_path)
    return result


__all__ = ["BENCHMARKS", "BenchResult", "run_benchmark"]
