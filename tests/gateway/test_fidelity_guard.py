"""The fidelity guard (kvrelay/gateway/fidelity_guard.py): rolling figures per (tenant, app,
method), switch-off under the floor, cool-down re-probes, operator re-enable; its
/metrics series, the poller's handling of engine answers, and the admin API."""

from __future__ import annotations

import logging
import random

from prometheus_client import CollectorRegistry, generate_latest

from kvrelay.gateway.approximation import ApproxRule, Approximation, GuardSettings
from kvrelay.gateway.fidelity_guard import FidelityGuard, Score
from kvrelay.gateway.fidelity_metrics import FidelityCollector
from kvrelay.gateway.fidelity_poll import FidelityPoller, _score

GOOD, BAD = (0.99, 0.001), (0.6, 0.4)
ADMIN = "admin-" + "s3cret" * 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _guard(**kw: float) -> tuple[FidelityGuard, Clock]:
    clock = Clock()
    settings = GuardSettings(**{"min_samples": 3, "window": 10, "cooldown_s": 60.0, **kw})
    return FidelityGuard(settings, random.Random(7), clock), clock


def _feed(guard: FidelityGuard, app: str, figures: tuple[float, float], n: int, method: str = "shift") -> None:
    for _ in range(n):
        guard.record(Score("t", app, method, *figures))


def test_a_drifting_app_is_switched_off_after_min_samples_and_an_exact_one_is_not(caplog):
    guard, _ = _guard()
    _feed(guard, "drifting", BAD, 2)
    assert guard.allows("t", "drifting", "shift")  # two scores decide nothing
    _feed(guard, "steady", GOOD, 5)
    with caplog.at_level(logging.WARNING):
        _feed(guard, "drifting", BAD, 1)
    assert not guard.allows("t", "drifting", "shift")
    assert guard.allows("t", "drifting", "blend") and guard.allows("t", "steady", "shift")
    assert guard.allows("other-tenant", "drifting", "shift")
    assert "shift switched off for app drifting" in caplog.text and "top-1 0.600" in caplog.text
    assert guard.num_switch_offs == {"shift": 1}
    approx = Approximation([ApproxRule(method="shift")], switch=guard, sampler=guard)
    assert approx.method_for("on", "t", "drifting", None, "m") is None
    assert approx.method_for("on", "t", "steady", None, "m") == "shift"


def test_kl_alone_can_switch_a_method_off():
    guard, _ = _guard()
    _feed(guard, "a", (1.0, 0.05), 3)
    assert not guard.allows("t", "a", "shift")


def test_after_the_cool_down_a_probation_decides_on_new_scores():
    guard, clock = _guard()
    _feed(guard, "a", BAD, 3)
    clock.now += 59
    assert not guard.allows("t", "a", "shift")
    clock.now += 2
    assert guard.allows("t", "a", "shift")  # probation: allowed, every request probed
    assert all(guard.should_probe("t", "a", "shift") for _ in range(50))
    _feed(guard, "a", BAD, 3)  # fails again: off, for another cool-down
    assert not guard.allows("t", "a", "shift") and guard.num_switch_offs == {"shift": 2}
    clock.now += 61
    assert guard.allows("t", "a", "shift")
    _feed(guard, "a", GOOD, 2)
    assert guard.snapshot()[0]["state"] == "probation"
    _feed(guard, "a", GOOD, 1)  # passes: on, and back to sampling
    assert guard.snapshot()[0]["state"] == "on"
    assert sum(guard.should_probe("t", "a", "shift") for _ in range(2000)) < 200


def test_the_default_sample_rate_probes_about_one_request_in_twenty():
    guard = FidelityGuard(GuardSettings(), random.Random(1))
    share = sum(guard.should_probe("t", "a", "blend") for _ in range(20_000)) / 20_000
    assert 0.04 < share < 0.06


def test_an_operator_re_enables_a_method_and_it_is_judged_afresh():
    guard, _ = _guard()
    assert guard.enable("t", "a", "shift") == []  # never off
    _feed(guard, "a", BAD, 3)
    guard.record(Score("u", "a", "shift", *BAD))
    assert guard.enable("t", "a", "shift") == ["t"] and guard.allows("t", "a", "shift")
    row = next(r for r in guard.snapshot() if r["tenant"] == "t")
    assert row["state"] == "on" and row["samples"] == 0 and row["at_switch_off"]["top1"] == 0.6
    _feed(guard, "a", GOOD, 3)
    assert guard.allows("t", "a", "shift")


def test_tracked_keys_are_bounded_keeping_switched_off_ones():
    clock = Clock()
    guard = FidelityGuard(GuardSettings(min_samples=1), random.Random(0), clock, max_keys=3)
    guard.record(Score("t", "off", "shift", *BAD))
    for i in range(10):
        guard.record(Score("t", f"app{i}", "shift", *GOOD))
    apps = [r["app"] for r in guard.snapshot()]
    assert len(apps) == 3 and "off" in apps and not guard.allows("t", "off", "shift")


def test_metrics_series_are_bounded_and_the_rest_folded_as_other():
    guard, _ = _guard()
    for i in range(5):
        _feed(guard, f"app{i}", GOOD, 1)
    _feed(guard, "drifting", BAD, 3)
    registry = CollectorRegistry()
    registry.register(FidelityCollector(guard, max_series=2))
    text = generate_latest(registry).decode()
    assert 'kvrelay_fidelity_state{app="drifting",method="shift",tenant="t"} 2.0' in text
    assert 'kvrelay_fidelity_top1{app="other",method="shift",tenant="other"} 0.99' in text
    assert text.count("kvrelay_fidelity_samples{") == 3
    assert 'kvrelay_fidelity_switch_offs_total{method="shift"} 1.0' in text


def test_the_poller_takes_valid_results_and_follows_a_restarted_engine():
    guard, _ = _guard()
    poller = FidelityPoller(None, None, guard, 1.0)  # type: ignore[arg-type]
    good = {"tenant": "t", "app": "a", "method": "shift", "top1": 0.5, "kl": 0.3, "tokens": 4}
    body = {"results": [good, {**good, "method": "dense"}, {**good, "top1": float("nan")}, "junk",
                        {**good, "app": ""}], "next": 7}
    assert poller._take("u", 0, body) == 1 and poller._cursor["u"] == 7
    assert poller._take("u", 7, {"results": [], "next": 2}) == 0 and poller._cursor["u"] == 2  # restarted
    assert poller._take("u", 2, {"results": None}) == 0 and poller.num_errors == 1
    assert _score({**good, "kl": -1}) is None


# -- through the gateway -----------------------------------------------------------------
def test_upstreams_without_the_endpoint_are_left_alone_quietly(fake_upstream, start_gateway, caplog):
    fake = fake_upstream()
    gw = start_gateway([fake.url], approximation={"guard": {"poll_interval_s": 0.05}})
    with caplog.at_level(logging.INFO, logger="kvrelay.gateway"):
        with gw.client() as http:
            import time

            time.sleep(0.4)
            assert http.get("/ready").status_code == 200
            assert "kvrelay_fidelity_scores_total 0.0" in http.get("/metrics").text
    assert not [r for r in caplog.records if "fidelity" in r.getMessage()]


def test_admin_reads_figures_and_re_enables(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url], admin_key=ADMIN)
    guard = gw.state.fidelity
    _feed(guard, "drifting", BAD, 5)
    auth = {"authorization": f"Bearer {ADMIN}"}
    with gw.client() as http:
        assert http.get("/admin/fidelity").status_code == 401
        rows = http.get("/admin/fidelity", headers=auth).json()["data"]
        assert [(r["app"], r["state"]) for r in rows] == [("drifting", "off")]
        bad = http.post("/admin/fidelity/drifting/dense/enable", headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        missing = http.post("/admin/fidelity/steady/shift/enable", headers=auth, params={"tenant": "t"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "method_not_off"
        ok = http.post("/admin/fidelity/drifting/shift/enable", headers=auth)  # every tenant
        assert ok.status_code == 200 and ok.json()["tenants"] == ["t"]
        assert guard.allows("t", "drifting", "shift")
        page = http.get("/ui/fidelity", headers=auth)
        assert page.status_code == 200 and "drifting" in page.text
