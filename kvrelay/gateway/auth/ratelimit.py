"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

A bucket holds up to one minute's allowance and refills continuously, so a client can
burst up to its limit and then proceeds at the limit's rate. Tokens are charged in two
steps: the prompt estimate before the upstream call (the real count is not known yet),
then the difference to the upstream's reported usage (prompt + completion) once the
call ends. The correction may push a bucket below zero: the client then waits until it
has paid the debt, so underestimates cannot add up to more than the limit over time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

from kvrelay.gateway.auth.keys import KeyInfo


class Bucket:
    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # units per second
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is now)."""
        return max(0.0, (amount - self.level) / self.rate)


class Admission(NamedTuple):
    admitted: bool
    retry_after_s: float  # when not admitted: how long until the same request would be
    reason: str  # "requests" or "tokens" when refused; "" when admitted
    too_large: bool = False  # the estimate alone exceeds the per-minute limit: waiting cannot help


class RateLimiter:
    """Buckets per key id; a key's limits (or the defaults) decide which buckets it has."""

    def __init__(self, default_rpm: int | None = None, default_tpm: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._default_rpm = default_rpm
        self._default_tpm = default_tpm
        self._clock = clock
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}

    def limits(self, key: KeyInfo) -> tuple[int | None, int | None]:
        return (key.requests_per_minute or self._default_rpm, key.tokens_per_minute or self._default_tpm)

    def needs_estimate(self, key: KeyInfo | None) -> bool:
        return key is not None and self.limits(key)[1] is not None

    def admit(self, key: KeyInfo, estimated_tokens: int) -> Admission:
        """Take one request and the estimate from the key's buckets, or neither."""
        now = self._clock()
        rpm, tpm = self.limits(key)
        requests = self._bucket(self._requests, key.id, rpm, now)
        tokens = self._bucket(self._tokens, key.id, tpm, now)
        if tokens is not None and estimated_tokens > tokens.capacity:
            return Admission(False, 60.0, "tokens", too_large=True)
        waits = [(requests.wait_for(1), "requests")] if requests is not None else []
        if tokens is not None:
            waits.append((tokens.wait_for(estimated_tokens), "tokens"))
        wait, reason = max(waits, default=(0.0, ""))
        if wait > 0:
            return Admission(False, wait, reason)
        if requests is not None:
            requests.level -= 1
        if tokens is not None:
            tokens.level -= estimated_tokens
        return Admission(True, 0.0, "")

    def settle(self, key: KeyInfo, charged: int, actual: int) -> None:
        """Correct a charge once the upstream reported the real token count."""
        bucket = self._tokens.get(key.id)
        if bucket is not None:
            bucket.refill(self._clock())
            bucket.level -= actual - charged

    def _bucket(self, buckets: dict[str, Bucket], key_id: str, per_minute: int | None, now: float) -> Bucket | None:
        if per_minute is None:
            buckets.pop(key_id, None)
            return None
        bucket = buckets.get(key_id)
        if bucket is None or bucket.capacity != per_minute:  # new key, or its limit changed
            bucket = buckets[key_id] = Bucket(per_minute, now)
        bucket.refill(now)
        return bucket


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds; round up so a client that obeys it is admitted."""
    return str(max(1, math.ceil(seconds)))
