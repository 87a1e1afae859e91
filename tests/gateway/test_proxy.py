"""The proxy path against a fake upstream: pass-through, usage, TTFT, faults, cancellation,
byte transparency of SSE, and the record each request leaves."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

from kvrelay.wire.salt import TenantSalts
from kvrelay.gateway.settings import Timeouts
from tests.gateway.support import USAGE, free_port, sse, wait_until

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi there"}]}
COMPLETION = {"model": "fake", "prompt": "Once upon a time"}


def data_events(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[len(b"data: "):] for line in raw.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data: ")]


def json_events(raw: bytes) -> list[dict]:
    return [json.loads(d) for d in data_events(raw) if d != b"[DONE]"]


def post_stream(gw, body: dict, **kw) -> tuple[int, bytes]:
    with gw.client() as http, http.stream("POST", "/v1/chat/completions", json=body, **kw) as r:
        return r.status_code, r.read()


def pretend_healthy(upstream) -> None:
    """Mark an upstream healthy once the health loop's first round (right after start-up)
    is over; with a long health_interval_s nothing marks it down again during the test."""
    time.sleep(0.3)
    upstream.healthy = True


def assert_openai_error(response: httpx.Response, status: int, code: str | None, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == code
    if type_ is not None:
        assert err["type"] == type_
    return err


# -- pass-through ----------------------------------------------------------------------------
def test_with_reuse_off_the_body_reaches_the_upstream_with_a_tenant_only_plan(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http:
        assert http.post("/v1/chat/completions", json=CHAT, headers={"X-Kvrelay-Reuse": "off"}).status_code == 200
    received = dict(fake.received[-1].body)
    plan = received.pop("kv_transfer_params")["kvrelay"]
    salt = received.pop("cache_salt")
    assert received == CHAT  # the client's body, untouched but for the plan and the tenant's salt
    assert plan["segments"] == [] and plan["round"] is None and plan["tenant"] == "app:default"
    assert salt == TenantSalts(None).salt("app:default")
    assert gw.rows(1)[0].plan is not None  # still inferred and recorded


def test_unary_chat_passes_through_and_is_recorded(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    headers = {"x-request-id": "rid-1", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "authorization": "Bearer client-secret", "x-kvrelay-session-id": "s1", "x-kvrelay-agent-id": "a1"}
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Hello world"
    assert body["usage"] == USAGE

    (got,) = fake.received
    assert got.path == "/v1/chat/completions"
    plan = got.body.pop("kv_transfer_params")["kvrelay"]
    assert got.body.pop("cache_salt") == TenantSalts(None).salt("app:default")
    assert got.body == CHAT  # nothing else added to a non-streaming request
    assert (plan["session_id"], plan["agent_id"]) == ("s1", "a1")
    assert got.headers["content-type"] == "application/json"
    assert got.headers["x-request-id"] == "rid-1"
    assert got.headers["traceparent"] == headers["traceparent"]
    assert "authorization" not in got.headers
    assert "x-kvrelay-session-id" not in got.headers

    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.error_type) == ("ok", 200, None)
    assert (row.endpoint, row.model, row.upstream, row.stream) == ("/v1/chat/completions", "fake", fake.url, False)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (7, 4, 3)
    assert row.ttft_ms is None and row.first_token_at is None
    assert (row.session_id, row.agent_id) == ("s1", "a1")
    assert row.completion_chars == len("Hello world")
    assert row.completion_sha256 == hashlib.sha256(b"Hello world").hexdigest()
    prompt = json.dumps(CHAT["messages"], sort_keys=True, ensure_ascii=False)
    assert row.prompt_sha256 == hashlib.sha256(prompt.encode()).hexdigest()
    assert row.prompt_chars == len(prompt)
    assert row.prompt_text is None and row.completion_text is None
    assert row.latency_ms > 0 and row.finished_at >= row.started_at


def test_unary_completion_is_recorded(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url], store_content=True)
    with gw.client() as http:
        r = http.post("/v1/completions", json={**COMPLETION, "user": "session-from-user"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "Hello world"
    (row,) = gw.rows(1)
    assert (row.endpoint, row.status, row.session_id) == ("/v1/completions", "ok", "session-from-user")
    assert (row.prompt_text, row.completion_text) == ("Once upon a time", "Hello world")
    assert row.prompt_chars == len("Once upon a time")


def test_every_answer_names_its_record(fake_upstream, start_gateway):
    """Unary, streamed and failed alike, the response carries the id of the request's record."""
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http:
        unary = http.post("/v1/chat/completions", json=CHAT)
        streamed = post_stream_response(http, {**CHAT, "stream": True})
        refused = http.post("/v1/chat/completions", json={**CHAT, "messages": "no"})
    ids = [r.headers["x-kvrelay-request-id"] for r in (unary, streamed, refused)]
    assert [r.status_code for r in (unary, streamed, refused)] == [200, 200, 400]
    assert {row.id for row in gw.rows(3)} == set(ids) and len(set(ids)) == 3


def post_stream_response(http: httpx.Client, body: dict) -> httpx.Response:
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.read()
        return r


# -- usage -----------------------------------------------------------------------------------
def test_stream_without_usage_request_gets_no_usage_chunk_but_is_recorded(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert status == 200
    events = json_events(raw)
    assert [e for e in events if e.get("choices") == []] == []
    assert all("usage" not in e for e in events)
    assert data_events(raw)[-1] == b"[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello world"
    # the upstream was asked for usage all the same
    (got,) = fake.received
    assert got.body["stream_options"] == {"include_usage": True}
    added = ("stream_options", "kv_transfer_params", "cache_salt")
    assert {k: v for k, v in got.body.items() if k not in added} == {**CHAT, "stream": True}
    # byte for byte what the upstream sent, minus the usage event
    usage_event = sse({"id": "cmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                       "choices": [], "usage": USAGE})
    assert usage_event in fake.sent[0]
    assert raw == fake.sent_bytes().replace(usage_event, b"")
    (row,) = gw.rows(1)
    assert (row.status, row.stream, row.prompt_tokens, row.completion_tokens, row.cached_tokens) == ("ok", True, 7, 4, 3)
    assert row.ttft_ms is not None and row.ttft_ms > 0
    assert row.completion_chars == len("Hello world")


def test_stream_with_usage_request_gets_the_usage_chunk_once(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    status, raw = post_stream(gw, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    usage_chunks = [e for e in json_events(raw) if e.get("choices") == []]
    assert len(usage_chunks) == 1
    assert usage_chunks[0]["usage"] == USAGE
    assert raw == fake.sent_bytes()  # nothing stripped
    assert fake.received[0].body["stream_options"] == {"include_usage": True}
    (row,) = gw.rows(1)
    assert (row.prompt_tokens, row.completion_tokens) == (USAGE["prompt_tokens"], USAGE["completion_tokens"])


def test_stream_options_without_usage_keeps_other_options(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": False}}
    status, raw = post_stream(gw, body)
    assert status == 200
    assert [e for e in json_events(raw) if e.get("choices") == []] == []
    assert fake.received[0].body["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_completions_stream_is_recorded(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http, http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        raw = r.read()
    assert "".join(e["choices"][0]["text"] for e in json_events(raw)) == "Hello world"
    (row,) = gw.rows(1)
    assert (row.endpoint, row.status, row.stream, row.prompt_tokens) == ("/v1/completions", "ok", True, 7)
    assert row.ttft_ms is not None


# -- TTFT ------------------------------------------------------------------------------------
def test_ttft_waits_for_content_not_the_role_chunk(fake_upstream, start_gateway):
    fake = fake_upstream(first_content_delay=0.3)
    gw = start_gateway([fake.url])
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert status == 200
    (row,) = gw.rows(1)
    assert row.ttft_ms >= 250, row.ttft_ms
    assert row.latency_ms >= row.ttft_ms
    assert row.first_token_at is not None and row.started_at < row.first_token_at <= row.finished_at


def test_ttft_is_fast_when_content_comes_at_once(fake_upstream, start_gateway):
    fake = fake_upstream(chunk_delay=0.06)  # later chunks are slow, the first one is not
    gw = start_gateway([fake.url])
    post_stream(gw, {**CHAT, "stream": True})
    (row,) = gw.rows(1)
    assert 0 < row.ttft_ms < 200, row.ttft_ms
    assert row.latency_ms >= 300  # six 60 ms gaps after the first content chunk


# -- faults ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_slow_first_byte_gives_504(fake_upstream, start_gateway, stream):
    fake = fake_upstream(first_byte_delay=1.5)
    gw = start_gateway([fake.url], timeouts=Timeouts(connect_s=1, first_byte_s=0.3, idle_s=5, total_s=30))
    t0 = time.monotonic()
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert time.monotonic() - t0 < 1.2  # the gateway did not wait for the upstream
    assert_openai_error(r, 504, "upstream_timeout", "timeout")
    assert len(fake.received) == 1  # a timeout is not retried: the engine may be working on it
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.stream) == ("timeout", 504, stream)


def test_upstream_500_gives_502_with_the_upstream_message(fake_upstream, start_gateway):
    fake = fake_upstream(status=500, error_message="CUDA out of cheese")
    gw = start_gateway([fake.url])
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=CHAT)
    err = assert_openai_error(r, 502, "upstream_failed", "upstream_error")
    assert "CUDA out of cheese" in err["message"]
    assert len(fake.received) == 1  # a 500 is not retried
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.upstream) == ("upstream_error", 502, fake.url)


def test_upstream_4xx_is_passed_on(fake_upstream, start_gateway):
    fake = fake_upstream(status=422, error_message="max_tokens is too large")
    gw = start_gateway([fake.url])
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    err = assert_openai_error(r, 422, None)
    assert err["message"] == "max_tokens is too large"
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.error_type) == ("client_error", 422, "upstream_4xx")


def test_connection_refused_fails_over_to_the_healthy_upstream(fake_upstream, start_gateway):
    fake = fake_upstream()
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway([dead, fake.url], health_interval_s=60)
    dead_up = gw.pool.upstreams[0]
    assert not dead_up.healthy  # the start-up health check noticed
    pretend_healthy(dead_up)  # as if it died after the last health check: it is tried first
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert dead_up.consecutive_failures == 1
    assert len(fake.received) == 1
    (row,) = gw.rows(1)
    assert (row.status, row.upstream) == ("ok", fake.url)


def test_unhealthy_upstream_is_skipped(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([f"http://127.0.0.1:{free_port()}", fake.url])
    with gw.client() as http:
        for _ in range(3):
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert [r.upstream for r in gw.rows(3)] == [fake.url] * 3


def test_connection_refused_everywhere_gives_502_unreachable(start_gateway):
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway([dead], health_interval_s=60, retries=2)
    pretend_healthy(gw.pool.upstreams[0])
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=CHAT)
    err = assert_openai_error(r, 502, "upstream_unreachable", "upstream_error")
    assert "connection failed" in err["message"]
    assert gw.pool.upstreams[0].consecutive_failures == 3  # the first try and two retries
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.upstream) == ("upstream_error", 502, None)


def test_no_healthy_upstream_gives_503(start_gateway):
    gw = start_gateway([f"http://127.0.0.1:{free_port()}"])
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=CHAT)
    assert_openai_error(r, 503, "no_upstream", "service_unavailable")
    (row,) = gw.rows(1)
    assert (row.status, row.http_status) == ("unavailable", 503)


def test_503_is_retried_on_the_other_upstream(fake_upstream, start_gateway):
    busy, good = fake_upstream(status=503), fake_upstream()
    gw = start_gateway([busy.url, good.url])
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
    assert len(busy.received) == 1 and len(good.received) == 1
    assert r.content == good.sent_bytes().replace(
        sse({"id": "cmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
             "choices": [], "usage": USAGE}), b"")
    (row,) = gw.rows(1)
    assert (row.status, row.upstream) == ("ok", good.url)
    assert [u.in_flight for u in gw.pool.upstreams] == [0, 0]


def test_503_everywhere_gives_502_after_the_retries(fake_upstream, start_gateway):
    a, b = fake_upstream(status=503), fake_upstream(status=503)
    gw = start_gateway([a.url, b.url], retries=2)
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json=CHAT)
    err = assert_openai_error(r, 502, "upstream_unreachable")
    assert "HTTP 503" in err["message"]
    assert len(a.received) + len(b.received) == 3


def test_upstream_drop_mid_stream_ends_with_an_error_event(fake_upstream, start_gateway):
    fake = fake_upstream(drop_after=3)  # role chunk and two content chunks, then the connection drops
    gw = start_gateway([fake.url])
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert status == 200
    sent = fake.sent_bytes()
    assert len(fake.sent[0]) == 3
    assert raw.startswith(sent)
    rest = data_events(raw[len(sent):])
    assert len(rest) == 1
    err = json.loads(rest[0])["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "upstream_failed"
    (row,) = gw.rows(1)
    assert (row.status, row.http_status) == ("upstream_error", 502)
    assert row.ttft_ms is not None
    assert row.completion_chars == len("Hello")


def test_upstream_drop_mid_stream_raises_in_the_openai_client(fake_upstream, start_gateway):
    openai = pytest.importorskip("openai")
    fake = fake_upstream(drop_after=3)
    gw = start_gateway([fake.url])
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30)
    text = []
    with pytest.raises(openai.APIError):
        for chunk in client.chat.completions.create(model="fake", messages=CHAT["messages"], stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
    assert "".join(text) == "Hello"
    client.close()


def test_idle_upstream_mid_stream_ends_with_a_timeout_event(fake_upstream, start_gateway):
    fake = fake_upstream(chunk_delay=1.0)
    gw = start_gateway([fake.url], timeouts=Timeouts(connect_s=1, first_byte_s=5, idle_s=0.3, total_s=30))
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert status == 200
    last = json.loads(data_events(raw)[-1])
    assert last["error"]["code"] == "upstream_timeout"
    (row,) = gw.rows(1)
    assert (row.status, row.http_status) == ("timeout", 504)


def test_total_time_limit_ends_a_long_stream(fake_upstream, start_gateway):
    fake = fake_upstream(endless=True, chunk_delay=0.05)
    gw = start_gateway([fake.url], timeouts=Timeouts(connect_s=1, first_byte_s=5, idle_s=5, total_s=0.5))
    t0 = time.monotonic()
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert time.monotonic() - t0 < 2.0
    assert json.loads(data_events(raw)[-1])["error"]["code"] == "upstream_timeout"
    (row,) = gw.rows(1)
    assert row.status == "timeout"
    assert wait_until(lambda: fake.stream_events == ["start", "closed"], 3), fake.stream_events


def test_garbage_sse_is_forwarded_byte_for_byte(fake_upstream, start_gateway):
    garbage = [b"data: this is not json\n\n", b"data: {\"broken\": \n\n", b": a comment\n\n",
               b"event: odd\ndata: [1, 2, 3]\n\n", b"data: 42\n\nretry: 5\n\n", b"data: [DONE]\n\n"]
    fake = fake_upstream(raw_stream=garbage)
    gw = start_gateway([fake.url])
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert status == 200
    assert raw == b"".join(garbage)
    (row,) = gw.rows(1)
    assert (row.status, row.stream, row.ttft_ms, row.prompt_tokens) == ("ok", True, None, None)


def test_stream_bytes_are_transparent_across_odd_chunking(fake_upstream, start_gateway):
    """Events split across writes, CRLF separators, an unfinished tail: the client gets the
    upstream's exact bytes, minus the usage event it did not ask for."""
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}\r\n\r\n'
    writes = [
        b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\r\n\r\ndata: {"id":"x",',
        b'"choices":[{"index":0,"delta":{"content":"Hi \xc3',  # a UTF-8 character split across writes
        b'\xa9"}}]}\r\n',
        b'\r\n' + usage[:20],
        usage[20:] + b'data: [DONE]\r\n\r\n',
        b'data: a tail without its blank line',
    ]
    fake = fake_upstream(raw_stream=writes)
    gw = start_gateway([fake.url], store_content=True)
    status, raw = post_stream(gw, {**CHAT, "stream": True})
    assert status == 200
    assert raw == b"".join(writes).replace(usage, b"")
    (row,) = gw.rows(1)
    assert (row.prompt_tokens, row.completion_tokens) == (2, 1)
    assert row.ttft_ms is not None
    assert row.completion_text == "Hi \u00e9"


# -- client disconnects ----------------------------------------------------------------------
def test_client_disconnect_cancels_the_upstream_stream(fake_upstream, start_gateway):
    fake = fake_upstream(endless=True, chunk_delay=0.05)
    gw = start_gateway([fake.url])
    seen = 0
    with gw.client() as http, http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break
    assert wait_until(lambda: "closed" in fake.stream_events, 3), fake.stream_events
    assert fake.stream_events == ["start", "closed"]
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.error_type) == ("cancelled", 499, "client_disconnected")
    assert row.upstream == fake.url
    assert wait_until(lambda: gw.pool.upstreams[0].in_flight == 0, 2)
    assert b"kvrelay_in_flight_requests 0.0" in gw.state.metrics.render()


def test_a_client_that_hangs_up_after_done_got_its_whole_answer(fake_upstream, start_gateway):
    """Clients close the connection as soon as they read [DONE]; an upstream may close its
    end a little later. The answer was delivered whole: the record says ok, not cancelled
    (seen against real vLLM, where the gap is a few milliseconds)."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
    writes = [sse({**chunk, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}),
              sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              b"data: [DONE]\n\n", *[b": the upstream lingers\n\n"] * 50]
    fake = fake_upstream(raw_stream=writes)
    gw = start_gateway([fake.url])
    with gw.client() as http, http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
    assert wait_until(lambda: "closed" in fake.stream_events, 3), fake.stream_events  # it hung up mid-linger
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.error_type) == ("ok", 200, None)
    assert row.completion_text is None or row.completion_text == "Hi"


def test_client_gone_before_the_first_byte_still_closes_the_upstream_and_records(fake_upstream, start_gateway):
    """The client gives up while the gateway waits for the upstream's response headers; the
    stream that then starts must still be closed, counted and recorded."""
    fake = fake_upstream(first_byte_delay=0.5, endless=True, chunk_delay=0.05)
    gw = start_gateway([fake.url])
    with gw.client(timeout=0.2) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    (row,) = gw.rows(1, timeout=5)
    assert row.status == "cancelled"
    assert wait_until(lambda: "closed" in fake.stream_events or not fake.stream_events, 3), fake.stream_events
    assert gw.pool.upstreams[0].in_flight == 0
    assert b"kvrelay_in_flight_requests 0.0" in gw.state.metrics.render()
