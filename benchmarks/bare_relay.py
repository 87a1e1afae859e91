"""The floor under the gateway's overhead: a relay that only forwards bytes.

Run as `python -m benchmarks.bare_relay --port P --upstream URL [--workers N]`. The same
server (uvicorn, with the loop and HTTP parser it picks for the gateway) and the same
client (kvrelay's HTTP/1.1 client of kvrelay/gateway/http1.py, keep-alive) as the gateway,
and nothing else: the body is
read and posted upstream as it came, the answer's chunks written back as they arrive. No
parsing, planning, records, metrics or traces. What `kvrelay bench gateway` measures
through it is what any Python gateway built on these libraries pays on this machine; the
gateway's figures less these are what kvrelay's own work costs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from kvrelay.gateway.http1 import HttpClient, Origin, request_head

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
_UPSTREAM_ENV = "KVRELAY_BARE_RELAY_UPSTREAM"  # how the factory learns it in each worker
_JSON = {"content-type": "application/json"}
_SSE = [(b"content-type", b"text/event-stream")]


class BareRelay:
    """ASGI: POSTs forwarded to the upstream, GET /health answered; nothing else."""

    def __init__(self, upstream: str) -> None:
        self.origin = Origin.of(upstream)
        self.http: HttpClient | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"ok"})
        else:
            await self._relay(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.http = HttpClient(limit=4096, keepalive_s=15.0, connect_s=5.0)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.http is not None:
                    self.http.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _relay(self, scope: Message, receive: Receive, send: Send) -> None:
        assert self.http is not None, "the lifespan has started"
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        answer = await self.http.send(self.origin, request_head("POST", self.origin, scope["path"], _JSON, len(body)),
                                      body)
        try:
            await send({"type": "http.response.start", "status": answer.status, "headers": _SSE})
            while chunk := await answer.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self.http.release(answer)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def create_app() -> BareRelay:
    return BareRelay(os.environ[_UPSTREAM_ENV])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    os.environ[_UPSTREAM_ENV] = args.upstream
    uvicorn.run("benchmarks.bare_relay:create_app", factory=True, host="127.0.0.1", port=args.port,
                workers=args.workers, log_level="warning")


if __name__ == "__main__":
    main()
