"""Choosing an upstream: session affinity, the load guard, breakers and health, both as
unit tests of UpstreamPool/Upstream and end to end through the gateway."""

from __future__ import annotations

import time

import httpx

from kvrelay.gateway.settings import Breaker
from kvrelay.gateway.upstreams import Upstream, UpstreamPool

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}
URLS = ["http://a", "http://b", "http://c"]


def pool(n: int = 2, factor: float = 2.0, breaker: Breaker | None = None) -> UpstreamPool:
    return UpstreamPool(URLS[:n], breaker or Breaker(), factor)


def urls(candidates: list[Upstream]) -> list[str]:
    return [u.url for u in candidates]


# -- UpstreamPool ----------------------------------------------------------------------------
def test_candidates_without_session_are_ordered_by_load():
    p = pool(3)
    a, b, c = p.upstreams
    a.in_flight, b.in_flight, c.in_flight = 5, 0, 2
    assert urls(p.candidates("m", None)) == ["http://b", "http://c", "http://a"]
    a.in_flight = 0
    assert urls(p.candidates("m", None)) == ["http://a", "http://b", "http://c"]  # ties keep list order


def test_session_keeps_its_home_upstream():
    p = pool(3)
    a, b, c = p.upstreams
    a.in_flight = 1
    assert urls(p.candidates("m", "s1")) == ["http://b", "http://c", "http://a"]  # the least loaded
    b.in_flight, a.in_flight = 1, 0  # b is no longer the least loaded, but it holds s1's cache
    assert urls(p.candidates("m", "s1"))[0] == "http://b"
    assert urls(p.candidates("m", "s2"))[0] == "http://a"  # a new session goes by load
    p.forget_session("s1")
    assert urls(p.candidates("m", "s1"))[0] == "http://c"  # as idle as a, and home to no session


def test_sessions_that_start_together_spread_before_any_request_is_in_flight():
    """The gateway plans before it counts a request in flight: two sessions whose first
    requests arrive together see equal load, and the second must still go elsewhere."""
    p = pool(2)
    assert urls(p.candidates("m", "s1"))[0] == "http://a"
    assert urls(p.candidates("m", "s2"))[0] == "http://b"  # equal load, a already home to s1
    assert urls(p.candidates("m", "s3"))[0] == "http://a"
    p.forget_session("s1")
    p.forget_session("s3")
    assert urls(p.candidates("m", "s4"))[0] == "http://a"  # a is home to none again
    p.upstreams[0].in_flight = 1
    assert urls(p.candidates("m", "s5"))[0] == "http://b"  # load first, homes only break ties


def test_a_moved_session_counts_at_its_new_home_only():
    p = pool(2)
    a, b = p.upstreams
    assert p.candidates("m", "s1")[0] is a
    a.in_flight = 8  # the load guard moves s1 to b
    assert p.candidates("m", "s1")[0] is b
    a.in_flight = b.in_flight = 0
    assert p.candidates("m", "s2")[0] is a  # a is home to no session now, b to s1


def test_load_guard_moves_a_hot_session_with_three_upstreams():
    p = pool(3)
    a, b, c = p.upstreams
    assert p.candidates("m", "s1")[0] is a
    a.in_flight = 10  # mean 10/3: a carries 3x the mean, above the factor 2
    assert urls(p.candidates("m", "s1")) == ["http://b", "http://c", "http://a"]
    a.in_flight = 0
    assert p.candidates("m", "s1")[0] is b  # the session now lives on b


def test_load_guard_moves_a_hot_session_with_two_upstreams():
    """Two upstreams and the default factor 2.0: the home upstream carries all the load
    (50 requests in flight, the other none), which is twice the mean of 25, and a session
    must still leave it (README: "a session leaves an upstream carrying more than
    load_guard_factor times the mean load"; "one hot session must not pin a replica")."""
    p = pool(2)
    a, b = p.upstreams
    assert p.candidates("m", "s1")[0] is a
    a.in_flight = 50
    assert p.candidates("m", "s1")[0] is b


def test_load_guard_ignores_light_load():
    p = pool(2)
    a, b = p.upstreams
    assert p.candidates("m", "s1")[0] is a
    a.in_flight = 1  # above 2x the mean of 0.5, but a single request is not "hot"
    assert p.candidates("m", "s1")[0] is a


def test_unhealthy_and_wrong_model_upstreams_are_skipped():
    p = pool(3)
    a, b, c = p.upstreams
    assert p.candidates("m", "s1")[0] is a
    a.healthy = False
    assert urls(p.candidates("m", "s1")) == ["http://b", "http://c"]  # the session moves
    a.healthy = True
    b.models, c.models = frozenset({"other"}), frozenset({"m"})  # a has not listed its models yet
    assert urls(p.candidates("m", None)) == ["http://a", "http://c"]
    assert not p.knows_no("m") and not p.knows_no("x")  # a's models are unknown
    a.models = frozenset({"m"})
    assert p.knows_no("x") and not p.knows_no("other")
    assert p.candidates("x", None) == []
    for u in p.upstreams:
        u.healthy = False
    assert p.candidates("m", "s1") == [] and p.healthy_count() == 0


def test_breaker_opens_after_the_threshold_and_closes_after_cooldown_and_success():
    up = Upstream("http://a", Breaker(failure_threshold=3, cooldown_s=0.2))
    now = time.monotonic()
    up.record_failure(now)
    up.record_failure(now)
    assert up.available(time.monotonic())  # two failures: still closed
    up.record_failure(time.monotonic())
    assert not up.available(time.monotonic())  # open
    assert up.available(time.monotonic() + 0.25)  # cooldown over: half-open, a trial may go
    time.sleep(0.25)
    up.record_failure(time.monotonic())  # the trial failed: open again at once
    assert not up.available(time.monotonic())
    time.sleep(0.25)
    assert up.available(time.monotonic())
    up.record_success()  # the trial succeeded: closed, the count starts over
    assert up.consecutive_failures == 0
    up.record_failure(time.monotonic())
    up.record_failure(time.monotonic())
    assert up.available(time.monotonic())


def test_success_resets_the_consecutive_count():
    up = Upstream("http://a", Breaker(failure_threshold=2, cooldown_s=60))
    up.record_failure(time.monotonic())
    up.record_success()
    up.record_failure(time.monotonic())
    assert up.available(time.monotonic())
    up.record_failure(time.monotonic())
    assert not up.available(time.monotonic())


def test_open_breaker_takes_the_upstream_out_of_the_candidates():
    p = pool(2, breaker=Breaker(failure_threshold=1, cooldown_s=60))
    a, b = p.upstreams
    a.record_failure(time.monotonic())
    assert urls(p.candidates("m", None)) == ["http://b"]
    assert p.healthy_count() == 1


# -- through the gateway ---------------------------------------------------------------------
def post(gw, session: str | None, n: int = 1) -> None:
    headers = {"x-kvrelay-session-id": session} if session else {}
    with gw.client() as http:
        for _ in range(n):
            assert http.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200


def test_session_affinity_through_the_gateway(fake_upstream, start_gateway):
    f0, f1 = fake_upstream(), fake_upstream()
    gw = start_gateway([f0.url, f1.url])
    u0, u1 = gw.pool.upstreams
    post(gw, "s1", 3)
    assert (len(f0.received), len(f1.received)) == (3, 0)
    u0.in_flight += 1  # a request of someone else is running on f0
    post(gw, "s2")  # a new session lands on the idle upstream
    post(gw, "s1")  # s1 stays home despite the load
    u0.in_flight -= 1
    assert (len(f0.received), len(f1.received)) == (4, 1)
    u1.in_flight += 1
    post(gw, "s2", 2)  # s2 stays on f1 although f0 is now the idle one
    u1.in_flight -= 1
    assert (len(f0.received), len(f1.received)) == (4, 3)
    rows = gw.rows(7)
    by_session = {}
    for row in rows:
        by_session.setdefault(row.session_id, set()).add(row.upstream)
    assert by_session == {"s1": {f0.url}, "s2": {f1.url}}


def test_session_from_metadata_and_user_fields(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http:
        http.post("/v1/chat/completions", json={**CHAT, "metadata": {"session_id": "m-s", "agent_id": "m-a"}})
        http.post("/v1/chat/completions", json={**CHAT, "user": "u-s"})
        http.post("/v1/chat/completions", json={**CHAT, "user": "u-s", "metadata": {"session_id": "m-s"}},
                  headers={"x-kvrelay-session-id": "h-s", "x-kvrelay-agent-id": "h-a"})
    rows = gw.rows(3)
    assert [(r.session_id, r.agent_id) for r in rows][::2] == [("m-s", "m-a"), ("h-s", "h-a")]
    assert rows[1].session_id == "u-s" and rows[1].agent_id.startswith("agent-")  # inferred: no system prompt


def test_load_guard_through_the_gateway(fake_upstream, start_gateway):
    f0, f1 = fake_upstream(), fake_upstream()
    gw = start_gateway([f0.url, f1.url])
    u0, _ = gw.pool.upstreams
    post(gw, "hot", 2)
    assert (len(f0.received), len(f1.received)) == (2, 0)
    u0.in_flight += 50  # the session's home is swamped
    try:
        post(gw, "hot")
    finally:
        u0.in_flight -= 50
    assert (len(f0.received), len(f1.received)) == (2, 1)


def test_breaker_keeps_a_failing_upstream_out_for_its_cooldown(fake_upstream, start_gateway):
    """An upstream that fails every completion (while its /health still answers 200) is
    taken out for breaker.cooldown_s after failure_threshold failures (README); passing
    health checks must not close the breaker before the cooldown is over."""
    fake = fake_upstream(status=500)
    gw = start_gateway([fake.url], health_interval_s=0.1, breaker=Breaker(failure_threshold=2, cooldown_s=30))
    with gw.client() as http:
        codes = []
        for _ in range(10):  # fail until the breaker opens (a health check may fall in between)
            codes.append(http.post("/v1/chat/completions", json=CHAT).json()["error"]["code"])
            if codes[-1] == "no_upstream":
                break
        assert codes[-1] == "no_upstream", codes
        assert set(codes[:-1]) == {"upstream_failed"}
        failures = len(fake.received)
        time.sleep(0.5)  # several health checks pass meanwhile, well inside the 30 s cooldown
        r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstream"
    assert len(fake.received) == failures


def test_health_loop_takes_a_dead_upstream_out_and_back(fake_upstream, start_gateway):
    f0, f1 = fake_upstream(), fake_upstream()
    gw = start_gateway([f0.url, f1.url])
    u0, u1 = gw.pool.upstreams
    f0.behaviour.health_status = 503
    deadline = time.monotonic() + 3
    while u0.healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not u0.healthy and u1.healthy
    post(gw, None, 2)
    assert (len(f0.received), len(f1.received)) == (0, 2)
    f0.behaviour.health_status = 200
    deadline = time.monotonic() + 3
    while not u0.healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert u0.healthy
    with httpx.Client(base_url=gw.url) as http:
        assert http.get("/ready").status_code == 200
