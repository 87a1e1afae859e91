"""What every benchmark shares: the result shape, the machine description, the report."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class BenchResult:
    name: str
    metrics: dict[str, float]
    config: dict[str, Any]
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # measure, kvrelay, baseline, ratio
    headers: tuple[str, str, str, str] = ("measure", "kvrelay", "baseline", "kvrelay/baseline")


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released), for a server a bench starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # typeshed types a socket address as Any


def wait_healthy(proc: subprocess.Popen[bytes], port: int, output: Callable[[], str], timeout_s: float = 60.0) -> None:
    """Until the server `proc` started answers 200 on /health; RuntimeError with the end of
    its `output` if it exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} did not start: {output()[-800:]}")
        time.sleep(0.1)


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest wall time of `repeats` calls, in seconds (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def paired_best_of(fn_a: Callable[[], Any], fn_b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Fastest wall times of A and B, run alternately (A B A B ...) so drift hits both alike."""
    times_a, times_b = [], []
    for _ in range(repeats):
        times_a.append(best_of(fn_a, 1))
        times_b.append(best_of(fn_b, 1))
    return min(times_a), min(times_b)


def cpu_ticks() -> tuple[int, int]:
    """(all CPU ticks, idle ticks) since boot, summed over the machine's CPUs (Linux)."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]  # idle + iowait


def wait_quiet(max_s: float = 10.0, window_s: float = 0.2, busy_share: float = 0.1,
               ticks: Callable[[], tuple[int, int]] = cpu_ticks) -> float:
    """Wait until the CPUs were at most `busy_share` busy over one `window_s`, or `max_s`
    passed; the seconds waited.

    Why: stacks that take turns on the same cores must not pay for each other. A vLLM
    that has just answered keeps polling its message queue for a second (vLLM's
    shm_broadcast busy loop). With three vLLM stacks taking turns on two cores, the next
    stack's first request ran 0.6-1.2 s instead of 0.1-0.3 s, on whichever stack came
    next, even after a warm-up request; waiting for quiet (1.0-1.2 s each time) removed
    it, and adapts to however long a stack's background work lasts."""
    start = time.monotonic()
    total, idle = ticks()
    while time.monotonic() - start < max_s:
        time.sleep(window_s)
        now_total, now_idle = ticks()
        busy = 1.0 - (now_idle - idle) / max(1, now_total - total)
        total, idle = now_total, now_idle
        if busy <= busy_share:
            break
    return time.monotonic() - start


def format_table(headers: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def report(result: BenchResult, json_path: Path | None) -> None:
    print(format_table(result.headers, result.rows))
    print()
    print(format_table(("metric", "value"), [(k, f"{v:.3f}") for k, v in result.metrics.items()]))
    if json_path is not None:
        payload = {"name": result.name, "metrics": result.metrics, "config": result.config, "machine": machine_info()}
        Path(json_path).write_text(json.dumps(payload, indent=2))
