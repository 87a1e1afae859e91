"""UpstreamProber against a stand-in that answers as vLLM does: a probed request is scored
(dense answer, then the answer's positions teacher-forced without and with the plan), the
score reaches the guard, and nothing is scored for an engine that scores its own, for
the Responses API, while the upstream is busy, or when the upstream is not vLLM."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvrelay.gateway.upstream_probe import Probe, UpstreamProber
from kvrelay.wire.plan import PLAN_KEY
from kvrelay.wire.seal import SEAL_KEY, PlanSeal

PROMPT, ANSWER = [11, 12, 13], [7, 8, 9]


@dataclass
class Upstream:
    url: str
    in_flight: int = 0


class Pool:
    def __init__(self, url: str) -> None:
        self.upstreams = [Upstream(url)]


class Guard:
    def __init__(self) -> None:
        self.scores: list = []

    def record(self, score) -> None:
        self.scores.append(score)


def position(first: int, second: int, p_first: float) -> dict:
    return {str(first): {"logprob": math.log(p_first), "rank": 1},
            str(second): {"logprob": math.log(1 - p_first), "rank": 2}}


@pytest.fixture
async def vllm():
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"prompt_token_ids": PROMPT, "choices": [{"token_ids": ANSWER,
                                                                           "message": {"content": "x"}}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if "kv_transfer_params" in body:  # the plan: its second position picks another token
            answer = [position(7, 5, 0.9), position(5, 8, 0.6), position(9, 4, 0.8)]
        else:
            answer = [position(7, 5, 0.9), position(8, 5, 0.7), position(9, 4, 0.8)]
        return web.json_response({"choices": [{"prompt_logprobs": [None, {}, {}, *answer]}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), seen
    await server.close()


def probe(url: str, endpoint: str = "/v1/chat/completions") -> Probe:
    plan = {"session_id": "s", "agent_id": "a", "request_id": "r", "segments": [], "probe": True}
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": {PLAN_KEY: plan, "other": 1},
            "cache_salt": "tenant-t-salt"}
    return Probe(url, endpoint, body, "t", "app", "blend")


async def test_a_probe_on_an_upstream_without_scoring_is_scored_and_reaches_the_guard(vllm):
    url, seen = vllm
    guard, seal = Guard(), PlanSeal("s" * 32)
    async with aiohttp.ClientSession() as http:
        prober = UpstreamProber(http, Pool(url), guard, lambda _: False, seal=seal, num_tokens=3, top_k=2)
        assert prober.offer(probe(url))
        assert await prober.step() == 1
    score, = guard.scores
    assert (score.tenant, score.app, score.method, score.tokens) == ("t", "app", "blend", 3)
    one = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)  # the one position that differs
    assert score.top1 == pytest.approx(2 / 3) and score.kl == pytest.approx(one / 3)
    dense, forced, approx = seen
    assert "kvrelay" not in json.dumps(dense) and dense["kv_transfer_params"] == {"other": 1}
    assert dense["max_tokens"] == 3 and not dense["stream"] and "stream_options" not in dense
    assert forced["prompt"] == PROMPT + ANSWER and "kv_transfer_params" not in forced
    params = approx["kv_transfer_params"]
    assert params[PLAN_KEY]["probe"] is False and seal.check(params[PLAN_KEY], params[SEAL_KEY]).accepted
    # Every call in the tenant's cache: its text stays there, and the plan's placements are found.
    assert [call["cache_salt"] for call in seen] == ["tenant-t-salt"] * 3


async def test_nothing_is_scored_where_it_should_not_be(vllm):
    url, seen = vllm
    guard = Guard()
    async with aiohttp.ClientSession() as http:
        known = {url: False}
        prober = UpstreamProber(http, Pool(url), guard, known.get)
        assert not prober.offer(probe(url, "/v1/responses"))
        assert not UpstreamProber(http, Pool(url), guard, lambda _: True).offer(probe(url))  # scores its own
        assert not UpstreamProber(http, Pool(url), guard, lambda _: None).offer(probe(url))  # not known yet
        assert prober.offer(probe(url))
        prober.pool.upstreams[0].in_flight = 1
        assert await prober.step() == 0 and not seen  # busy: it waits
        prober.pool.upstreams[0].in_flight = 0
        assert await prober.step() == 1


async def test_an_upstream_that_is_not_vllm_fails_the_probe_not_the_loop():
    async def plain(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": "hi"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", plain)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    guard = Guard()
    try:
        async with aiohttp.ClientSession() as http:
            prober = UpstreamProber(http, Pool(url), guard, lambda _: False)
            prober.offer(probe(url))
            assert await prober.step() == 0 and prober.num_failed == 1 and not guard.scores
    finally:
        await server.close()
