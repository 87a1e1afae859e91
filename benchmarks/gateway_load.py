"""The gateway benchmark's load generator, in a process of its own.

Run as `python -m benchmarks.gateway_load`: it reads one JSON command per line on stdin,
`{"url": ..., "concurrency": C, "requests": N}`, sends N streaming requests C at a time,
and answers one JSON line on stdout: `{"latencies": [s, ...], "wall_s": s}`.

Why a process of its own: in the driver's process, the load generator's CPU and the
driver's bookkeeping shared an event loop and a core with whatever else ran there, and
its pauses landed in the latencies of whichever path happened to be measured. Here it
can be pinned to a core away from the gateway. Two more things keep its own noise out
of the tail it measures:
- one keep-alive session per (url, concurrency), kept across commands, so connection
  setup happens in the warm-up, not in a measured round of one path only;
- the collector is off during a load (and the heap frozen before it), so a GC pause of
  the generator cannot become a p99 outlier of one path.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time

import aiohttp

BODY = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "stream": True}
_BODY_BYTES = json.dumps(BODY).encode()
_JSON = {"content-type": "application/json"}


class LoadGenerator:
    def __init__(self) -> None:
        self._sessions: dict[tuple[str, int], aiohttp.ClientSession] = {}

    def _session(self, url: str, concurrency: int) -> aiohttp.ClientSession:
        key = (url, concurrency)
        if key not in self._sessions:
            # aiohttp, not httpx: httpx's pool costs so much CPU at 64 connections that the
            # load generator, not the server, would set the latency of both paths.
            connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
            self._sessions[key] = aiohttp.ClientSession(connector=connector,
                                                        timeout=aiohttp.ClientTimeout(total=60))
        return self._sessions[key]

    async def load(self, url: str, concurrency: int, num_requests: int) -> tuple[list[float], float]:
        """Latencies (s, to the last byte) of num_requests streams, `concurrency` at a time; and wall time."""
        client = self._session(url, concurrency)
        latencies: list[float] = []
        remaining = num_requests

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                async with await _post(client, url) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{url} answered {response.status}")
                    async for _ in response.content.iter_any():
                        pass
                latencies.append(time.perf_counter() - start)

        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return latencies, time.perf_counter() - start
        finally:
            gc.enable()
            gc.unfreeze()

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


async def _post(client: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """The request, sent again once if the kept-alive connection it went out on turned out
    closed: a server closes a connection idle past its keep-alive timeout (uvicorn: 5 s),
    and on a slow machine a path's connections idle that long while the other paths'
    rounds run. Any HTTP client retries this (the OpenAI SDK does); the retry's time
    counts in the request's latency."""
    try:
        return await client.post(url, data=_BODY_BYTES, headers=_JSON)
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        return await client.post(url, data=_BODY_BYTES, headers=_JSON)


async def serve() -> None:
    """Answer commands from stdin until it closes."""
    generator = LoadGenerator()
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = json.loads(line)
            latencies, wall = await generator.load(command["url"], command["concurrency"], command["requests"])
            sys.stdout.write(json.dumps({"latencies": latencies, "wall_s": wall}) + "\n")
            sys.stdout.flush()
    finally:
        await generator.close()


if __name__ == "__main__":
    asyncio.run(serve())
