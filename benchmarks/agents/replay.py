"""Send captured runs to one stack over HTTP, as their apps did, and time every answer.

Each run is a session; `concurrency` runs are in flight at once (a new one starts when
one ends). Inside a run a request is sent once every request that had ended before it
in the capture has ended here too, so an app's own parallelism (a round's agents sent
together) and its order are kept. Every request is streamed, so time to first token is
measured the same way at the client for every stack, and greedy (temperature 0), so
two stacks' answers can be compared token for token.

Prompts are either rendered live from this replay's own answers (`fixed=None`) or
given (`fixed`: the prompts another replay rendered), so that every stack of a
comparison reads exactly the same prompts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.agents.workload import Quote, Request, Run, render
from kvrelay.wire.reports import REUSE_KEY

DEFAULT_MAX_TOKENS = 64  # for a captured request that set no limit
REQUEST_ID_HEADER = "x-kvrelay-request-id"
# Transport headers the replaying client sets itself; every other captured header is sent as the app sent it.
_TRANSPORT_HEADERS = frozenset({"host", "content-length", "connection", "accept-encoding", "transfer-encoding",
                                "authorization", "content-type"})

Key = tuple[str, int]


@dataclass(frozen=True)
class Outcome:
    key: Key
    body: dict[str, Any]  # the prompt as sent (before the replay's own stream/greedy settings)
    quotes: tuple[Quote, ...]  # the ground-truth quotes at their offsets in `body`
    text: str
    status: int
    error: str | None
    request_id: str | None  # the gateway's record of it, when a gateway answered
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    latency_s: float
    started_s: float  # since the replay began
    ended_s: float
    reuse: dict[str, Any] | None = None  # the engine's per-segment reuse report, where one came back

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class Replay:
    """One replay of `runs` against the OpenAI API at `base_url`, serving `model`; given
    several base URLs (gateway replicas), the requests go to them in turn, as a
    round-robin load balancer would send them."""

    def __init__(self, base_url: str | list[str], model: str, runs: list[Run], concurrency: int,
                 fixed: Mapping[Key, tuple[dict[str, Any], tuple[Quote, ...]]] | None = None,
                 extra_headers: Mapping[str, str] | None = None, max_tokens: int | None = None,
                 timeout_s: float = 900.0, keep_gaps: bool = False) -> None:
        self.base_urls = [u.rstrip("/") for u in ([base_url] if isinstance(base_url, str) else base_url)]
        self._turn = itertools.count()
        self.model = model
        self.runs = runs
        self.concurrency = concurrency
        self.fixed = fixed
        self.extra_headers = dict(extra_headers or {})
        self.max_tokens = max_tokens  # a cap on every answer (the quick bench's shorter answers)
        self.timeout_s = timeout_s
        # Wait as long after the requests a request waits for as its app did (the client's
        # own time between an answer and the next prompt, from the capture's clock).
        self.keep_gaps = keep_gaps
        self.answers: dict[Key, str] = {}
        self.outcomes: dict[Key, Outcome] = {}
        self._t0 = 0.0

    def run(self) -> dict[Key, Outcome]:
        return asyncio.run(self._all())

    async def _all(self) -> dict[Key, Outcome]:
        limits = httpx.Limits(max_connections=4 * self.concurrency + 8, max_keepalive_connections=4 * self.concurrency)
        slots = asyncio.Semaphore(self.concurrency)
        self._t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as http:
            await asyncio.gather(*(self._session(http, run, slots) for run in self.runs))
        return self.outcomes

    async def _session(self, http: httpx.AsyncClient, run: Run, slots: asyncio.Semaphore) -> None:
        async with slots:
            done = {r.seq: asyncio.Event() for r in run.requests}

            async def one(request: Request) -> None:
                earlier = run.waits_for(request)
                for before in earlier:
                    await done[before.seq].wait()
                if self.keep_gaps and earlier:
                    gap = request.t_start - max(e.t_end for e in earlier)
                    ended = max((self.outcomes[e.key].ended_s for e in earlier if e.key in self.outcomes), default=0.0)
                    await asyncio.sleep(max(0.0, gap - (time.perf_counter() - self._t0 - ended)))
                try:
                    await self._send(http, request)
                finally:
                    done[request.seq].set()

            await asyncio.gather(*(one(r) for r in run.requests))

    async def _send(self, http: httpx.AsyncClient, request: Request) -> None:
        if self.fixed is not None:
            body, quotes = self.fixed[request.key]
        else:
            body, moved = render(request, self.answers)
            quotes = tuple(moved)
        sent = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0.0}
        sent.pop("top_p", None)
        if "max_tokens" not in sent and "max_completion_tokens" not in sent:
            sent["max_tokens"] = DEFAULT_MAX_TOKENS
        if self.max_tokens is not None:
            for field in ("max_tokens", "max_completion_tokens"):
                if field in sent:
                    sent[field] = min(int(sent[field]), self.max_tokens)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _TRANSPORT_HEADERS}
        headers.update(self.extra_headers)
        started = time.perf_counter()
        stream = _Stream()
        status, request_id, error = 0, None, None
        try:
            base_url = self.base_urls[next(self._turn) % len(self.base_urls)]
            async with http.stream("POST", f"{base_url}{request.path}", json=sent, headers=headers) as response:
                status, request_id = response.status_code, response.headers.get(REQUEST_ID_HEADER)
                if status != 200:
                    error = (await response.aread()).decode(errors="replace")[:300]
                else:
                    async for line in response.aiter_lines():
                        stream.feed(line)
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        ended = time.perf_counter()
        error = error or stream.error
        self.answers[request.key] = stream.text
        self.outcomes[request.key] = Outcome(
            request.key, body, quotes, stream.text, status, error, request_id, stream.prompt_tokens,
            stream.cached_tokens, stream.completion_tokens, (stream.first_token_at or ended) - started,
            ended - started, started - self._t0, ended - self._t0, stream.reuse)


class _Stream:
    """What the SSE chunks of one answer add up to."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.first_token_at: float | None = None
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.error: str | None = None
        self.reuse: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = str(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                self.pieces.append(delta.get("content") or "")
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens") or 0
            self.completion_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = details.get("cached_tokens") or 0
        reuse = (chunk.get("kv_transfer_params") or {}).get(REUSE_KEY)
        if isinstance(reuse, dict):
            self.reuse = reuse
