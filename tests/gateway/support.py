"""Helpers for the gateway tests: loopback uvicorn runner, a switchable fake OpenAI
upstream, and reading the gateway's request records back from its SQLite file."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvrelay.gateway.storage.models import RequestRow
from kvrelay.openai_responses import parse_request
from kvrelay.openai_responses_output import response_from_chat
from kvrelay.openai_responses_stream import ResponsesStream


# -- servers ---------------------------------------------------------------------------------
def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackServer:
    """An ASGI app under uvicorn in a daemon thread on 127.0.0.1; stop() is idempotent."""

    def __init__(self, app: Any) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                lifespan="on", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.01)

    def request_stop(self) -> None:
        self._server.should_exit = True

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(15)
            assert not self._thread.is_alive(), f"uvicorn on port {self.port} did not stop"
        self._sock.close()


def stop_all(servers: list[LoopbackServer]) -> None:
    """Stop several servers at once (each takes a few uvicorn ticks to shut down)."""
    for server in servers:
        server.request_stop()
    for server in servers:
        server.stop()


@contextmanager
def loopback(app: Any) -> Iterator[LoopbackServer]:
    server = LoopbackServer(app)
    try:
        yield server
    finally:
        server.stop()


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    return pred()


# -- fake upstream ---------------------------------------------------------------------------
USAGE = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
         "prompt_tokens_details": {"cached_tokens": 3}}


@dataclass
class Behaviour:
    """What the fake upstream does; tests change fields between (or during) requests."""

    models: list[str] = field(default_factory=lambda: ["fake"])
    health_status: int = 200
    health_delay: float = 0.0  # before answering /health
    status: int = 200  # not 200: answer the completion with this status and an OpenAI error body
    error_message: str = "the fake upstream exploded"
    first_byte_delay: float = 0.0  # before the response headers
    pieces: list[str] = field(default_factory=lambda: ["Hel", "lo", " wor", "ld"])
    first_content_delay: float = 0.0  # between the role chunk and the first content chunk
    chunk_delay: float = 0.0  # between two content chunks
    drop_after: int | None = None  # stream: break the connection after this many events
    endless: bool = False  # stream content chunks (chunk_delay apart) until the client leaves
    raw_stream: list[bytes] | None = None  # stream: send exactly these writes, nothing else
    usage: dict[str, Any] = field(default_factory=lambda: dict(USAGE))
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # /v1/responses: chat tool calls it makes


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON


class _Drop(Exception):
    """Raised inside the fake's stream to make uvicorn drop the connection mid-body."""


class FakeUpstream:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.received: list[Received] = []
        self.sent: list[list[bytes]] = []  # per stream, the exact writes made
        self.stream_events: list[str] = []  # "start", "done", "closed" (cancelled / closed early)
        app = Starlette(routes=[
            Route("/health", self._health),
            Route("/v1/models", self._models),
            Route("/v1/chat/completions", self._complete, methods=["POST"]),
            Route("/v1/completions", self._complete, methods=["POST"]),
            Route("/v1/responses", self._respond, methods=["POST"]),
        ])
        self.server = LoopbackServer(app)
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()

    def sent_bytes(self, i: int = -1) -> bytes:
        return b"".join(self.sent[i])

    # -- routes ---------------------------------------------------------------------------
    async def _health(self, _: Request) -> Response:
        await asyncio.sleep(self.behaviour.health_delay)
        return JSONResponse({"status": "ok" if self.behaviour.health_status == 200 else "down"},
                            status_code=self.behaviour.health_status)

    async def _models(self, _: Request) -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.behaviour.models]
        return JSONResponse({"object": "list", "data": data})

    async def _complete(self, request: Request) -> Response:
        b = self.behaviour
        raw = await request.body()
        body = json.loads(raw)
        self.received.append(Received(request.url.path, dict(request.headers), body))
        deadline = time.monotonic() + b.first_byte_delay
        while time.monotonic() < deadline:  # stop waiting once the caller gave up
            if await request.is_disconnected():
                return Response(status_code=499)
            await asyncio.sleep(0.02)
        if b.status != 200:
            err = {"error": {"message": b.error_message, "type": "server_error", "param": None, "code": None}}
            return JSONResponse(err, status_code=b.status)
        chat = request.url.path.endswith("chat/completions")
        if not body.get("stream"):
            return JSONResponse(self._unary_body(body, chat))
        return StreamingResponse(self._stream(body, chat), media_type="text/event-stream")

    async def _respond(self, request: Request) -> Response:
        """/v1/responses: the chat answer it would give, shaped by kvrelay's translation,
        with the tool calls of `behaviour.tool_calls`; kv_transfer_params echoed back."""
        b = self.behaviour
        body = json.loads(await request.body())
        self.received.append(Received(request.url.path, dict(request.headers), body))
        if b.status != 200:
            err = {"error": {"message": b.error_message, "type": "server_error", "param": None, "code": None}}
            return JSONResponse(err, status_code=b.status)
        req = parse_request(body)
        echo = {"kv_transfer_params": body["kv_transfer_params"]} if "kv_transfer_params" in body else {}
        calls = [{"index": i, **call} for i, call in enumerate(b.tool_calls)]
        finish = "tool_calls" if calls else "stop"
        if not req.stream:
            message = {"role": "assistant", "content": "".join(b.pieces), "tool_calls": b.tool_calls}
            chat = {"created": 0, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": b.usage, **echo}
            return JSONResponse(response_from_chat(req, chat, "resp_fake"))
        translator = ResponsesStream(req, "resp_fake", 0)
        chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in b.pieces]
        chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": calls}}]}] if calls else []
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}], **echo},
                   {"choices": [], "usage": b.usage}]
        events = translator.start() + [e for c in chunks for e in translator.feed(c)] + translator.finish()
        self.sent.append([e.encode() for e in events])
        return StreamingResponse(iter(self.sent[-1]), media_type="text/event-stream")

    def _unary_body(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        text = "".join(self.behaviour.pieces)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 0,
                "model": body.get("model"), "choices": [choice], "usage": self.behaviour.usage}

    def stream_events_for(self, body: dict[str, Any], chat: bool) -> list[bytes]:
        """The SSE events of a normal stream (what _stream sends without faults)."""
        b = self.behaviour
        env = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
               "created": 0, "model": body.get("model")}

        def chunk(piece: str | None, finish: str | None = None, role: bool = False) -> bytes:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                choice["delta"] = {"role": "assistant", "content": ""} if role else (
                    {} if piece is None else {"content": piece})
            else:
                choice["text"] = piece or ""
            return sse({**env, "choices": [choice]})

        events = [chunk(None, role=True)] if chat else []
        events += [chunk(p) for p in b.pieces]
        events.append(chunk(None, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(sse({**env, "choices": [], "usage": b.usage}))
        events.append(b"data: [DONE]\n\n")
        return events

    async def _stream(self, body: dict[str, Any], chat: bool):
        b = self.behaviour
        writes: list[bytes] = []
        self.sent.append(writes)
        self.stream_events.append("start")
        try:
            if b.raw_stream is not None:
                for part in b.raw_stream:
                    writes.append(part)
                    yield part
                    await asyncio.sleep(0.01)
            elif b.endless:
                n = 0
                while True:
                    part = sse({"id": "cmpl-fake", "object": "chat.completion.chunk", "created": 0,
                                "model": body.get("model"),
                                "choices": [{"index": 0, "delta": {"content": f"t{n} "}, "finish_reason": None}]})
                    writes.append(part)
                    yield part
                    n += 1
                    await asyncio.sleep(b.chunk_delay)
            else:
                events = self.stream_events_for(body, chat)
                for i, part in enumerate(events):
                    if b.drop_after is not None and i == b.drop_after:
                        raise _Drop("fake upstream drops the connection")
                    if i == (1 if chat else 0) and b.first_content_delay:
                        await asyncio.sleep(b.first_content_delay)
                    elif i > 1 and b.chunk_delay:
                        await asyncio.sleep(b.chunk_delay)
                    writes.append(part)
                    yield part
            self.stream_events.append("done")
        except (asyncio.CancelledError, GeneratorExit):
            self.stream_events.append("closed")
            raise


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- records ---------------------------------------------------------------------------------
def read_rows(db_path: Path) -> list[RequestRow]:
    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with Session(engine, expire_on_commit=False) as session:
            return list(session.scalars(select(RequestRow).order_by(RequestRow.started_at)))
    finally:
        engine.dispose()


def wait_rows(db_path: Path, n: int, timeout: float = 5.0, settle: float = 0.05) -> list[RequestRow]:
    """The request rows once there are at least n (ordered by start), after `settle`
    seconds more so that any extra (duplicate) row would show up too."""
    deadline = time.monotonic() + timeout
    while True:
        rows = read_rows(db_path)
        if len(rows) >= n:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {n} request rows within {timeout}s, found {len(rows)}: "
                                 f"{[(r.status, r.endpoint) for r in rows]}")
        time.sleep(0.03)
    time.sleep(settle)
    return read_rows(db_path)
