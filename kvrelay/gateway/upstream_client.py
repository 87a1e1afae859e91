"""Sends requests to upstreams: failover, retries, timeouts, breakers, health checks.

A request is retried (on another upstream when there is one) only on connection
errors and 502/503, and only before any byte reached the client: those failures mean
the upstream never started the work, so a retry cannot duplicate a generation.

Proxied requests go through the lean HTTP/1.1 client of kvrelay/gateway/http1.py (why
is said there); health checks and the background pollers use aiohttp. Neither client's
exceptions leave this module: callers see the gateway's own errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import NamedTuple
from urllib.parse import urlsplit

import aiohttp

from kvrelay.gateway.errors import (GatewayInternalError, ModelNotFoundError, NoUpstreamError, UpstreamFailedError,
                                    UpstreamTimeoutError, UpstreamUnreachableError)
from kvrelay.gateway.http1 import BodyBrokenError, Connection, ConnectFailedError, HttpClient, Origin, request_head
from kvrelay.gateway.idle_watch import IdleTimeout, IdleWatch
from kvrelay.gateway.settings import GatewaySettings
from kvrelay.gateway.routing.policies import Route
from kvrelay.gateway.upstreams import Upstream, UpstreamPool
from kvrelay.json_values import encodable

logger = logging.getLogger(__name__)
_MAX_MODELS = 1024  # models read from one upstream's listing
_RETRYABLE_STATUS = (502, 503)


class UpstreamResponse:
    """An upstream's answer, headers received. Its body is read through here, and a
    stall or a broken connection comes out as UpstreamTimeoutError / UpstreamFailedError."""

    def __init__(self, url: str, client: HttpClient, conn: Connection, idle_s: float) -> None:
        self._url = url
        self._client = client
        self._conn = conn
        self._idle_s = idle_s
        self._released = False
        self.status = conn.status

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout(self._idle_s):
                return await self._conn.read()
        except TimeoutError as exc:
            raise UpstreamTimeoutError(f"{self._url} stalled mid-response") from exc
        except BodyBrokenError as exc:
            raise UpstreamFailedError(f"{self._url} broke the connection: {exc}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; no chunk may take longer than idle_s."""
        conn = self._conn
        watch = IdleWatch(conn, self._idle_s)  # one timer per idle period, not one per chunk
        try:
            while True:
                watch.reading()
                chunk = await conn.readany()
                watch.done()
                if not chunk:
                    return
                yield chunk
        except IdleTimeout as exc:
            raise UpstreamTimeoutError(f"{self._url} stalled mid-stream") from exc
        except BodyBrokenError as exc:
            raise UpstreamFailedError(f"{self._url} broke the stream: {exc}") from exc
        finally:
            watch.close()

    def close(self) -> None:
        """Keep the connection for reuse when the body was read to the end; otherwise drop
        it, which is also how a client's disconnect cancels the upstream's generation."""
        if not self._released:
            self._released = True
            self._client.release(self._conn)


class Occupancy:
    """A request's share of an upstream's load: counted in `in_flight`, and its prompt
    tokens to compute (`prefill_tokens`) in `in_flight_tokens` until its first token,
    when the prefill is done and only decoding is left (what cache-aware routing weighs)."""

    def __init__(self, upstream: Upstream, prefill_tokens: int) -> None:
        self.upstream = upstream
        self.prefill_tokens = prefill_tokens
        upstream.in_flight += 1
        upstream.in_flight_tokens += prefill_tokens

    def prefilled(self) -> None:
        self.upstream.in_flight_tokens -= self.prefill_tokens
        self.prefill_tokens = 0

    def release(self) -> None:
        self.prefilled()
        self.upstream.in_flight -= 1


class Dispatch(NamedTuple):
    """An upstream's response to a request, opened by UpstreamClient.dispatch; `close()` it
    exactly once, however the call ends."""

    upstream: Upstream
    response: UpstreamResponse
    sent_at: float  # perf_counter when the request went out
    occupancy: Occupancy

    def close(self) -> None:
        self.occupancy.release()
        self.response.close()


def build_proxy_client(settings: GatewaySettings) -> HttpClient:
    """The proxied requests' client; call inside the running event loop."""
    return HttpClient(settings.max_connections, settings.keepalive_s, settings.timeouts.connect_s)


def build_http_client(settings: GatewaySettings) -> aiohttp.ClientSession:
    """One session for the background calls to all upstreams; call inside the running event loop."""
    t = settings.timeouts
    connector = aiohttp.TCPConnector(limit=settings.max_connections, limit_per_host=0,
                                     keepalive_timeout=settings.keepalive_s)
    # Header and body timeouts are applied per call (first_byte_s, idle_s); these bound
    # connecting and a stuck write.
    timeout = aiohttp.ClientTimeout(total=None, connect=t.connect_s, sock_connect=t.connect_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True)


class UpstreamClient:
    def __init__(self, http: aiohttp.ClientSession, pool: UpstreamPool, settings: GatewaySettings,
                 proxy: HttpClient) -> None:
        self.http = http  # health checks
        self.proxy = proxy  # proxied requests
        self.pool = pool
        self.settings = settings
        self._targets: dict[str, tuple[Origin, str]] = {}  # upstream URL -> (origin, base path)

    async def dispatch(self, path: str, body: bytes, headers: dict[str, str], model: str,
                       session_id: str | None, hold: bool = False, route: Route | None = None) -> Dispatch:
        """Open the response of the first upstream that accepts the request. A plain call
        and `Dispatch.close()`, not a context manager: an async generator's context costs
        more per request than the rest of this method."""
        candidates = self.pool.candidates(model, session_id, hold, route)
        if not candidates:
            if self.pool.knows_no(model):
                raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
            raise NoUpstreamError(f"no healthy upstream serves model {model!r}")
        last_error = "no attempt"
        for attempt in range(self.settings.retries + 1):
            upstream = candidates[attempt % len(candidates)]
            occupancy = Occupancy(upstream, self.pool.expected_work(route, upstream))
            try:
                response = await self._send(upstream, path, body, headers)
            except ConnectFailedError as exc:  # no answer came: the engine never started the work
                occupancy.release()
                last_error = f"{upstream.url}: connection failed ({type(exc).__name__}: {exc})"
                _failed(upstream, last_error)
                continue
            except BaseException:
                occupancy.release()
                raise
            if response.status in _RETRYABLE_STATUS:
                response.close()
                occupancy.release()
                last_error = f"{upstream.url}: HTTP {response.status}"
                _failed(upstream, last_error)
                continue
            if response.status >= 500:
                upstream.record_failure(time.monotonic())
            else:
                upstream.record_success()
            self.pool.routed(route, upstream)
            return Dispatch(upstream, response, time.perf_counter(), occupancy)
        raise UpstreamUnreachableError(f"no upstream accepted the request ({last_error})")

    async def _send(self, upstream: Upstream, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        t = self.settings.timeouts
        origin, base = self._target(upstream.url)
        try:
            head = request_head("POST", origin, base + path, headers, len(body))
        except ValueError as exc:
            raise GatewayInternalError(f"cannot send the request upstream: {exc}") from exc
        try:
            async with asyncio.timeout(t.first_byte_s):
                conn = await self.proxy.send(origin, head, body)
        except TimeoutError as exc:
            # The engine may be working on it: a retry could run the generation twice.
            upstream.record_failure(time.monotonic())
            raise UpstreamTimeoutError(f"{upstream.url} sent no response within "
                                       f"{t.first_byte_s:g}s") from exc
        except BodyBrokenError as exc:
            upstream.record_failure(time.monotonic())
            raise UpstreamFailedError(f"{upstream.url} sent a malformed response: {exc}") from exc
        return UpstreamResponse(upstream.url, self.proxy, conn, t.idle_s)

    def _target(self, url: str) -> tuple[Origin, str]:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = (Origin.of(url), urlsplit(url).path.rstrip("/"))
        return target

    # -- health --------------------------------------------------------------------------
    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.pool.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        """A refused connection or a bad answer takes the upstream out at once; a check that
        times out only after `health_timeouts` in a row: a busy engine, or a loaded host,
        answers late, and taking the only upstream out for a health interval would turn
        load into an outage of every request."""
        timeout = aiohttp.ClientTimeout(total=self.settings.timeouts.connect_s)
        timed_out = False
        try:
            async with self.http.get(upstream.url + "/health", timeout=timeout) as health:
                ok = health.status == 200
            if ok:
                async with self.http.get(upstream.url + "/v1/models", timeout=timeout) as models:
                    if models.status == 200:
                        listing = await models.json(content_type=None)
                        # Names become metric labels: only strings that can be written out.
                        upstream.models = frozenset(m["id"] for m in listing.get("data", [])[:_MAX_MODELS]
                                                    if isinstance(m["id"], str) and encodable(m["id"]))
        except TimeoutError:
            ok, timed_out = False, True
        except (aiohttp.ClientError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        upstream.health_timeouts = upstream.health_timeouts + 1 if timed_out else 0
        if timed_out and upstream.health_timeouts < self.settings.health_timeouts:
            logger.info("upstream %s: health check timed out (%d in a row)", upstream.url, upstream.health_timeouts)
            return
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


def _failed(upstream: Upstream, why: str) -> None:
    """Count a failed attempt; say so when it opens the upstream's breaker."""
    if upstream.record_failure(time.monotonic()):
        logger.warning("upstream %s: breaker open after %d failures in a row (last: %s)",
                       upstream.url, upstream.consecutive_failures, why)
