"""`kvrelay bench gateway` reports its metrics, its CPU placement and the gateway's CPU
time per request; benchmarks.cpu reads a process's CPU time. No timing is asserted."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import run_benchmark
from benchmarks.cpu import cpu_seconds, split_cpus, tree_cpu_seconds


@pytest.mark.slow
def test_gateway_bench_quick_writes_the_issue_metrics(tmp_path):
    out = tmp_path / "gateway.json"
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    run_benchmark("gateway", quick=True, json_path=out, model=None)
    if affinity is not None:
        assert os.sched_getaffinity(0) == affinity  # the driver's pinning is undone
    data = json.loads(out.read_text())
    assert data["name"] == "gateway" and set(data) >= {"metrics", "config", "machine"}
    metrics = data["metrics"]
    assert {"overhead_p50_ms", "overhead_p99_ms", "overhead_p50_ms_c1", "gateway_rps"} <= set(metrics)
    assert metrics["gateway_rps"] > 0
    assert {"relay_overhead_p50_ms", "relay_overhead_p99_ms", "relay_overhead_p50_ms_c1"} <= set(metrics)
    if os.path.exists("/proc/self/stat"):
        assert metrics["gateway_cpu_ms_per_request"] > 0 and metrics["gateway_cpu_ms_per_request_c1"] > 0
        assert metrics["relay_cpu_ms_per_request"] > 0 and metrics["relay_cpu_ms_per_request_c1"] > 0
    placement = data["config"]["cpu_placement"]
    assert not set(placement["gateway"]) & set(placement["load_generator_fake_upstream_driver"])
    assert data["config"]["gateway_workers"] == max(1, len(placement["gateway"]))  # one per CPU it has


def test_split_cpus_gives_the_tested_process_a_cpu_of_its_own():
    placement = split_cpus()
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(available) < 2:
        assert not placement.tested and not placement.others
    else:
        assert len(placement.tested) == 1 and placement.tested | placement.others == available
        assert not placement.tested & placement.others
        half = split_cpus(tested_share=0.5)  # the gateway's: half, at least one, one left over
        assert len(half.tested) == max(1, len(available) // 2) and half.others and not half.tested & half.others


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_cpu_seconds_counts_this_process():
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(3_000_000))  # some CPU, however fast the machine
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after >= before >= 0
    assert cpu_seconds(2**22 + 12345) is None  # no such process


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_tree_cpu_seconds_counts_the_workers_below_a_process():
    """A server started with --workers spends its CPU in its children."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (cpu_seconds(child.pid) or 0) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        own, tree = cpu_seconds(os.getpid()), tree_cpu_seconds(os.getpid())
        assert own is not None and tree is not None and tree >= own + 0.4
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds(2**22 + 12345) is None
