"""Token buckets per key: requests/min and tokens/min, with estimates settled afterwards."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from kvrelay.gateway.auth import KeyInfo, RateLimiter
from kvrelay.gateway.auth.ratelimit import retry_after_header


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(rpm: int | None = None, tpm: int | None = None, key_id: str = "key_a") -> KeyInfo:
    return KeyInfo(key_id, "a", "kvr-aaaaaa", rpm, tpm, datetime.now(UTC), None)


def test_requests_per_minute_allow_a_burst_then_the_rate():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    k = key(rpm=6)  # one every 10 s
    assert all(limiter.admit(k, 0).admitted for _ in range(6))
    refused = limiter.admit(k, 0)
    assert not refused.admitted and refused.reason == "requests"
    assert refused.retry_after_s == pytest.approx(10.0)
    clock.now += 9.9
    assert not limiter.admit(k, 0).admitted
    clock.now += 0.1
    assert limiter.admit(k, 0).admitted


def test_a_refused_request_takes_nothing_from_either_bucket():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    k = key(rpm=100, tpm=1000)
    assert limiter.admit(k, 900).admitted
    refused = limiter.admit(k, 200)  # tokens short; the request bucket must not be charged
    assert not refused.admitted and refused.reason == "tokens"
    assert refused.retry_after_s == pytest.approx(100 / (1000 / 60))
    assert limiter.admit(k, 100).admitted  # the 100 tokens left are still there


def test_settling_charges_the_real_usage_and_debt_delays_the_next_call():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    k = key(tpm=600)  # 10 tokens/s
    assert limiter.admit(k, 100).admitted
    limiter.settle(k, charged=100, actual=700)  # the estimate was far too low: 100 in debt
    refused = limiter.admit(k, 10)
    assert not refused.admitted and refused.retry_after_s == pytest.approx(11.0)
    clock.now += 11.0
    assert limiter.admit(k, 10).admitted


def test_overestimates_are_refunded():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    k = key(tpm=1000)
    assert limiter.admit(k, 800).admitted
    limiter.settle(k, charged=800, actual=100)
    assert limiter.admit(k, 850).admitted


def test_a_prompt_larger_than_the_whole_limit_is_refused_as_too_large():
    limiter = RateLimiter(clock=Clock())
    refused = limiter.admit(key(tpm=50), 51)
    assert not refused.admitted and refused.too_large


def test_defaults_apply_to_keys_without_limits_and_keys_are_independent():
    clock = Clock()
    limiter = RateLimiter(default_rpm=1, clock=clock)
    a, b, own = key(key_id="a"), key(key_id="b"), key(rpm=3, key_id="c")
    assert limiter.admit(a, 0).admitted and not limiter.admit(a, 0).admitted
    assert limiter.admit(b, 0).admitted
    assert sum(limiter.admit(own, 0).admitted for _ in range(4)) == 3
    assert not limiter.needs_estimate(a) and RateLimiter(default_tpm=5).needs_estimate(a)


def test_no_limits_means_no_buckets():
    limiter = RateLimiter(clock=Clock())
    assert all(limiter.admit(key(), 10**9).admitted for _ in range(1000))


def test_a_changed_limit_takes_effect():
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    assert limiter.admit(key(rpm=1), 0).admitted and not limiter.admit(key(rpm=1), 0).admitted
    assert limiter.admit(key(rpm=5), 0).admitted


@pytest.mark.parametrize("seconds, header", [(0.01, "1"), (1.0, "1"), (1.2, "2"), (59.5, "60")])
def test_retry_after_rounds_up_to_whole_seconds(seconds, header):
    assert retry_after_header(seconds) == header
