"""Benchmarks, one module each, run as `kvrelay bench NAME [--quick] [--json PATH] [--family F]`.

Each module exposes `run(quick: bool, model: str | None) -> BenchResult` and measures
kvrelay and its baseline side by side in the same process and run, so the ratios hold
on a noisy machine even when absolute times drift. A module with several workload
families also lists them in `FAMILIES` (the first is its default) and takes
`run(..., family=NAME)`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from benchmarks.common import BenchResult
from benchmarks.common import report as write_report  # not `report`: that name is the benchmarks.report module

BENCHMARKS: dict[str, str] = {
    "agents": "benchmarks.agents",
    "cluster": "benchmarks.cluster",
    "cluster_vllm": "benchmarks.cluster_vllm",
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
    "replicas": "benchmarks.replicas",
    "vllm": "benchmarks.vllm",
}


def run_benchmark(name: str, quick: bool, json_path: Path | None, model: str | None,
                  family: str | None = None) -> BenchResult:
    """Run one benchmark and report it; ValueError for a family it does not have."""
    module = importlib.import_module(BENCHMARKS[name])
    families: tuple[str, ...] = getattr(module, "FAMILIES", ())
    if family is not None and family not in families:
        offered = f"families: {', '.join(families)}" if families else "it has one workload family"
        raise ValueError(f"bench {name}: no family {family!r} ({offered})")
    options = {"family": family} if family is not None else {}
    result: BenchResult = module.run(quick=quick, model=model, **options)
    write_report(result, json_path)
    return result


__all__ = ["BENCHMARKS", "BenchResult", "run_benchmark"]
