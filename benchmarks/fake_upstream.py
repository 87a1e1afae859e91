"""A fast fake OpenAI upstream for the gateway benchmark: streams N chunks at once.

Run as `python -m benchmarks.fake_upstream --port P --chunks N`; it does no model work,
so whatever time a request takes through the gateway beyond the direct path is the
gateway's.
"""

from __future__ import annotations

import argparse
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def build_app(num_chunks: int) -> Starlette:
    def chunk(delta: dict, finish: str | None = None) -> bytes:
        body = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    role = chunk({"role": "assistant", "content": ""})
    words = [chunk({"content": f" w{i}"}) for i in range(num_chunks)]
    finish = chunk({}, "stop")
    usage = ("data: " + json.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                                   "model": "fake", "choices": [],
                                   "usage": {"prompt_tokens": 8, "completion_tokens": num_chunks,
                                             "total_tokens": 8 + num_chunks}}) + "\n\n").encode()

    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            yield role
            for word in words:
                yield word
            yield finish
            if include_usage:
                yield usage
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health),
        Route("/v1/models", models),
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    uvicorn.run(build_app(args.chunks), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
