"""Sends requests to upstreams: failover, retries, timeouts, breakers, health checks.

A request is retried (on another upstream when there is one) only on connection
errors and 502/503, and only before any byte reached the client: those failures mean
the upstream never started the work, so a retry cannot duplicate a generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NamedTuple

import httpx

from gateway.errors import ModelNotFoundError, NoUpstreamError, UpstreamTimeoutError, UpstreamUnreachableError
from gateway.settings import GatewaySettings
from gateway.upstreams import Upstream, UpstreamPool

logger = logging.getLogger(__name__)
_RETRYABLE_STATUS = (502, 503)


class Dispatch(NamedTuple):
    upstream: Upstream
    response: httpx.Response  # headers received; body not yet read
    sent_at: float  # perf_counter when the request went out


def build_http_client(settings: GatewaySettings) -> httpx.AsyncClient:
    t = settings.timeouts
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=t.connect_s, read=t.idle_s, write=t.idle_s, pool=t.connect_s),
        limits=httpx.Limits(max_connections=settings.max_connections,
                            max_keepalive_connections=settings.max_keepalive_connections),
    )


class UpstreamClient:
    def __init__(self, http: httpx.AsyncClient, pool: UpstreamPool, settings: GatewaySettings) -> None:
        self.http = http
        self.pool = pool
        self.settings = settings

    @asynccontextmanager
    async def dispatch(self, path: str, body: bytes, headers: dict[str, str], model: str,
                       session_id: str | None) -> AsyncIterator[Dispatch]:
        """Open the response of the first upstream that accepts the request."""
        candidates = self.pool.candidates(model, session_id)
        if not candidates:
            if self.pool.knows_no(model):
                raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
            raise NoUpstreamError(f"no healthy upstream serves model {model!r}")
        last_error = "no attempt"
        for attempt in range(self.settings.retries + 1):
            upstream = candidates[attempt % len(candidates)]
            upstream.in_flight += 1
            try:
                response = await self._send(upstream, path, body, headers)
            except httpx.TransportError as exc:  # connect errors and the like: never reached the engine
                upstream.in_flight -= 1
                upstream.record_failure(time.monotonic())
                last_error = f"{upstream.url}: {type(exc).__name__}"
                continue
            except BaseException:
                upstream.in_flight -= 1
                raise
            if response.status_code in _RETRYABLE_STATUS:
                await response.aclose()
                upstream.in_flight -= 1
                upstream.record_failure(time.monotonic())
                last_error = f"{upstream.url}: HTTP {response.status_code}"
                continue
            if response.status_code >= 500:
                upstream.record_failure(time.monotonic())
            else:
                upstream.record_success()
            try:
                yield Dispatch(upstream, response, time.perf_counter())
            finally:
                upstream.in_flight -= 1
                await response.aclose()
            return
        raise UpstreamUnreachableError(f"no upstream accepted the request ({last_error})")

    async def _send(self, upstream: Upstream, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        request = self.http.build_request("POST", upstream.url + path, content=body, headers=headers)
        try:
            return await asyncio.wait_for(self.http.send(request, stream=True),
                                          self.settings.timeouts.first_byte_s)
        except (TimeoutError, httpx.ReadTimeout) as exc:
            # The engine may be working on it: a retry could run the generation twice.
            upstream.record_failure(time.monotonic())
            raise UpstreamTimeoutError(f"{upstream.url} sent no response within "
                                       f"{self.settings.timeouts.first_byte_s:g}s") from exc

    # -- health --------------------------------------------------------------------------
    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.pool.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        try:
            health = await self.http.get(upstream.url + "/health", timeout=self.settings.timeouts.connect_s)
            ok = health.status_code == 200
            if ok:
                models = await self.http.get(upstream.url + "/v1/models", timeout=self.settings.timeouts.connect_s)
                if models.status_code == 200:
                    upstream.models = frozenset(m["id"] for m in models.json().get("data", []))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            ok = False
        if ok and not upstream.healthy:
            logger.info("upstream %s is healthy again", upstream.url)
        if not ok and upstream.healthy:
            logger.warning("upstream %s failed its health check", upstream.url)
        # A passing health check does not close the breaker: an upstream can answer /health
        # and still fail every completion. Only a successful request resets it.
        upstream.healthy = ok

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.settings.health_interval_s)
