"""Requests the gateway refuses itself: OpenAI error bodies, the right status, a record,
and nothing sent upstream."""

from __future__ import annotations

import pytest

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def setup(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url], max_body_bytes=2048)
    yield fake, gw
    assert fake.received == [], "a refused request reached the upstream"


def check(response, status: int, param: str | None, code: str | None, type_: str = "invalid_request_error",
          says: str | None = None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body == {"error": {"message": body["error"]["message"], "type": type_, "param": param, "code": code}}
    assert body["error"]["message"]
    if says is not None:
        assert says in body["error"]["message"]


CASES = [
    # (endpoint, raw body, status, param, code, words of the message)
    ("/v1/chat/completions", b"{not json", 400, None, None, "not valid JSON"),
    ("/v1/chat/completions", b"", 400, None, None, "not valid JSON"),
    ("/v1/chat/completions", b'[{"model": "fake"}]', 400, None, None, "JSON object"),
    ("/v1/chat/completions", b'"just a string"', 400, None, None, "JSON object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}]}', 400, "model", None, "model"),
    ("/v1/chat/completions", b'{"model": "", "messages": [{"role": "user", "content": "Hi"}]}', 400, "model",
     None, "model"),
    ("/v1/chat/completions", b'{"model": 7, "messages": [{"role": "user", "content": "Hi"}]}', 400, "model",
     None, "model"),
    ("/v1/chat/completions", b'{"model": "fake"}', 400, "messages", None, "messages"),
    ("/v1/chat/completions", b'{"model": "fake", "messages": []}', 400, "messages", None, "messages"),
    ("/v1/chat/completions", b'{"model": "fake", "messages": ["Hi"]}', 400, "messages", None, "messages"),
    ("/v1/chat/completions", b'{"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "stream": "yes"}',
     400, "stream", None, "stream"),
    ("/v1/completions", b'{"model": "fake"}', 400, "prompt", None, "prompt"),
    ("/v1/completions", b'{"model": "fake", "prompt": ""}', 400, "prompt", None, "prompt"),
    ("/v1/completions", b'{"model": "fake", "prompt": 12}', 400, "prompt", None, "prompt"),
]


def test_each_refusal_has_an_openai_body_and_a_record(setup):
    fake, gw = setup
    with gw.client() as http:
        for endpoint, raw, status, param, code, says in CASES:
            r = http.post(endpoint, content=raw, headers={"content-type": "application/json"})
            check(r, status, param, code, says=says)
    rows = gw.rows(len(CASES))
    assert len(rows) == len(CASES)
    for row, (endpoint, *_) in zip(rows, CASES, strict=True):
        assert (row.status, row.http_status, row.error_type) == ("client_error", 400, "BadRequestError")
        assert row.endpoint == endpoint
        assert row.upstream is None and row.prompt_tokens is None and row.completion_sha256 is None
    assert rows[4].model is None
    assert rows[7].model == "fake"  # the model was read before the messages were refused


def test_body_over_the_limit_is_413(setup):
    fake, gw = setup
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    with gw.client() as http:
        check(http.post("/v1/chat/completions", json=big), 413, None, "body_too_large", says="2048")

        def chunks():  # no content-length: the limit holds while reading
            yield b'{"model": "fake", "prompt": "'
            for _ in range(8):
                yield b"y" * 512
            yield b'"}'

        r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        check(r, 413, None, "body_too_large")
        # just under the limit is fine
        ok = {**CHAT, "messages": [{"role": "user", "content": "x" * 1800}]}
    rows = gw.rows(2)
    assert [(r.status, r.http_status, r.error_type) for r in rows] == [("client_error", 413, "BodyTooLargeError")] * 2
    fake.received.clear()
    with gw.client() as http:
        assert http.post("/v1/chat/completions", json=ok).status_code == 200
    assert len(fake.received) == 1
    fake.received.clear()


def test_unknown_model_is_404_model_not_found(setup):
    fake, gw = setup
    with gw.client() as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17", "stream": True})
    check(r, 404, "model", "model_not_found", says="gpt-17")
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.model, row.stream) == ("client_error", 404, "gpt-17", True)


def test_refusals_leave_the_gateway_serving(setup):
    fake, gw = setup
    with gw.client() as http:
        http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert len(fake.received) == 1
    fake.received.clear()
    assert b'kvrelay_in_flight_requests 0.0' in gw.state.metrics.render()
