"""Routing policies over the same upstreams: what each puts first, and why."""

from __future__ import annotations

import typing

import pytest

from kvrelay.gateway.routing.policies import POLICIES, Route
from kvrelay.gateway.routing.prefix_keys import PrefixKey
from kvrelay.gateway.settings import Breaker, RoutingPolicyName, RoutingSettings
from kvrelay.gateway.upstreams import UpstreamPool
from kvrelay.wire.cache_report import CacheReport
from kvrelay.wire.plan import Segment

URLS = ["http://a", "http://b", "http://c"]
BLOCKS = tuple(f"{i:016x}" for i in range(40))


def pool(policy: str, n: int = 3, **routing) -> UpstreamPool:
    return UpstreamPool(URLS[:n], Breaker(), 2.0, RoutingSettings(policy=policy, **routing))


def first(p: UpstreamPool, route: Route | None = None, session: str | None = None, hold: bool = False) -> str:
    return p.candidates("m", session, hold, route)[0].url


def test_every_policy_name_is_registered():
    assert set(POLICIES) == set(typing.get_args(RoutingPolicyName))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_orders_every_usable_upstream_once(policy):
    p = pool(policy)
    p.upstreams[1].healthy = False
    route = Route(None, keys=(PrefixKey(b"k" * 16, 10),), prompt_tokens=10)
    order = p.candidates("m", "s", False, route)
    assert sorted(u.url for u in order) == ["http://a", "http://c"]


def test_round_robin_takes_turns_whatever_the_load():
    p = pool("round_robin")
    p.upstreams[0].in_flight = 9
    assert [first(p) for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]


def test_least_loaded_ignores_sessions():
    p = pool("least_loaded")
    p.upstreams[0].in_flight, p.upstreams[1].in_flight = 3, 1
    assert first(p, session="s") == "http://c"
    p.upstreams[2].in_flight = 5
    assert first(p, session="s") == "http://b"


def test_prefix_hash_sends_a_prompt_head_to_one_upstream_and_moves_only_that_head_when_it_leaves():
    p = pool("prefix_hash")
    heads = [Route(None, keys=(PrefixKey(bytes([i]) * 16, 2000),)) for i in range(30)]
    placed = {i: first(p, r) for i, r in enumerate(heads)}
    assert len(set(placed.values())) == 3  # thirty heads spread over all three
    assert {first(p, r) for r in heads} == set(placed.values()) and all(first(p, heads[i]) == u
                                                                       for i, u in placed.items())
    p.upstreams[1].healthy = False
    moved = [i for i, r in enumerate(heads) if first(p, r) != placed[i]]
    assert moved and all(placed[i] == "http://b" for i in moved)


def test_cache_aware_sends_a_prompt_where_its_blocks_are():
    p = pool("cache_aware")
    p.cache.replace("http://c", CacheReport(block_size=16, device=list(BLOCKS[:30])))
    route = Route(None, predicted=BLOCKS, prompt_tokens=len(BLOCKS) * 16)
    assert first(p, route, session="s1") == "http://c"
    assert p.homes.get("s1").url == "http://c"  # and the session lives there now


def test_cache_aware_leaves_a_replica_whose_queue_costs_more_than_its_cache_saves():
    p = pool("cache_aware")
    p.cache.replace("http://c", CacheReport(block_size=16, device=list(BLOCKS[:30])))
    route = Route(None, predicted=BLOCKS, prompt_tokens=len(BLOCKS) * 16)
    a, b, c = p.upstreams
    a.in_flight = b.in_flight = 2  # busy enough that c's 4 is within the load guard
    c.in_flight, c.in_flight_tokens = 4, 400  # 2 x 8 decode + 400 more: less than the 480 tokens it saves
    assert first(p, route) == "http://c"
    c.in_flight_tokens = 600
    assert first(p, route) != "http://c"


def test_cache_aware_without_a_hit_goes_where_least_work_is_queued_and_home_on_a_tie():
    p = pool("cache_aware", n=2)
    route = Route(None, predicted=(), prompt_tokens=300)
    assert first(p, route, session="s1") == "http://a"
    assert first(p, route, session="s2") == "http://b"  # equal load: the upstream home to fewer sessions
    assert first(p, route, session="s1") == "http://a"  # equal load: home
    p.upstreams[0].in_flight = 1
    assert first(p, route, session="s1") == "http://b"  # a miss everywhere: the replica with less queued
    assert p.homes.get("s1").url == "http://b"


def test_cache_aware_keeps_a_round_home_even_where_another_replica_holds_more():
    p = pool("cache_aware", n=2)
    p.homes.settle("town", p.upstreams[0])
    p.cache.replace("http://b", CacheReport(block_size=16, device=list(BLOCKS)))
    route = Route(None, predicted=BLOCKS, prompt_tokens=len(BLOCKS) * 16)
    assert first(p, route, session="town", hold=True) == "http://a"
    assert first(p, route, session="town") == "http://b"


def test_the_pool_routes_learns_and_counts_work_through_the_policy():
    p = pool("cache_aware", n=2)
    view = {"model": "m", "messages": [{"role": "system", "content": "S" * 400}, {"role": "user", "content": "q"}]}
    route = p.route(view, "salt")
    assert route is not None and route.predicted == () and route.prompt_tokens > 100
    p.learn(route, "http://b", list(BLOCKS[:8]))
    later = p.route({**view, "messages": view["messages"] + [{"role": "user", "content": "more"}]}, "salt")
    assert later.predicted == BLOCKS[:8]
    assert first(p, later) == "http://b"
    assert p.expected_work(later, p.upstreams[1]) == max(later.prompt_tokens - 8 * 16, 0)
    assert p.expected_work(later, p.upstreams[0]) == later.prompt_tokens
    assert p.route(view, "another tenant").predicted == ()
    assert pool("session").route(view, None) is None  # the default policy reads no prompt


def test_cache_aware_does_not_gather_sessions_on_a_small_shared_hit():
    """Two sessions of one app share a short persona: following it would put every session
    of the app on one replica, whatever their size; they spread as `session` spreads them."""
    p = pool("cache_aware", n=2)
    p.cache.replace("http://a", CacheReport(block_size=16, device=list(BLOCKS[:2])))
    small = Route(None, predicted=BLOCKS, prompt_tokens=400)  # 32 of 400 tokens held on a
    assert first(p, small, session="s1") == "http://a"  # the least loaded, home to none
    assert first(p, small, session="s2") == "http://b"  # not gathered on a
    large = Route(None, predicted=BLOCKS[:2], prompt_tokens=40)  # 32 of 40 tokens held on a
    assert first(p, large, session="s3") == "http://a"
    assert p.homes.get("s3").url == "http://a"


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_min_hit_share_is_a_fraction(share):
    with pytest.raises(ValueError):
        RoutingSettings(min_hit_share=share)


def test_cache_aware_matches_replicas_without_reports_by_the_prompts_routed_there():
    """vLLM reports no blocks: the gateway remembers the prefix keys it sent each replica."""
    p = pool("cache_aware", n=2)
    system = {"role": "system", "content": "A long shared tool manual. " * 60}
    view = {"model": "m", "messages": [system, {"role": "user", "content": "first"}]}
    route = p.route(view, None)
    assert route.predicted == ()  # nothing reported anywhere
    chosen = p.candidates("m", "s1", False, route)[0]
    p.routed(route, chosen)
    other = p.route({**view, "messages": [system, {"role": "user", "content": "second"}]}, None)
    assert p.cache.hits(chosen.url, other.keys, other.predicted) >= 0.9 * other.prompt_tokens
    assert p.candidates("m", "s2", False, other)[0] is chosen  # a new session, where its prefix went
    assert p.cache.hits(chosen.url, other.keys[1:], ()) == 0  # a prefix never routed there: no hit


def test_cache_aware_does_not_follow_a_hit_onto_an_overloaded_replica():
    """A prefix every session of an app shares (long instructions) would pull them all onto
    the replica that computed it first; past the load guard, the prompt goes elsewhere."""
    p = pool("cache_aware", n=2)
    p.cache.replace("http://a", CacheReport(block_size=16, device=list(BLOCKS)))
    route = Route(None, predicted=BLOCKS, prompt_tokens=len(BLOCKS) * 16 + 10)
    a, b = p.upstreams
    a.in_flight, b.in_flight = 4, 1  # 4 > 2.0 x 1: overloaded
    assert first(p, route, session="new") == "http://b"
    b.in_flight = 2  # 4 is not above 2.0 x 2
    assert first(p, route, session="newer") == "http://a"


def _opted_in_view(answer: str, document: str, agent: str = "reviewer") -> tuple[dict, list[Segment]]:
    """A board's agent: its own persona, then a document and an earlier agent's answer."""
    system = f"You are the {agent}. " * 4
    user = document + answer
    view = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    segments = [Segment(message_index=1, char_start=0, char_end=len(document), kind="shared_block",
                        content_hash="d" * 64, method="kvcomm"),
                Segment(message_index=1, char_start=len(document), char_end=len(user), kind="placeholder",
                        name="answer", content_hash="a" * 64, source_request="agent1", method="kvcomm")]
    return view, segments


def test_cache_aware_sends_an_opted_in_request_where_the_texts_it_places_were_computed():
    """No prefix of the prompt is held anywhere (the persona is the agent's own), but the
    document and the answer it quotes were computed on b: placing them there saves what
    computing them again on a would cost, though a is idle."""
    p = pool("cache_aware", n=2)
    view, segments = _opted_in_view("The answer. " * 40, "A long shared document. " * 120)
    writer, _ = _opted_in_view("Notes. ", "A long shared document. " * 120, agent="writer")
    p.routed(p.route(writer, None, segments[:1], "agent1"), p.upstreams[1])  # agent 1 read it on b, answered there
    later = p.route(view, None, segments, "agent2")
    assert later.kept_request == "agent2" and len(later.placed) == 2
    p.upstreams[1].in_flight = 1
    assert first(p, later, session="s") == "http://b"
    exact = p.route(view, None, [s.model_copy(update={"method": None}) for s in segments], "agent3")
    assert exact.placed == () and exact.kept_request is None  # nothing is placed, nothing kept
    assert first(p, exact, session="s2") == "http://a"  # so the least loaded
    held = p.segment_weight * sum(t.tokens for t in later.placed)
    assert p.expected_work(later, p.upstreams[1]) == max(later.prompt_tokens - int(held), 0)


def test_cache_aware_weighs_placed_texts_against_the_queue_like_cached_blocks():
    p = pool("cache_aware", n=2)
    view, segments = _opted_in_view("The answer. " * 40, "A long shared document. " * 120)
    writer, _ = _opted_in_view("Notes. ", "A long shared document. " * 120, agent="writer")
    p.routed(p.route(writer, None, segments[:1], "agent1"), p.upstreams[1])
    later = p.route(view, None, segments, "agent2")
    saved = p.segment_weight * sum(t.tokens for t in later.placed)
    b = p.upstreams[1]
    b.in_flight, b.in_flight_tokens = 1, int(saved) - 8 - 2  # its queue costs less than placing saves
    assert first(p, later) == "http://b"
    b.in_flight_tokens = int(saved) + 2
    assert first(p, later) == "http://a"
    ignoring = pool("cache_aware", n=2, segment_weight=0.0)  # placed texts worth nothing: the least loaded
    ignoring.routed(ignoring.route(writer, None, segments[:1], "agent1"), ignoring.upstreams[1])
    ignoring.upstreams[1].in_flight = 1
    assert first(ignoring, ignoring.route(view, None, segments, "agent2")) == "http://a"


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_segment_weight_is_a_fraction(weight):
    with pytest.raises(ValueError):
        RoutingSettings(segment_weight=weight)
