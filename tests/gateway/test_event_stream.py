"""EventStreamResponse: chunks in order, a hang-up ends the stream quietly, a shutdown does not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvrelay.gateway.event_stream import EventStreamResponse

SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}


class Client:
    """The server's side of one connection: what the app sent, and a hang-up on demand."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def test_chunks_go_out_in_order_then_the_end():
    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            await asyncio.sleep(0)
            yield f"data: {i}\n\n".encode()

    client = Client()
    await EventStreamResponse(events(), {"x-kvrelay-request-id": "req-1"})(SCOPE, client.receive, client.send)
    start, *body = client.sent
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert (headers[b"cache-control"], headers[b"x-kvrelay-request-id"]) == (b"no-cache", b"req-1")
    assert [(m["body"], m["more_body"]) for m in body] == [
        (b"data: 0\n\n", True), (b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"", False)]
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == 1  # the watcher is gone


async def test_a_hang_up_cancels_the_stream_where_it_waits_and_ends_quietly():
    seen: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await asyncio.sleep(60)  # the upstream is slow
            yield b"data: never\n\n"
        except asyncio.CancelledError:
            seen.append("cancelled")  # where the relay records a 499 and closes the upstream
            raise

    client = Client()
    response = EventStreamResponse(events())
    task = asyncio.create_task(response(SCOPE, client.receive, client.send))
    while len(client.sent) < 2:
        await asyncio.sleep(0)
    client.gone.set()
    await asyncio.wait_for(task, 5)  # returns: the hang-up is not an error of the app
    assert seen == ["cancelled"]
    assert task.cancelling() == 0 and not task.cancelled()
    assert [m.get("body") for m in client.sent] == [None, b"data: first\n\n"]


async def test_a_cancel_from_outside_is_not_swallowed():
    async def events() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        await asyncio.sleep(60)
        yield b"data: never\n\n"

    client = Client()
    task = asyncio.create_task(EventStreamResponse(events())(SCOPE, client.receive, client.send))
    while len(client.sent) < 2:
        await asyncio.sleep(0)
    task.cancel()  # the server shutting the request down
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == 1  # the watcher went with it


async def test_a_stream_that_never_began_is_handed_back_and_one_left_at_a_yield_is_closed():
    ran: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            ran.append("began")
            yield b"data: first\n\n"
            yield b"data: second\n\n"
        finally:
            ran.append("cleaned up")  # where the relay closes the upstream and records the call

    class Failing(Client):
        def __init__(self, fail_at: int, error: BaseException) -> None:
            super().__init__()
            self.fail_at, self.error = fail_at, error

        async def send(self, message: dict[str, Any]) -> None:
            if len(self.sent) == self.fail_at:
                raise self.error
            await super().send(message)

    abandoned: list[bool] = []
    with pytest.raises(asyncio.CancelledError):  # the server shuts the request down as its headers go out
        await EventStreamResponse(events(), abandoned=lambda: abandoned.append(True))(
            SCOPE, Failing(0, asyncio.CancelledError()).receive, Failing(0, asyncio.CancelledError()).send)
    assert abandoned == [True] and ran == []

    with pytest.raises(OSError):  # the write of the first chunk fails: the stream sits at its first yield
        await EventStreamResponse(events(), abandoned=lambda: abandoned.append(True))(
            SCOPE, Client().receive, Failing(1, OSError("broken pipe")).send)
    assert abandoned == [True] and ran == ["began", "cleaned up"]
