"""Upstream engines: health, circuit breakers, load, and session-affine choice.

A session keeps going to the upstream it first landed on, because that upstream holds
its KV cache; it moves only when that upstream is unhealthy or carries more than
`load_guard_factor` times the mean load (one hot session must not pin a replica).
A new session goes to the least loaded upstream, and among equally loaded ones to the
one that is home to the fewest sessions: sessions that start together spread even when
none of their requests is in flight yet.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from gateway.settings import Breaker

_MAX_SESSIONS = 100_000
_MIN_GUARDED_LOAD = 4  # below this many in-flight requests a session never leaves its upstream


@dataclass
class Upstream:
    url: str
    breaker: Breaker
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    open_until: float = 0.0  # circuit open (no traffic) until this monotonic time
    models: frozenset[str] = field(default_factory=frozenset)

    def available(self, now: float) -> bool:
        """Healthy and the breaker closed, or its cooldown over (then the next failure
        re-opens it at once, since the failure count is only reset by a success)."""
        return self.healthy and now >= self.open_until

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.open_until = 0.0
        self.healthy = True

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when it (re)opens the breaker."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.breaker.failure_threshold:
            self.open_until = now + self.breaker.cooldown_s
            return True
        return False

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models


class UpstreamPool:
    def __init__(self, urls: list[str], breaker: Breaker, load_guard_factor: float) -> None:
        self.upstreams = [Upstream(url, breaker) for url in urls]
        self.load_guard_factor = load_guard_factor
        # session -> upstream, least recently used first; bounded so idle sessions age out.
        self._affinity: OrderedDict[str, Upstream] = OrderedDict()
        self._homes: Counter[str] = Counter()  # upstream url -> sessions living there

    def candidates(self, model: str, session_id: str | None, hold: bool = False) -> list[Upstream]:
        """Upstreams to try in order: the session's own first (unless overloaded), then
        the rest by load. Empty when none is available for the model. `hold` keeps the
        session home even when overloaded: the requests of an All-Gather round share
        their KV only if they land on the same upstream."""
        now = time.monotonic()
        usable = [u for u in self.upstreams if u.available(now) and u.serves(model)]
        by_load = sorted(usable, key=lambda u: u.in_flight)
        if session_id is None or not by_load:
            return by_load
        home = self._affinity.get(session_id)
        if home is None or home not in usable or (not hold and self._overloaded(home, usable)):
            home = min(by_load, key=lambda u: (u.in_flight, self._homes[u.url]))
            self._settle(session_id, home)
        self._affinity.move_to_end(session_id)
        return [home] + [u for u in by_load if u is not home]

    def _settle(self, session_id: str, home: Upstream) -> None:
        self.forget_session(session_id)
        self._affinity[session_id] = home
        self._homes[home.url] += 1
        if len(self._affinity) > _MAX_SESSIONS:
            _, oldest = self._affinity.popitem(last=False)
            self._homes[oldest.url] -= 1

    def _overloaded(self, upstream: Upstream, usable: list[Upstream]) -> bool:
        """More than load_guard_factor x the mean load of the *other* upstreams (the home
        one must not dilute its own mean), and busy enough that moving is worth a cache miss."""
        others = [u for u in usable if u is not upstream]
        if not others or upstream.in_flight < _MIN_GUARDED_LOAD:
            return False
        mean_others = sum(u.in_flight for u in others) / len(others)
        return upstream.in_flight > self.load_guard_factor * mean_others

    def knows_no(self, model: str) -> bool:
        """True when every upstream has listed its models and none lists this one."""
        return all(u.models for u in self.upstreams) and not any(model in u.models for u in self.upstreams)

    def served(self, model: str) -> bool:
        """True when some upstream lists `model` (a bounded set: the metrics' model labels)."""
        return any(model in u.models for u in self.upstreams)

    def healthy_count(self) -> int:
        now = time.monotonic()
        return sum(1 for u in self.upstreams if u.available(now))

    def forget_session(self, session_id: str) -> None:
        home = self._affinity.pop(session_id, None)
        if home is not None:
            self._homes[home.url] -= 1
