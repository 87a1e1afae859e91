"""Gateway overhead: the same streaming load straight to a fast fake upstream and through
the gateway, in one run, at concurrency 1 and 64.

The fake upstream and the gateway each run in their own process (one uvicorn worker);
this process generates the load. Overhead is the difference of the latency percentiles
(to the last byte) between the two paths.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import httpx

from benchmarks.common import BenchResult, free_port

_ROUNDS = 4
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "stream": True}
_BODY_BYTES = json.dumps(BODY).encode()
_JSON = {"content-type": "application/json"}


@contextmanager
def _process(args: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args} did not start: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


async def _load(url: str, concurrency: int, num_requests: int) -> tuple[list[float], float]:
    """Latencies (s, to the last byte) of num_requests streams, `concurrency` at a time; and wall time."""
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    # aiohttp, not httpx: httpx's pool costs so much CPU at 64 connections that the load
    # generator, not the server, would set the latency of both paths.
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as client:
        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                start = time.perf_counter()
                async with client.post(url, data=_BODY_BYTES, headers=_JSON) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{url} answered {response.status}")
                    async for _ in response.content.iter_any():
                        pass
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def run(quick: bool, model: str | None) -> BenchResult:
    del model  # the fake upstream serves no real model
    num_requests = {1: 100 if quick else 400, 64: 640 if quick else 3200}
    num_chunks = 16
    up_port, gw_port = free_port(), free_port()
    db = tempfile.mkdtemp(prefix="kvrelay-bench-")
    gw_env = {"KVRELAY_UPSTREAMS": f'["http://127.0.0.1:{up_port}"]',
              "KVRELAY_DATABASE_URL": f"sqlite+aiosqlite:///{db}/records.db"}
    rows, metrics = [], {}
    with _process(["-m", "benchmarks.fake_upstream", "--port", str(up_port), "--chunks", str(num_chunks)], up_port), \
         _process(["-m", "uvicorn", "gateway.app:create_app", "--factory", "--port", str(gw_port),
                   "--log-level", "warning", "--no-access-log"], gw_port, gw_env):
        direct_url = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        gateway_url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        for concurrency, n in num_requests.items():
            asyncio.run(_load(gateway_url, concurrency, min(n, 64)))  # warm both paths
            asyncio.run(_load(direct_url, concurrency, min(n, 64)))
            direct, through, wall = [], [], 0.0
            for _ in range(_ROUNDS):  # alternate the paths so drift on a busy machine hits both
                direct += asyncio.run(_load(direct_url, concurrency, n // _ROUNDS))[0]
                lat, seconds = asyncio.run(_load(gateway_url, concurrency, n // _ROUNDS))
                through += lat
                wall += seconds
            for q in (50, 99):
                d, g = _pct(direct, q) * 1e3, _pct(through, q) * 1e3
                rows.append((f"p{q} latency ms @ {concurrency} streams", f"{g:.2f}", f"{d:.2f}", f"+{g - d:.2f} ms"))
                if concurrency == 64:
                    metrics[f"overhead_p{q}_ms"] = g - d
            rps = len(through) / wall
            rows.append((f"requests/s @ {concurrency} streams", f"{rps:.0f}", "", ""))
            if concurrency == 64:
                metrics["gateway_rps"] = rps
            else:
                metrics["overhead_p50_ms_c1"] = _pct(through, 50) * 1e3 - _pct(direct, 50) * 1e3
    config = {"quick": quick, "num_requests": num_requests, "chunks_per_stream": num_chunks,
              "gateway_workers": 1, "records": "sqlite"}
    return BenchResult("gateway", metrics, config, rows,
                       headers=("measure", "through gateway", "direct", "overhead"))
