"""A bounded load generator for the reliability benchmark: a fixed number of streamed chat
requests, so many at once, loopback only; it stops by itself. Each request ends in one
outcome: ok, an error event in the stream (what a client sees when the upstream broke),
an HTTP error status, or a broken connection."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any, NamedTuple

import aiohttp


class Outcome(NamedTuple):
    kind: str  # ok (ended with [DONE]) | error_event | truncated (ended without either) | http_<status> | broken
    text: str


def chat_body(content: str, max_tokens: int, system: str = "You are a terse clerk.") -> dict[str, Any]:
    return {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}


async def stream_one(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> Outcome:
    text: list[str] = []
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(f"http_{resp.status}", "")
            pending = b""
            async for chunk in resp.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line == b"data: [DONE]":
                        return Outcome("ok", "".join(text))
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return Outcome("error_event", "".join(text))
                    for choice in event.get("choices") or []:
                        text.append((choice.get("delta") or {}).get("content") or "")
        return Outcome("truncated", "".join(text))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return Outcome("broken", "".join(text))


async def run_load(url: str, bodies: list[dict[str, Any]], concurrency: int,
                   headers: list[dict[str, str]] | None = None) -> list[Outcome]:
    """Every body sent once, `concurrency` streams in flight; outcomes in body order."""
    outcomes: list[Outcome | None] = [None] * len(bodies)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                outcomes[i] = await stream_one(http, url, bodies[i], headers[i] if headers else None)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return [o for o in outcomes if o is not None]


def tally(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.kind for o in outcomes)
