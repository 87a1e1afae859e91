"""Gateway overhead: the same streaming load straight to a fast fake upstream and through
the gateway, in one run, at concurrency 1 and 64.

Four kinds of process: the fake upstream, the gateway (`kvrelay gateway`, as a user
starts it), the load generator (benchmarks/gateway_load.py) and this driver, which only
sends commands and reads /proc. With two CPUs or more, the gateway is pinned to half of
them (at least one, one left) and runs one worker per CPU it has (`--workers`: replicas
sharing inferred state through the SQLite file); the rest share the others, so the load
generator and the upstream cannot starve the gateway (nor the gateway them); the
placement and the number of workers are in the config and the table.

A third path is the floor: a bare relay (benchmarks/bare_relay.py) on the same server and
client libraries, pinned and given workers as the gateway, that forwards bytes and does
nothing else. The gateway's figures less the relay's are what kvrelay's own work costs;
the relay's are what any Python gateway on these libraries pays on this machine.

Two figures:
- overhead: the difference of the latency percentiles (to the last byte) of the two
  paths, measured in alternating rounds so drift hits both alike. A difference of
  percentiles is not a percentile of the per-request overhead: when one path's tail is
  set by a few stray pauses of the load generator, it can even come out negative. The
  warm-up (connections opened before any measured round, kept alive across rounds), the
  load generator's collector being off during a load, and enough requests per figure
  are there to keep the tail about the servers.
- the gateway's CPU time per request (user + system, all threads, from /proc), summed
  over the through-gateway rounds: what one streamed request costs the gateway,
  whatever the scheduler did. At 64 streams on one worker it bounds the throughput
  (1 / cpu per request) and, with 64 requests queued on that core, the latency.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import IO


from benchmarks.common import BenchResult, free_port, wait_healthy
from benchmarks.cpu import Placement, cpu_seconds, pin_self, pinned, settled_cpu_seconds, split_cpus, tree_cpu_seconds

_NUM_CHUNKS = 16
_CLI = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"  # kvrelay ...


@contextmanager
def _server(args: list[str], port: int, cpus: frozenset[int],
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=partial(pin_self, cpus))
    try:
        wait_healthy(proc, port, lambda: proc.stderr.read().decode() if proc.stderr else "")
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


class _LoadGenerator:
    """The load generator process, driven one command at a time over its stdin/stdout."""

    def __init__(self, cpus: frozenset[int]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.gateway_load"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, preexec_fn=partial(pin_self, cpus))
        self.pid = self.proc.pid

    def load(self, url: str, concurrency: int, num_requests: int) -> tuple[list[float], float]:
        stdin, stdout = self._pipes()
        stdin.write((json.dumps({"url": url, "concurrency": concurrency, "requests": num_requests}) + "\n").encode())
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited ({self.proc.wait()}) on {url}")
        answer = json.loads(line)
        return answer["latencies"], answer["wall_s"]

    def _pipes(self) -> tuple[IO[bytes], IO[bytes]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        return self.proc.stdin, self.proc.stdout

    def close(self) -> None:
        self._pipes()[0].close()
        self.proc.wait(10)


@dataclass
class _Level:
    """What one concurrency level measured, summed over its rounds."""

    direct: list[float] = field(default_factory=list)
    through: list[float] = field(default_factory=list)
    round_p50_overheads: list[float] = field(default_factory=list)  # s, one per alternation round
    through_wall_s: float = 0.0
    gateway_cpu_s: float = 0.0  # settled: includes the records written after the load
    gateway_busy_s: float = 0.0  # during the loads only
    others_busy_s: float = 0.0  # load generator + fake upstream, during the through loads
    relay: list[float] = field(default_factory=list)  # the bare relay's latencies
    relay_wall_s: float = 0.0
    relay_cpu_s: float = 0.0


def _measure(load: _LoadGenerator, gateway_pid: int, upstream_pid: int, relay_pid: int, direct_url: str,
             gateway_url: str, relay_url: str, concurrency: int, num_requests: int, rounds: int) -> _Level:
    level = _Level()
    warmup = max(4 * concurrency, 32)  # opens every connection, warms every server's code paths
    load.load(gateway_url, concurrency, warmup)
    load.load(relay_url, concurrency, warmup)
    load.load(direct_url, concurrency, warmup)
    settled_cpu_seconds(gateway_pid)
    for _ in range(rounds):  # alternate the paths so drift on a busy machine hits both
        direct = load.load(direct_url, concurrency, num_requests // rounds)[0]
        gw_before = settled_cpu_seconds(gateway_pid)
        others_before = _cpu_sum(load.pid, upstream_pid)
        latencies, wall = load.load(gateway_url, concurrency, num_requests // rounds)
        others_after, gw_after = _cpu_sum(load.pid, upstream_pid), tree_cpu_seconds(gateway_pid)
        gw_settled = settled_cpu_seconds(gateway_pid)
        level.round_p50_overheads.append(_pct(latencies, 50) - _pct(direct, 50))
        level.direct += direct
        level.through += latencies
        level.through_wall_s += wall
        if None not in (gw_before, gw_after, gw_settled, others_before, others_after):
            level.gateway_cpu_s += gw_settled - gw_before  # type: ignore[operator]
            level.gateway_busy_s += gw_after - gw_before  # type: ignore[operator]
            level.others_busy_s += others_after - others_before  # type: ignore[operator]
        relay_before = settled_cpu_seconds(relay_pid)
        relay, relay_wall = load.load(relay_url, concurrency, num_requests // rounds)
        relay_after = settled_cpu_seconds(relay_pid)
        level.relay += relay
        level.relay_wall_s += relay_wall
        if relay_before is not None and relay_after is not None:
            level.relay_cpu_s += relay_after - relay_before
    return level


def _cpu_sum(*pids: int) -> float | None:
    times = [cpu_seconds(pid) for pid in pids]
    return None if None in times else sum(times)  # type: ignore[arg-type]


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def run(quick: bool, model: str | None) -> BenchResult:
    del model  # the fake upstream serves no real model
    num_requests = {1: 400 if quick else 1600, 64: 2560 if quick else 12800}
    rounds = 4 if quick else 8
    placement = split_cpus(tested_share=0.5)
    workers = max(1, len(placement.tested))
    with pinned(placement.others):  # the driver too keeps off the gateway's CPU
        rows, metrics = _run_all(placement, workers, num_requests, rounds)
    rows.append(("CPU placement", *placement.describe(), ""))
    rows.append(("gateway workers", str(workers), "", ""))
    config = {"quick": quick, "num_requests": num_requests, "rounds": rounds, "chunks_per_stream": _NUM_CHUNKS,
              "gateway_workers": workers, "records": "sqlite", "keep_alive": True,
              "cpu_placement": {"gateway": sorted(placement.tested),
                                "load_generator_fake_upstream_driver": sorted(placement.others)}}
    return BenchResult("gateway", metrics, config, rows,
                       headers=("measure", "through gateway", "direct", "overhead"))


def _run_all(placement: Placement, workers: int, num_requests: dict[int, int],
             rounds: int) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    """Start the fake upstream, the gateway and the load generator; measure each concurrency level."""
    up_port, gw_port, relay_port = free_port(), free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-gateway-") as db:
        return _run_in(placement, workers, num_requests, rounds, (up_port, gw_port, relay_port), db)


def _run_in(placement: Placement, workers: int, num_requests: dict[int, int], rounds: int,
            ports: tuple[int, int, int], db: str) -> tuple[list[tuple[str, str, str, str]], dict[str, float]]:
    up_port, gw_port, relay_port = ports
    gw_env = {"KVRELAY_UPSTREAMS": f'["http://127.0.0.1:{up_port}"]',
              "KVRELAY_DATABASE_URL": f"sqlite+aiosqlite:///{db}/records.db"}
    rows: list[tuple[str, str, str, str]] = []
    metrics: dict[str, float] = {}
    with _server(["-m", "benchmarks.fake_upstream", "--port", str(up_port), "--chunks", str(_NUM_CHUNKS)],
                 up_port, placement.others) as upstream, \
         _server(["-c", _CLI, "gateway", "--port", str(gw_port), "--workers", str(workers), "--log-level", "warning"],
                 gw_port, placement.tested, gw_env) as gateway, \
         _server(["-m", "benchmarks.bare_relay", "--port", str(relay_port), "--upstream",
                  f"http://127.0.0.1:{up_port}", "--workers", str(workers)], relay_port, placement.tested) as relay:
        load = _LoadGenerator(placement.others)
        try:
            direct_url = f"http://127.0.0.1:{up_port}/v1/chat/completions"
            gateway_url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            relay_url = f"http://127.0.0.1:{relay_port}/v1/chat/completions"
            for concurrency, n in num_requests.items():
                level = _measure(load, gateway.pid, upstream.pid, relay.pid, direct_url, gateway_url, relay_url,
                                 concurrency, n, rounds)
                rows += _rows(level, concurrency)
                metrics.update(_metrics(level, concurrency))
        finally:
            load.close()
    return rows, metrics


def _rows(level: _Level, concurrency: int) -> list[tuple[str, str, str, str]]:
    rows = []
    for q in (50, 99):
        d, g = _pct(level.direct, q) * 1e3, _pct(level.through, q) * 1e3
        rows.append((f"p{q} latency ms @ {concurrency} streams", f"{g:.2f}", f"{d:.2f}", f"{g - d:+.2f} ms"))
    spread = level.round_p50_overheads
    rows.append((f"p50 overhead per round @ {concurrency} streams", "", "",
                 f"{min(spread) * 1e3:+.2f} .. {max(spread) * 1e3:+.2f} ms"))
    rows.append((f"requests/s @ {concurrency} streams", f"{len(level.through) / level.through_wall_s:.0f}", "", ""))
    if level.gateway_cpu_s:
        wall = level.through_wall_s
        rows.append((f"gateway CPU ms/request @ {concurrency} streams",
                     f"{level.gateway_cpu_s * 1e3 / len(level.through):.3f}", "", ""))
        rows.append((f"CPU busy during its loads @ {concurrency} streams", f"gateway {level.gateway_busy_s / wall:.0%}",
                     f"load gen + upstream {level.others_busy_s / wall:.0%}", ""))
    for q in (50, 99):
        d, r = _pct(level.direct, q) * 1e3, _pct(level.relay, q) * 1e3
        rows.append((f"bare relay: p{q} latency ms @ {concurrency} streams", f"{r:.2f}", f"{d:.2f}", f"{r - d:+.2f} ms"))
    if level.relay_cpu_s:
        rows.append((f"bare relay: CPU ms/request @ {concurrency} streams",
                     f"{level.relay_cpu_s * 1e3 / len(level.relay):.3f}", "", ""))
    return rows


def _metrics(level: _Level, concurrency: int) -> dict[str, float]:
    suffix = "" if concurrency == 64 else f"_c{concurrency}"
    metrics = {f"overhead_p50_ms{suffix}": (_pct(level.through, 50) - _pct(level.direct, 50)) * 1e3}
    if concurrency == 64:
        metrics["overhead_p99_ms"] = (_pct(level.through, 99) - _pct(level.direct, 99)) * 1e3
        metrics["gateway_rps"] = len(level.through) / level.through_wall_s
    if level.gateway_cpu_s:
        metrics[f"gateway_cpu_ms_per_request{suffix}"] = level.gateway_cpu_s * 1e3 / len(level.through)
    metrics[f"relay_overhead_p50_ms{suffix}"] = (_pct(level.relay, 50) - _pct(level.direct, 50)) * 1e3
    if concurrency == 64:
        metrics["relay_overhead_p99_ms"] = (_pct(level.relay, 99) - _pct(level.direct, 99)) * 1e3
    if level.relay_cpu_s:
        metrics[f"relay_cpu_ms_per_request{suffix}"] = level.relay_cpu_s * 1e3 / len(level.relay)
    return metrics
