"""/health, /ready, /v1/models and /metrics."""

from __future__ import annotations

import re

from sqlalchemy.ext.asyncio import create_async_engine

from kvrelay.gateway.metrics import GatewayMetrics

from tests.gateway.support import wait_until

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}


def test_health_ready_and_ready_without_upstreams(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.get("/ready")
        assert r.status_code == 200
        assert r.json()["status"] == "ready"
        fake.stop()
        assert wait_until(lambda: gw.pool.healthy_count() == 0, 3)
        r = http.get("/ready")
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert http.get("/health").status_code == 200  # alive all the same
        r = http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstream"


def test_ready_is_503_when_the_database_is_gone(fake_upstream, start_gateway, tmp_path):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    db = gw.app.state.db
    with gw.client() as http:
        assert http.get("/ready").status_code == 200
        # a database that cannot be opened (its directory does not exist)
        gw.app.state.db = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/missing/dir/db.sqlite")
        try:
            r = http.get("/ready")
        finally:
            gw.app.state.db = db
        assert r.status_code == 503, r.text
        assert "database unavailable" in r.json()["error"]["message"]
        assert http.get("/ready").status_code == 200


def test_models_is_the_union_of_healthy_upstreams(fake_upstream, start_gateway):
    a = fake_upstream(models=["alpha", "shared"])
    b = fake_upstream(models=["beta", "shared"])
    gw = start_gateway([a.url, b.url])
    with gw.client() as http:
        body = http.get("/v1/models").json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["alpha", "beta", "shared"]
        assert all(m["object"] == "model" for m in body["data"])
        # each model goes only where it is served
        assert http.post("/v1/chat/completions", json={**CHAT, "model": "beta"}).status_code == 200
        assert http.post("/v1/chat/completions", json={**CHAT, "model": "alpha"}).status_code == 200
        assert [r.body["model"] for r in b.received] == ["beta"]
        assert [r.body["model"] for r in a.received] == ["alpha"]
        b.stop()
        assert wait_until(lambda: not gw.pool.upstreams[1].healthy, 3)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["alpha", "shared"]


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.M)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def test_metrics_count_requests_ttft_and_overhead(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http:
        for _ in range(2):
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
        for _ in range(3):
            with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                r.read()
        assert http.post("/v1/chat/completions", json={"model": "fake"}).status_code == 400
        assert http.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
        r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "kvrelay_requests_total", 'status="ok"') == 5.0
    assert metric(text, "kvrelay_requests_total", 'status="client_error"') == 2.0
    assert metric(text, "kvrelay_ttft_seconds_count", 'model="fake"') == 3.0
    # overhead is observed for every request that got as far as dispatch (the 404 did too)
    assert metric(text, "kvrelay_gateway_overhead_seconds_count") == 6.0
    assert metric(text, "kvrelay_in_flight_requests") == 0.0
    assert metric(text, "kvrelay_tokens_total", 'kind="prompt"') == 5 * 7
    assert metric(text, "kvrelay_tokens_total", 'kind="completion"') == 5 * 4
    assert metric(text, "kvrelay_tokens_total", 'kind="cached"') == 5 * 3
    assert metric(text, "kvrelay_request_duration_seconds_count", 'model="fake",status="ok"') == 5.0
    assert metric(text, "kvrelay_upstream_duration_seconds_count", f'upstream="{fake.url}"') == 5.0


def test_metrics_are_per_app(fake_upstream, start_gateway):
    fake = fake_upstream()
    one, two = start_gateway([fake.url]), start_gateway([fake.url])
    with one.client() as http:
        http.post("/v1/chat/completions", json=CHAT)
    with two.client() as http:
        assert 'kvrelay_requests_total{status="ok"}' not in http.get("/metrics").text


def test_a_slow_health_check_takes_an_upstream_out_only_after_several(fake_upstream, start_gateway):
    """A check that times out is a busy engine as often as a dead one: the upstream stays in
    until `health_timeouts` in a row time out, and one good check resets the count."""
    from kvrelay.gateway.settings import Timeouts

    fake = fake_upstream()
    gw = start_gateway([fake.url], health_interval_s=0.05, health_timeouts=3,
                       timeouts=Timeouts(connect_s=0.5, first_byte_s=5.0, idle_s=5.0, total_s=30.0))
    up = gw.pool.upstreams[0]
    fake.behaviour.health_delay = 2.0  # every check times out (0.5 s apart)
    assert wait_until(lambda: up.health_timeouts == 1, 3)
    assert up.healthy  # one or two late answers do not take it out
    with gw.client() as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert wait_until(lambda: not up.healthy, 5) and up.health_timeouts >= 3
    fake.behaviour.health_delay = 0.0
    assert wait_until(lambda: up.healthy, 3) and up.health_timeouts == 0


def test_child_is_the_labelled_metric_kept():
    metrics = GatewayMetrics()
    child = metrics.child(metrics.requests, "ok")
    assert child is metrics.requests.labels("ok") and metrics.child(metrics.requests, "ok") is child
    assert metrics.child(metrics.latency, "m", "ok") is metrics.latency.labels("m", "ok")
    assert metrics.child(metrics.requests, "timeout") is not child
