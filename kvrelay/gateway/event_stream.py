"""The response that relays a stream of server-sent events to the client.

Starlette's StreamingResponse watches for the client hanging up through an anyio task
group (a cancel scope, two tasks, their wrappers) per response: on a gateway that relays
hundreds of streams a second that machinery cost more CPU than the relay itself. This one
streams in the request's own task and watches with one plain asyncio task, which cancels
the stream when the server reports `http.disconnect`: the relay then sees a
CancelledError where it waits, records the hang-up (499) and closes the upstream, as it
did under StreamingResponse.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# No caching or proxy buffering of a stream; the media type as Starlette's init_headers
# writes it. Built once: the headers of every response are these and the caller's.
_RAW_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                    (b"content-type", b"text/event-stream; charset=utf-8")]


class EventStreamResponse(Response):
    """`text/event-stream` from an async iterator of byte chunks, each written as it comes."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 abandoned: Callable[[], None] | None = None) -> None:
        self.events = events
        self.abandoned = abandoned  # called when the response ends before `events` began
        self.status_code = 200
        self.background = None
        self.raw_headers = [*_RAW_SSE_HEADERS, *((k.lower().encode("latin-1"), v.encode("latin-1"))
                                                 for k, v in (headers or {}).items())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None, "an ASGI app runs in a task"
        hung_up = False

        async def watch() -> None:
            nonlocal hung_up
            while (await receive())["type"] != "http.disconnect":
                pass
            hung_up = True
            task.cancel()

        watcher = asyncio.create_task(watch())
        began = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            began = True  # from here the iterator's own cleanup runs however the stream ends
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not hung_up:
                raise  # the server is shutting the request down: not ours to swallow
            task.uncancel()  # the client left: the stream ended as it should
        finally:
            watcher.cancel()
            if not began and self.abandoned is not None:
                self.abandoned()  # an iterator never started runs none of its code, cleanup included
            elif began and (aclose := getattr(self.events, "aclose", None)) is not None:
                await aclose()  # left at a yield (a write failed): its cleanup runs now, not when collected
