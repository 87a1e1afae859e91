"""An upstream that answers each captured prompt with the answer its capture recorded.

For benches that score what the gateway infers (benchmarks/replicas.py): with the
captured prompts sent as they were and the captured answers coming back, the gateway
sees exactly the traffic the capture's ground truth describes, in a fraction of the time
a model would take, and every run sees the same answers. A prompt is known by its
messages; prompts that recur (the first request of repeat runs of one task) get their
recorded answers in turn. A prompt it does not know is answered with a fixed text and
counted (`GET /stats`), so a bench can tell it sent something else.

Run as `python -m benchmarks.capture_upstream --port P --family short|long`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from benchmarks.agents.long import LONG_CAPTURES
from benchmarks.agents.workload import CAPTURES, Workload, load_all

MODEL = "captured"


def prompt_key(messages: Any) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {"id": "chatcmpl-captured", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def build_app(workloads: list[Workload]) -> Starlette:
    answers: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for workload in workloads:
        for request in sorted(workload.requests, key=lambda r: r.t_start):
            answers[prompt_key(request.body.get("messages"))].append(request.response)
    served: dict[str, int] = defaultdict(int)
    stats = {"answered": 0, "unknown": 0}

    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        key = prompt_key(body.get("messages"))
        recorded = answers.get(key)
        if recorded:
            response = recorded[served[key] % len(recorded)]
            served[key] += 1
            stats["answered"] += 1
        else:
            response = {"content": "A prompt the capture does not hold.", "tool_calls": None}
            stats["unknown"] += 1
        tool_calls = response.get("tool_calls") or []
        content = response.get("content") or ""
        usage = {"prompt_tokens": len(json.dumps(body.get("messages"))) // 4, "completion_tokens": len(content) // 4}

        async def events() -> AsyncIterator[bytes]:
            yield _event({"role": "assistant", "content": ""})
            if content:
                yield _event({"content": content})
            if tool_calls:
                yield _event({"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]})
            yield _event({}, "tool_calls" if tool_calls else "stop")
            yield ("data: " + json.dumps({"id": "chatcmpl-captured", "object": "chat.completion.chunk", "created": 0,
                                          "model": MODEL, "choices": [], "usage": usage}) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def stats_view(_: Request) -> JSONResponse:
        return JSONResponse(stats)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health),
                             Route("/v1/models", models), Route("/stats", stats_view)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--family", choices=("short", "long"), default="short")
    args = parser.parse_args()
    workloads = load_all(LONG_CAPTURES if args.family == "long" else CAPTURES)
    uvicorn.run(build_app(workloads), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
