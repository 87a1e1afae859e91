"""Brings the engines' fidelity probe results (GET /v1/kvrelay/fidelity?after=N, typed in
kvrelay/wire/reports.py) to the fidelity guard.

Each upstream has its own cursor. An upstream without the endpoint (vLLM, an older
engine) answers 404 or 405: it is asked again only after `QUIET_S`, and said so once
at debug level, so a mixed pool makes no log noise. An engine that restarted numbers
its results from 1 again: its `next` falls below our cursor, and the cursor follows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from kvrelay.gateway.approximation import APPROX_METHODS
from kvrelay.gateway.fidelity_guard import FidelityGuard, Score
from kvrelay.gateway.upstreams import UpstreamPool
from kvrelay.wire.reports import FIDELITY_PATH, FidelityScore

logger = logging.getLogger(__name__)

PATH = FIDELITY_PATH
QUIET_S = 300.0  # how long an upstream without the endpoint is left alone
_MISSING = (404, 405)


class FidelityPoller:
    def __init__(self, http: aiohttp.ClientSession, pool: UpstreamPool, guard: FidelityGuard,
                 interval_s: float, timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.http = http
        self.pool = pool
        self.guard = guard
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._cursor: dict[str, int] = {}
        self._quiet_until: dict[str, float] = {}
        self._scores_itself: dict[str, bool] = {}  # url -> whether it has the endpoint, once known
        self.num_errors = 0

    def scores_itself(self, url: str) -> bool | None:
        """Whether the upstream scores probes itself (None: not asked yet, or no clear answer)."""
        return self._scores_itself.get(url)

    async def run(self) -> None:
        """The loop a SupervisedTask runs."""
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)

    async def poll(self) -> int:
        """Ask every upstream once; the number of scores recorded."""
        counts = await asyncio.gather(*(self._poll(u.url) for u in self.pool.upstreams))
        return sum(counts)

    async def _poll(self, url: str) -> int:
        if self._clock() < self._quiet_until.get(url, 0.0):
            return 0
        after = self._cursor.get(url, 0)
        try:
            async with self.http.get(url + PATH, params={"after": str(after)},
                                     timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                if response.status in _MISSING:
                    self._scores_itself[url] = False
                    logger.debug("upstream %s has no %s (HTTP %d); asking again in %gs", url, PATH, response.status,
                                 QUIET_S)
                    self._quiet_until[url] = self._clock() + QUIET_S
                    return 0
                if response.status != 200:
                    self.num_errors += 1
                    return 0
                self._scores_itself[url] = True
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # Health checks report a down upstream; this loop just tries again next time.
            self.num_errors += 1
            logger.debug("polling %s%s failed: %s", url, PATH, type(exc).__name__)
            return 0
        return self._take(url, after, body)

    def _take(self, url: str, after: int, body: object) -> int:
        """Record the results of one answer and move the cursor; a malformed answer counts
        as an error and records nothing."""
        if not isinstance(body, dict) or not isinstance(body.get("results"), list) or \
                not isinstance(body.get("next"), int):
            self.num_errors += 1
            return 0
        scores = [s for s in map(_score, body["results"]) if s is not None]
        for score in scores:
            self.guard.record(score)
        nxt = body["next"]
        self._cursor[url] = nxt if nxt >= 0 else 0  # below `after`: the engine restarted, follow it
        if nxt < after:
            logger.info("upstream %s restarted its fidelity results; reading them from %d", url, nxt)
        return len(scores)


def _score(item: object) -> Score | None:
    """A result as a Score; None for anything malformed or for a method the gateway
    never made approximate."""
    score = FidelityScore.read(item)
    if score is None or score.method not in APPROX_METHODS:
        return None
    return Score(score.tenant, score.app, score.method, score.top1, score.kl, score.tokens)
