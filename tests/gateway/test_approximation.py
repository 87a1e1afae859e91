"""Opt-in approximate reuse: exact by default, rules per tenant / app / agent / model,
the X-Kvrelay-Reuse header, and the fidelity guard's switch; unit tests of Approximation
and end to end through the gateway (the plans a fake upstream receives)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvrelay.wire.plan import Segment, SegmentPlan
from kvrelay.gateway.approximation import ApproximationSettings, ApproxRule, Approximation, parse_header
from kvrelay.gateway.settings import GatewaySettings

SYSTEM = "You are the critic of a small travel agency. Answer in one sentence, kindly and briefly."
OTHER = "Earlier answer: a week in Lisbon in May is mild and the city is not yet crowded at all."


def _chat(question: str = "What do you think?") -> dict:
    return {"model": "fake", "max_tokens": 4,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{OTHER}\n{question}"}]}


def _plan() -> SegmentPlan:
    segments = [Segment(message_index=0, char_start=0, char_end=5, kind="fixed_prefix", name="a", content_hash="0" * 64),
                Segment(message_index=0, char_start=5, char_end=9, kind="private", content_hash="0" * 64),
                Segment(message_index=1, char_start=0, char_end=9, kind="placeholder", name="agent_b_current",
                        content_hash="0" * 64)]
    return SegmentPlan(session_id="s", agent_id="a", request_id="r", segments=segments)


class _Off:
    """A switch that has turned `blend` off for app `drifting`."""

    def allows(self, tenant: str, app: str, method: str) -> bool:
        return not (app == "drifting" and method == "blend")


# -- Approximation -----------------------------------------------------------------------
def test_no_rule_no_header_is_exact():
    assert Approximation().method_for("on", "t", "app", "agent", "m") is None


def test_the_first_rule_whose_conditions_all_hold_wins():
    rules = [ApproxRule(method="kvcomm", app="travel-*", agent="critic*"),
             ApproxRule(method="blend", app="travel-*"),
             ApproxRule(method="shift", model="big-*")]
    approx = Approximation(rules)
    assert approx.method_for("on", "t", "travel-1", "critic-2", "m") == "kvcomm"
    assert approx.method_for("on", "t", "travel-1", "planner", "m") == "blend"
    assert approx.method_for("on", "t", "shop", None, "big-model") == "shift"
    assert approx.method_for("on", "t", "shop", None, "small") is None


def test_the_header_opts_one_request_in_or_keeps_it_exact():
    approx = Approximation([ApproxRule(method="blend", app="*")])
    assert approx.method_for("link", "t", "a", None, "m") == "link"
    assert approx.method_for("exact", "t", "a", None, "m") is None
    assert approx.method_for("off", "t", "a", None, "m") is None
    assert Approximation(allow_header=False).method_for("blend", "t", "a", None, "m") is None


def test_a_method_the_guard_switched_off_is_exact_for_that_app_only():
    approx = Approximation([ApproxRule(method="blend")], switch=_Off())
    assert approx.method_for("on", "t", "drifting", None, "m") is None
    assert approx.method_for("blend", "t", "drifting", None, "m") is None  # the header cannot override the guard
    assert approx.method_for("on", "t", "steady", None, "m") == "blend"
    assert approx.method_for("shift", "t", "drifting", None, "m") == "shift"


def test_apply_names_the_method_on_every_segment():
    """Private segments carry it too: the engine places none of them, but the method
    tells it the request opted in, so it keeps the request's segments and answer."""
    plan = _plan()
    assert Approximation.apply(plan, None) is plan
    blended = Approximation.apply(plan, "blend")
    assert [s.method for s in blended.segments] == ["blend", "blend", "blend"]


@pytest.mark.parametrize("value,choice", [(None, "on"), ("on", "on"), ("TRUE", "on"), (" off ", "off"),
                                          ("0", "off"), ("exact", "exact"), ("Blend", "blend"), ("kvcomm", "kvcomm")])
def test_header_values(value, choice):
    assert parse_header(value) == choice


@pytest.mark.parametrize("value", ["", "dense", "prefix", "blend,shift", "yes please"])
def test_unknown_header_values_are_refused(value):
    with pytest.raises(ValueError, match="exact or an approximate method"):
        parse_header(value)


def test_rules_are_checked_at_startup(tmp_path: Path):
    with pytest.raises(ValidationError):
        ApproxRule(method="dense")  # exact methods are the default, not a rule
    with pytest.raises(ValidationError):
        ApproxRule(method="blend", agnet="x")  # a misspelt condition must not match everything
    path = tmp_path / "approx.yaml"
    path.write_text("rules:\n  - {method: blend, app: 'travel-*'}\n")
    settings = ApproximationSettings(rules=[ApproxRule(method="shift", agent="x")], file=path)
    assert [r.method for r in settings.all_rules] == ["shift", "blend"]
    path.write_text("rules:\n  - {method: blend, ap: 'travel-*'}\n")
    with pytest.raises(ValidationError, match="invalid approximation file"):
        ApproximationSettings(file=path)
    with pytest.raises(ValidationError, match="cannot read the approximation file"):
        ApproximationSettings(file=tmp_path / "missing.yaml")


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVRELAY_APPROXIMATION__RULES", '[{"method": "blend", "app": "travel-*"}]')
    monkeypatch.setenv("KVRELAY_APPROXIMATION__GUARD__MIN_TOP1", "0.9")
    settings = GatewaySettings()
    assert settings.approximation.all_rules == [ApproxRule(method="blend", app="travel-*")]
    assert settings.approximation.guard.min_top1 == 0.9


# -- through the gateway -----------------------------------------------------------------
def _methods(fake) -> list[str | None]:
    plan = fake.received[-1].body["kv_transfer_params"]["kvrelay"]
    return [s.get("method") for s in plan["segments"]]


def _post(gw, headers: dict[str, str] | None = None, app: str = "travel-1"):
    with gw.client() as http:
        return http.post("/v1/chat/completions", json=_chat(), headers={"x-kvrelay-app": app, **(headers or {})})


def test_by_default_every_plan_is_exact(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    for _ in range(3):  # the fixed prefix is learnt from the second prompt on
        assert _post(gw).status_code == 200
    assert _methods(fake) and set(_methods(fake)) == {None}


def test_a_rule_opts_an_app_in_and_the_header_overrides(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url], approximation={"rules": [{"method": "blend", "app": "travel-*"}]})
    for _ in range(3):
        assert _post(gw).status_code == 200
    assert _methods(fake) and set(_methods(fake)) == {"blend"}
    assert _post(gw, app="shop").status_code == 200
    assert set(_methods(fake)) == {None}  # another app stays exact
    assert _post(gw, {"x-kvrelay-reuse": "exact"}).status_code == 200
    assert set(_methods(fake)) == {None}
    assert _post(gw, {"x-kvrelay-reuse": "shift"}, app="shop").status_code == 200
    assert set(_methods(fake)) == {"shift"}
    assert '"method":"shift"' in gw.rows(6)[-1].plan.replace(" ", "")  # the record says what ran


def test_a_bad_header_is_a_400_naming_it(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    r = _post(gw, {"x-kvrelay-reuse": "fastest"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "x-kvrelay-reuse" and "exact or an approximate method" in error["message"]
    assert not fake.received
    assert gw.rows(1)[0].http_status == 400  # refused, and recorded
