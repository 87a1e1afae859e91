"""Bounds on what a client sends: each past its setting gets a clear 400 (or 413 for the
body) in the OpenAI error shape, the refusal is recorded, and nothing reaches the engine."""

from __future__ import annotations

import pytest

LIMITS = {"max_messages": 8, "max_message_chars": 1000}


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": [{"role": "user", "content": "hi"}] * 9}, "messages", "too_many_messages"),
    ({"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": "x" * 1001}]},
     "messages[1].content", "message_too_long"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 600}] * 2}]},
     "messages[0].content", "message_too_long"),
])
def test_chat_requests_past_a_limit_get_a_clear_400(fake_upstream, start_gateway, body, param, code):
    up = fake_upstream()
    gw = start_gateway([up.url], limits=LIMITS)
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "fake", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"
    assert up.received == []
    (row,) = gw.rows(1)
    assert row.status == "client_error" and row.http_status == 400


def test_completions_prompts_are_bounded_too(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], limits=LIMITS)
    with gw.client() as c:
        long = c.post("/v1/completions", json={"model": "fake", "prompt": "z" * 1001})
        many = c.post("/v1/completions", json={"model": "fake", "prompt": ["a"] * 9})
        fine = c.post("/v1/completions", json={"model": "fake", "prompt": "z" * 1000})
    assert long.json()["error"]["code"] == "message_too_long" and many.json()["error"]["code"] == "too_many_messages"
    assert fine.status_code == 200


def test_a_body_past_max_body_bytes_is_413(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], max_body_bytes=4096)
    with gw.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "w" * 5000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_the_state_bounds_are_exported(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url], inference={"max_apps": 1})
    with gw.client() as c:
        for app in ("a", "b"):
            c.post("/v1/chat/completions", headers={"x-kvrelay-app": app},
                   json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        metrics = c.get("/metrics").text
    assert 'kvrelay_state_bounded_total{kind="apps_evicted"} 1.0' in metrics


def test_json_nested_past_the_recursion_limit_is_a_400_not_a_crash(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url])
    deep = b'{"model": "fake", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with gw.client() as c:
        r = c.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    (row,) = gw.rows(1)
    assert row.status == "client_error"


def test_an_id_with_a_lone_surrogate_is_refused_naming_it(fake_upstream, start_gateway):
    gw = start_gateway([fake_upstream().url])
    raw = b'{"model": "fake", "user": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    with gw.client() as c:
        r = c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"
    (row,) = gw.rows(1)
    assert row.status == "client_error" and row.session_id is None
