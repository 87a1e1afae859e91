"""PlanSeal: a plan is followed only with the gateway's seal, fresh and unaltered."""

from __future__ import annotations

import pytest

from kvrelay.wire.seal import PlanSeal, SealCheck

SECRET = "plan-secret-" + "x" * 20
PLAN = {"version": 1, "session_id": "s", "agent_id": "a", "request_id": "r", "segments": [], "tenant": "team-a"}


def test_a_sealed_plan_checks_out_until_it_is_stale():
    seal = PlanSeal(SECRET, max_age_s=60)
    sealed = seal.seal(PLAN, now=1000)
    assert seal.check(PLAN, sealed, now=1030) == SealCheck(True)
    assert seal.check(PLAN, sealed, now=1061) == SealCheck(False, "stale")
    assert seal.check(PLAN, seal.seal(PLAN, now=2000), now=1000) == SealCheck(False, "stale")  # from the future


@pytest.mark.parametrize("change", [{"tenant": "team-b"}, {"agent_id": "b"}, {"segments": [{"x": 1}]}])
def test_any_change_to_the_plan_breaks_the_seal(change):
    seal = PlanSeal(SECRET)
    sealed = seal.seal(PLAN, now=1000)
    assert seal.check({**PLAN, **change}, sealed, now=1000) == SealCheck(False, "forged")


def test_another_secret_or_a_reissued_time_is_a_forgery():
    sealed = PlanSeal("another-secret-" + "y" * 20).seal(PLAN, now=1000)
    seal = PlanSeal(SECRET)
    assert seal.check(PLAN, sealed, now=1000).reason == "forged"
    assert seal.check(PLAN, {**seal.seal(PLAN, now=1000), "t": 1001}, now=1001).reason == "forged"


@pytest.mark.parametrize("bad", [None, "mac", {"t": "1000", "mac": "x"}, {"t": True, "mac": "x"}, {"t": 1000}])
def test_missing_or_malformed_seals_are_refused_and_counted(bad):
    seal = PlanSeal(SECRET)
    result = seal.check(PLAN, bad, now=1000)
    assert not result.accepted and result.reason in ("unsealed", "malformed")
    assert sum(seal.rejected.values()) == 1


def test_the_secret_must_be_long_enough():
    with pytest.raises(ValueError, match="16"):
        PlanSeal("short")


def test_the_seal_is_read_from_the_environment():
    assert PlanSeal.from_env({}) is None
    seal = PlanSeal.from_env({"KVRELAY_PLAN_SECRET": SECRET, "KVRELAY_PLAN_MAX_AGE_S": "30"})
    assert seal is not None and seal.max_age_s == 30
    with pytest.raises(ValueError, match="KVRELAY_PLAN_MAX_AGE_S"):
        PlanSeal.from_env({"KVRELAY_PLAN_SECRET": SECRET, "KVRELAY_PLAN_MAX_AGE_S": "soon"})


def test_a_plan_with_a_lone_surrogate_is_sealed_and_checked_without_an_error():
    seal = PlanSeal(SECRET)
    plan = {**PLAN, "session_id": "\ud800"}
    assert seal.check(plan, seal.seal(plan, now=1000), now=1000).accepted
    assert seal.check(PLAN, {"t": 1000, "mac": "\ud800"}, now=1000).reason == "malformed"
