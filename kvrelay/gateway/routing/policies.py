"""Routing policies: which upstream a request tries first (the rest are its failover order).

Every policy sees the same thing: the usable upstreams (healthy, breaker closed, serving
the model) and a `Route` (the session, whether the request belongs to an All-Gather
round that must land together, the blocks its prompt is predicted to start with and its
size). Registered by name in `POLICIES`; `routing.policy` picks one.

- `session`: the session stays on its home upstream, which holds its KV, unless that one
  carries over `load_guard_factor` x the others' mean load; a new session goes to the
  least loaded (ties: home to fewest sessions). The gateway's policy before cache-aware
  routing, kept as an option.
- `round_robin`: each request to the next upstream in turn.
- `least_loaded`: fewest requests in flight (LiteLLM's least-busy).
- `prefix_hash`: a rendezvous hash of the prompt's head (vllm-router's and SGLang's
  consistent hashing): prompts that start alike land together, regardless of load.
- `cache_aware`: kvrelay's. The cost of sending a request to an upstream is the prompt
  tokens it would compute there (those not among the blocks the replica holds, nor among
  the texts an opted-in request would place from KV the replica computed) plus
  `load_weight` x the work already in flight there (the prompt tokens its requests have
  still to compute, and `decode_tokens` for each; kvrelay/gateway/settings.py says why). The
  cheapest wins; a request that would hit nowhere goes where the least work is queued
  (its session's home on a tie), and so does one whose hits cover less than
  `min_hit_share` of its prompt anywhere (SGLang's cache-aware router has the same
  threshold) or only on replicas past the load guard. Requests of a round go home.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from kvrelay.gateway.routing.cache_map import CHARS_PER_TOKEN, CacheMap
from kvrelay.gateway.routing.prefix_keys import PrefixKey
from kvrelay.gateway.routing.segment_map import APPROXIMATE, PlacedText, SegmentMap, placed_texts
from kvrelay.gateway.settings import RoutingSettings

if TYPE_CHECKING:
    from kvrelay.gateway.upstreams import Upstream
    from kvrelay.wire.plan import Segment

MAX_SESSIONS = 100_000
MIN_GUARDED_LOAD = 4  # below this many in-flight requests a session never leaves its upstream
HEAD_CHARS = 1024  # prefix_hash: the prompt head it hashes is its shortest prefix of at least this


class Route(NamedTuple):
    session_id: str | None
    hold: bool = False  # an All-Gather round's request: it must land where its round's do
    keys: tuple[PrefixKey, ...] = ()
    predicted: tuple[str, ...] = ()  # block digests the prompt is expected to start with
    prompt_tokens: int = 0  # estimated
    placed: tuple[PlacedText, ...] = ()  # texts an opted-in request would place (kvrelay/gateway/routing/segment_map.py)
    kept_request: str | None = None  # an opted-in request's id: where it runs, its answer is kept


def plan_route(keys: tuple[PrefixKey, ...], cache: CacheMap, reads_cache: bool,
               segments: Sequence[Segment] = (), request_id: str | None = None) -> Route:
    """A prompt's Route (no session yet): its keys, the blocks the cache map predicts it
    starts with and the texts its plan would place (when the policy reads them), and its
    size, estimated without a tokenizer."""
    predicted = tuple(cache.predict(keys)) if reads_cache else ()
    placed = placed_texts(segments) if reads_cache else ()
    opted_in = reads_cache and any(s.method in APPROXIMATE for s in segments)
    chars = keys[-1].chars if keys else 0
    tokens = max(chars // CHARS_PER_TOKEN, len(predicted) * cache.block_size)
    return Route(None, keys=keys, predicted=predicted, prompt_tokens=tokens, placed=placed,
                 kept_request=request_id if opted_in else None)


def held_tokens(route: Route, url: str, cache: CacheMap, segments: SegmentMap, segment_weight: float) -> float:
    """Prompt tokens the replica at `url` would not compute: the prefix blocks it holds,
    and the texts it would place, each placed token counted at `segment_weight`."""
    return cache.hits(url, route.keys, route.predicted) + segment_weight * segments.held_tokens(url, route.placed)


class SessionHomes:
    """Each session's home upstream, least recently used first, bounded so idle sessions
    age out; and how many sessions live on each upstream.

    Shared by gateway replicas (`shared`): a new session's home is the upstream its id
    hashes to (rendezvous hashing over the usable upstreams), so replicas that plan its
    first requests at the same moment agree without asking each other, and every
    settled home is told to `on_settle` for the other replicas to learn."""

    def __init__(self) -> None:
        self.homes: OrderedDict[str, Upstream] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.shared = False
        self.on_settle: Callable[[str, str], None] | None = None  # (session, upstream url)

    def get(self, session_id: str) -> Upstream | None:
        home = self.homes.get(session_id)
        if home is not None:
            self.homes.move_to_end(session_id)
        return home

    def settle(self, session_id: str, home: Upstream, *, tell: bool = True) -> None:
        if self.homes.get(session_id) is home:
            return
        self.forget(session_id)
        self.homes[session_id] = home
        self.counts[home.url] += 1
        if len(self.homes) > MAX_SESSIONS:
            _, oldest = self.homes.popitem(last=False)
            self.counts[oldest.url] -= 1
        if tell and self.on_settle is not None:
            self.on_settle(session_id, home.url)

    def forget(self, session_id: str) -> None:
        home = self.homes.pop(session_id, None)
        if home is not None:
            self.counts[home.url] -= 1

    def hashed(self, session_id: str, usable: list[Upstream]) -> Upstream:
        """The usable upstream `session_id` hashes to: the same on every replica, and
        only the sessions of an upstream that leaves move."""
        return max(usable, key=lambda u: hashlib.blake2b(f"{session_id}\0{u.url}".encode(), digest_size=8).digest())


class RoutingPolicy(ABC):
    """Orders the usable upstreams (never empty) for one request; the first is tried first."""

    name: ClassVar[str]
    reads_prompt: ClassVar[bool] = False  # whether it needs the Route's prefix keys
    reads_cache: ClassVar[bool] = False  # whether it needs the predicted blocks, and the engines' reports

    def __init__(self, homes: SessionHomes, load_guard_factor: float) -> None:
        self.homes = homes
        self.load_guard_factor = load_guard_factor

    @abstractmethod
    def order(self, route: Route, usable: list[Upstream]) -> list[Upstream]: ...

    def _first(self, chosen: Upstream, usable: list[Upstream]) -> list[Upstream]:
        return [chosen] + sorted((u for u in usable if u is not chosen), key=lambda u: u.in_flight)

    def _new_home(self, usable: list[Upstream]) -> Upstream:
        return min(usable, key=lambda u: (u.in_flight, self.homes.counts[u.url]))

    def _overloaded(self, upstream: Upstream, usable: list[Upstream]) -> bool:
        """More than load_guard_factor x the mean load of the *other* upstreams (the home
        one must not dilute its own mean), and busy enough that moving is worth a cache miss."""
        others = [u for u in usable if u is not upstream]
        if not others or upstream.in_flight < MIN_GUARDED_LOAD:
            return False
        mean_others = sum(u.in_flight for u in others) / len(others)
        return upstream.in_flight > self.load_guard_factor * mean_others

    def _session_home(self, route: Route, usable: list[Upstream]) -> Upstream | None:
        """The session's home (chosen by load if it has none, or if it left or, outside
        a round, is overloaded); None without a session."""
        if route.session_id is None:
            return None
        home = self.homes.get(route.session_id)
        if home is not None and home in usable and (route.hold or not self._overloaded(home, usable)):
            return home
        if home is None and self.homes.shared:  # first seen: where every replica would put it
            home = self.homes.hashed(route.session_id, usable)
        else:
            home = self._new_home(usable)
        self.homes.settle(route.session_id, home)
        return home


class SessionAffinity(RoutingPolicy):
    name = "session"

    def order(self, route: Route, usable: list[Upstream]) -> list[Upstream]:
        home = self._session_home(route, usable)
        by_load = sorted(usable, key=lambda u: u.in_flight)
        return by_load if home is None else [home] + [u for u in by_load if u is not home]


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, homes: SessionHomes, load_guard_factor: float) -> None:
        super().__init__(homes, load_guard_factor)
        self._next = 0

    def order(self, route: Route, usable: list[Upstream]) -> list[Upstream]:
        start = self._next % len(usable)
        self._next += 1
        return usable[start:] + usable[:start]


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def order(self, route: Route, usable: list[Upstream]) -> list[Upstream]:
        return sorted(usable, key=lambda u: u.in_flight)


class PrefixHash(RoutingPolicy):
    name = "prefix_hash"
    reads_prompt = True

    def order(self, route: Route, usable: list[Upstream]) -> list[Upstream]:
        head = next((k.key for k in route.keys if k.chars >= HEAD_CHARS), route.keys[-1].key if route.keys else b"")
        # Rendezvous hashing: an upstream leaving moves only the prompts that hashed to it.
        return sorted(usable, key=lambda u: hashlib.blake2b(head + u.url.encode(), digest_size=8).digest())


class CacheAware(RoutingPolicy):
    name = "cache_aware"
    reads_prompt = True
    reads_cache = True

    def __init__(self, homes: SessionHomes, load_guard_factor: float, cache: CacheMap, load_weight: float = 1.0,
                 decode_tokens: int = 8, min_hit_share: float = 0.5, segments: SegmentMap | None = None,
                 segment_weight: float = 0.9) -> None:
        super().__init__(homes, load_guard_factor)
        self.cache = cache
        self.segments = segments if segments is not None else SegmentMap()
        self.segment_weight = segment_weight
        self.load_weight = load_weight
        self.decode_tokens = decode_tokens
        self.min_hit_share = min_hit_share

    def order(self, route: Route, usable: list[Upstream]) -> list[Upstream]:
        home = self._session_home(route, usable)
        if route.hold and home is not None:
            return self._first(home, usable)
        hits = {u.url: held_tokens(route, u.url, self.cache, self.segments, self.segment_weight) for u in usable}
        # Only a hit covering much of the prompt is worth following: a small one (an app's
        # short persona) would gather the sessions of one app on one replica, whatever
        # their size, where spreading sessions keeps the replicas' work even.
        floor = self.min_hit_share * route.prompt_tokens
        # Nor onto a replica the load guard would move a session off: a prefix many sessions
        # share is better computed again on another replica than followed onto one already
        # carrying them (bench cluster, 32 sessions, before this rule: one replica's queue
        # wait summed to 862 s, the other's to 207 s).
        worth = [u for u in usable if hits[u.url] > 0 and hits[u.url] >= floor and not self._overloaded(u, usable)]
        # No hit worth following: the replica with the least work queued, home on a tie. Sending
        # it home regardless (as `session` would) stacked sessions of unequal size on one replica
        # while the other idled: in the simulator (benchmarks/cluster_sim.py, the quick trace)
        # that made cache_aware 1.3-1.7x slower at TTFT p50 than round-robin on 2-64 replicas.
        fallback = min(usable, key=lambda u: (self.cost(u, route.prompt_tokens, 0.0), u is not home,
                                              self.homes.counts[u.url]))
        best = fallback
        if worth:
            contenders = worth if fallback in worth else [*worth, fallback]
            costs = {u.url: self.cost(u, route.prompt_tokens, hits[u.url]) for u in contenders}
            # Ties go home, then to the upstream home to fewer sessions.
            best = min(contenders, key=lambda u: (costs[u.url], u is not home, self.homes.counts[u.url]))
        if route.session_id is not None:
            self.homes.settle(route.session_id, best)
        return self._first(best, usable)

    def cost(self, upstream: Upstream, prompt_tokens: int, hit_tokens: float) -> float:
        """Prompt tokens to compute there, plus the weighted work still in flight there."""
        queued = upstream.in_flight_tokens + upstream.in_flight * self.decode_tokens
        return max(prompt_tokens - hit_tokens, 1.0) + self.load_weight * queued


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (SessionAffinity, RoundRobin, LeastLoaded, PrefixHash,
                                                                  CacheAware)}


def build_policy(settings: RoutingSettings, homes: SessionHomes, load_guard_factor: float,
                 cache: CacheMap, segments: SegmentMap | None = None) -> RoutingPolicy:
    if settings.policy == CacheAware.name:
        return CacheAware(homes, load_guard_factor, cache, settings.load_weight, settings.decode_tokens,
                          settings.min_hit_share, segments, settings.segment_weight)
    return POLICIES[settings.policy](homes, load_guard_factor)
