"""Upstream engines: health, circuit breakers, load, and the choice among them.

Which usable upstream a request tries first is the routing policy's
(kvrelay/gateway/routing/policies.py): by default a session keeps going to the upstream it first
landed on, because that upstream holds its KV cache; it moves only when that upstream is
unhealthy or carries more than `load_guard_factor` times the mean load (one hot session
must not pin a replica). A new session goes to the least loaded upstream, and among
equally loaded ones to the one that is home to the fewest sessions: sessions that start
together spread even when none of their requests is in flight yet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrelay.gateway.routing.cache_map import CacheMap
from kvrelay.gateway.routing.policies import Route, SessionHomes, build_policy, held_tokens, plan_route
from kvrelay.gateway.routing.prefix_keys import prefix_keys
from kvrelay.gateway.routing.segment_map import SegmentMap
from kvrelay.gateway.settings import Breaker, RoutingSettings
from kvrelay.wire.plan import Segment



@dataclass
class Upstream:
    url: str
    breaker: Breaker
    healthy: bool = True
    in_flight: int = 0
    in_flight_tokens: int = 0  # prompt tokens the requests in flight still compute here (estimated)
    consecutive_failures: int = 0
    health_timeouts: int = 0  # health checks in a row that timed out
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
    def __init__(self, urls: list[str], breaker: Breaker, load_guard_factor: float,
                 routing: RoutingSettings | None = None) -> None:
        routing = routing or RoutingSettings()
        self.upstreams = [Upstream(url, breaker) for url in urls]
        self.homes = SessionHomes()
        self.cache = CacheMap(routing.max_prompts, routing.max_blocks, routing.lower_tier_weight)
        self.segments = SegmentMap(routing.max_blocks)
        self.segment_weight = routing.segment_weight
        self.policy = build_policy(routing, self.homes, load_guard_factor, self.cache, self.segments)

    def candidates(self, model: str, session_id: str | None, hold: bool = False,
                   route: Route | None = None) -> list[Upstream]:
        """Upstreams to try in order, as the routing policy ranks them (kvrelay/gateway/routing).
        Empty when none is available for the model. `hold` keeps the session home even
        when overloaded: the requests of an All-Gather round share their KV only if they
        land on the same upstream."""
        now = time.monotonic()
        usable = [u for u in self.upstreams if u.available(now) and u.serves(model)]
        if not usable:
            return []
        route = (route or Route(session_id))._replace(session_id=session_id, hold=hold)
        return self.policy.order(route, usable)

    def route(self, view: dict[str, Any], cache_salt: str | None, segments: Sequence[Segment] = (),
              request_id: str | None = None) -> Route | None:
        """What the policy needs to know of a request's prompt (its prefix keys, the blocks
        it is predicted to start with, the texts its plan would place, its size); None for
        a policy that reads none."""
        if not self.policy.reads_prompt:
            return None
        return plan_route(tuple(prefix_keys(view, cache_salt)), self.cache, self.policy.reads_cache, segments,
                          request_id)

    def routed(self, route: Route | None, upstream: Upstream) -> None:
        """The request went to `upstream`: its predicted blocks (and keys), the texts it
        places and, when it opted in, its answer will be there."""
        if route is not None and self.policy.reads_cache:
            self.cache.routed(upstream.url, route.keys, route.predicted)
            self.segments.routed(upstream.url, route.kept_request, route.placed)

    def learn(self, route: Route | None, url: str, digests: list[str]) -> None:
        """The engine at `url` reported the prompt's blocks: it holds them now, and a later
        prompt that starts like this one will start with them."""
        if route is not None:
            self.cache.learn(route.keys, digests)
            self.cache.replica(url).add(digests, reported=True)

    def expected_work(self, route: Route | None, upstream: Upstream) -> int:
        """Prompt tokens the request would compute on this upstream (the part of its
        predicted start the replica does not hold)."""
        if route is None:
            return 0
        held = held_tokens(route, upstream.url, self.cache, self.segments, self.segment_weight)
        return max(route.prompt_tokens - int(held), 0)

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
        self.homes.forget(session_id)
