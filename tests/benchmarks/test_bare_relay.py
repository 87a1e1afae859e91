"""The bare relay forwards a body and its streamed answer byte for byte, and nothing else."""

from __future__ import annotations

import httpx

from benchmarks.bare_relay import BareRelay
from tests.gateway.support import LoopbackServer


async def _upstream(scope, receive, send):
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for part in (b"data: " + body + b"\n\n", b"data: [DONE]\n\n"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def test_the_relay_forwards_the_body_and_streams_the_answer_back():
    upstream = LoopbackServer(_upstream)
    relay = LoopbackServer(BareRelay(upstream.url))
    try:
        body = b'{"model":"fake","messages":[{"role":"user","content":"h\\u00e9"}],"stream":true}'
        answer = httpx.post(f"{relay.url}/v1/chat/completions", content=body, timeout=10)
        assert answer.status_code == 200 and answer.headers["content-type"] == "text/event-stream"
        assert answer.content == b"data: " + body + b"\n\ndata: [DONE]\n\n"
        assert httpx.get(f"{relay.url}/health", timeout=10).status_code == 200
    finally:
        relay.stop()
        upstream.stop()
