"""Brings each engine's resident blocks (GET /v1/kvrelay/cache, kvrelay/wire/cache_report.py)
into the gateway's CacheMap, for cache-aware routing.

Runs only under the `cache_aware` policy. Each answer replaces that replica's table, so
what the gateway believes about a replica is at most one interval stale, plus what it
routed there since (CacheMap adds those blocks at once). An upstream without the
endpoint (vLLM, an older engine) answers 404 or 405: it is asked again only after
`QUIET_S`, and its table is what the gateway routed there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from kvrelay.gateway.routing.cache_map import CacheMap
from kvrelay.gateway.upstreams import UpstreamPool
from kvrelay.wire.cache_report import CACHE_PATH, CacheReport

logger = logging.getLogger(__name__)

QUIET_S = 300.0
_MISSING = (404, 405)


class CachePoller:
    def __init__(self, http: aiohttp.ClientSession, pool: UpstreamPool, cache: CacheMap, interval_s: float,
                 timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.http = http
        self.pool = pool
        self.cache = cache
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._quiet_until: dict[str, float] = {}
        self.num_reports = 0
        self.num_errors = 0
        self.last_report_at: dict[str, float] = {}  # url -> monotonic time of its last report

    async def run(self) -> None:
        """The loop a SupervisedTask runs."""
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)

    async def poll(self) -> int:
        """Ask every upstream once; the number of reports taken."""
        taken = await asyncio.gather(*(self._poll(u.url) for u in self.pool.upstreams))
        return sum(taken)

    async def _poll(self, url: str) -> int:
        if self._clock() < self._quiet_until.get(url, 0.0):
            return 0
        try:
            async with self.http.get(url + CACHE_PATH,
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                if response.status in _MISSING:
                    logger.debug("upstream %s has no %s (HTTP %d); asking again in %gs", url, CACHE_PATH,
                                 response.status, QUIET_S)
                    self._quiet_until[url] = self._clock() + QUIET_S
                    return 0
                if response.status != 200:
                    self.num_errors += 1
                    return 0
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.num_errors += 1  # health checks report a down upstream; this loop tries again
            logger.debug("polling %s%s failed: %s", url, CACHE_PATH, type(exc).__name__)
            return 0
        report = CacheReport.read(body)
        if report is None:
            self.num_errors += 1
            return 0
        self.cache.replace(url, report)
        self.last_report_at[url] = self._clock()
        self.num_reports += 1
        return 1
