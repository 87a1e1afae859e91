"""Cache-aware routing end to end: gateway -> two embedded engines (tiny random Llama).

Each engine reports the blocks it holds (GET /v1/kvrelay/cache) and each prompt's blocks
(in its response); the gateway polls the one and learns from the other. A second
session whose prompt starts like the first one's goes where those blocks are and hits
them, where session affinity alone sends it to the idle replica to compute them again.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvrelay.wire.cache_report import BLOCKS_HEADER, BLOCKS_KEY, CACHE_PATH, CacheReport
from tests.gateway.support import wait_until
from tests.helpers import make_engine

MODEL = "tiny-llama"
SYSTEM = "You are one reviewer of a long shared document. " * 12


@pytest.fixture(scope="module")
def replicas(llama_dir, run_server):
    with run_server(make_engine(llama_dir, num_blocks=128, name=MODEL), MODEL) as a, \
            run_server(make_engine(llama_dir, num_blocks=128, name=MODEL), MODEL) as b:
        yield a, b


def _ask(http, session: str, question: str) -> dict:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    response = http.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert response.status_code == 200, response.text
    return response.json()


def _reset(replicas) -> None:
    for srv in replicas:
        srv.llm.kv.pool.reset_cache()


def _reported(gw, urls) -> bool:
    return all(len(gw.pool.cache.replica(u)) > 0 for u in urls)


@pytest.mark.parametrize("policy", ["cache_aware", "session"])
def test_a_second_session_goes_where_its_prefix_is_only_under_cache_aware_routing(replicas, start_gateway,
                                                                                  policy):
    _reset(replicas)
    urls = [srv.base_url for srv in replicas]
    gw = start_gateway(urls, routing={"policy": policy, "cache_poll_interval_s": 0.05})
    with gw.client(timeout=60) as http:
        first = _ask(http, "s1", "Is the first section sound?")
        assert BLOCKS_KEY not in (first.get("kv_transfer_params") or {})  # the client never sees them
        home = gw.rows(1)[-1].upstream
        if policy == "cache_aware":
            assert wait_until(lambda: _reported(gw, [home]), timeout=10)
        second = _ask(http, "s2", "And the second one?")
        there = gw.rows(2)[-1].upstream
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    if policy == "cache_aware":
        assert there == home and cached >= 96, (there, home, cached)
    else:
        assert there != home and cached == 0  # a new session goes to the idle replica


def test_work_in_flight_is_counted_until_the_first_token_and_released(fake_upstream, start_gateway):
    """The load cache_aware weighs: a stream's prompt tokens count on its replica until its
    first token, its slot until its end; nothing is left counted afterwards.

    The upstream is a fake that waits between its events, so each phase lasts long
    enough to be seen whatever the machine's speed (a real engine can finish a short
    stream before the client reads its first line)."""
    fake = fake_upstream(first_byte_delay=0.3, first_content_delay=0.3, chunk_delay=0.3)
    gw = start_gateway([fake.url], routing={"policy": "cache_aware"})
    upstream = gw.pool.upstreams[0]
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.append((upstream.in_flight, upstream.in_flight_tokens))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with gw.client(timeout=60) as http:
            body = {"model": "fake", "stream": True, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count."}]}
            with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "w"}) as response:
                assert response.status_code == 200
                assert any(line == "data: [DONE]" for line in response.iter_lines())
    finally:
        done.set()
        sampler.join()
    assert any(slots == 1 and tokens > 0 for slots, tokens in seen)  # before the first token
    assert (1, 0) in seen  # in flight while it streams, its prompt done from the first token on
    assert (upstream.in_flight, upstream.in_flight_tokens) == (0, 0)


def test_an_engine_reports_the_blocks_it_holds_and_each_prompts_blocks(replicas, start_gateway):
    srv = replicas[0]
    _reset(replicas)
    import httpx

    with httpx.Client(base_url=srv.base_url, timeout=60) as http:
        assert CacheReport.read(http.get(CACHE_PATH).json()).device == []
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": SYSTEM}]}
        answer = http.post("/v1/chat/completions", json=body, headers={BLOCKS_HEADER: "1"}).json()
        blocks = answer["kv_transfer_params"][BLOCKS_KEY]
        assert len(blocks) == answer["usage"]["prompt_tokens"] // 16
        report = CacheReport.read(http.get(CACHE_PATH).json())
        assert report.block_size == 16 and set(blocks) <= set(report.device)
        for headers in ({}, {"x-kvrelay-ttft": "1"}, {BLOCKS_HEADER: "0"}):  # only the header asks for them
            plain = http.post("/v1/chat/completions", json=body, headers=headers).json()
            assert BLOCKS_KEY not in (plain.get("kv_transfer_params") or {}), headers


def test_an_upstream_without_reports_is_routed_by_what_the_gateway_sent_it(replicas, fake_upstream,
                                                                            start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url, replicas[0].base_url], routing={"policy": "cache_aware",
                                                                 "cache_poll_interval_s": 0.05})
    with gw.client(timeout=60) as http:
        for i in range(3):
            response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": f"hello {i}"}]}, headers={"x-session-id": f"s{i}"})
            assert response.status_code == 200, response.text
        assert http.get("/ready").status_code == 200  # the poll loop is alive, 404s and all



@pytest.mark.parametrize("policy", ["cache_aware", "session"])
def test_the_gateway_asks_for_prompt_blocks_only_under_cache_aware_routing(fake_upstream, start_gateway, policy):
    fake = fake_upstream()
    gw = start_gateway([fake.url], routing={"policy": policy})
    with gw.client(timeout=60) as http:
        assert http.post("/v1/chat/completions", json={"model": "fake", "messages": [
            {"role": "user", "content": "hello"}]}).status_code == 200
    assert fake.received[-1].path == "/v1/chat/completions"
    assert fake.received[-1].headers.get(BLOCKS_HEADER) == ("1" if policy == "cache_aware" else None)


AGENTS = ("You are the writer. Answer the question at length.",
          "You are the critic. Say what the writer got wrong.",
          "You are the judge. Decide between the writer and the critic.")
QUESTION = "Which of the two proposals in the attached report should the board fund, and why? " * 6


def _board(http, session: str, before_judge) -> list[dict]:
    """Three agents in turn, each reading the question and the answers before its own."""
    answers: list[str] = []
    out = []
    for i, system in enumerate(AGENTS):
        if i == 2:
            before_judge()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
        messages += [{"role": "user", "content": text} for text in answers]
        body = {"model": MODEL, "max_tokens": 32, "temperature": 0, "messages": messages}
        response = http.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
        assert response.status_code == 200, response.text
        out.append(response.json())
        answers.append(out[-1]["choices"][0]["message"]["content"])
    return out


@pytest.mark.parametrize("segment_weight", [0.9, 0.0])
def test_an_opted_in_agent_goes_where_the_answers_it_places_were_computed(replicas, start_gateway, segment_weight):
    """Opted into KVCOMM, the judge places the writer's and the critic's answers, whose KV
    lives only on the replica that served them. With that replica busier than the other,
    cache_aware still sends the judge there (its persona is its own: no prefix hit says
    so); weighing placed texts at 0, it goes to the idle replica and computes them again."""
    _reset(replicas)
    urls = [srv.base_url for srv in replicas]
    gw = start_gateway(urls, routing={"policy": "cache_aware", "cache_poll_interval_s": 0.05,
                                      "segment_weight": segment_weight},
                       approximation={"rules": [{"method": "kvcomm"}]})
    busy: list = []

    def occupy_home() -> None:  # a request of another app queued on the board's replica
        home = next(u for u in gw.pool.upstreams if u.url == gw.rows(2)[-1].upstream)
        home.in_flight += 1
        busy.append(home)

    try:
        with gw.client(timeout=120) as http:
            judge = _board(http, "board", occupy_home)[2]
    finally:
        for upstream in busy:
            upstream.in_flight -= 1
    rows = gw.rows(3)
    assert rows[0].upstream == rows[1].upstream  # the critic went home (tie), reading the writer's answer
    plan = json.loads(rows[2].plan)
    placed = [s for s in plan["segments"] if s["kind"] == "placeholder" and s["method"] == "kvcomm"]
    assert placed, plan  # the judge's plan places the two answers
    segments = judge["kv_transfer_params"]["kvrelay_reuse"]["segments"]
    reused = sum(s["tokens_reused"] for s in segments if s["method"] == "kvcomm")  # placed, not prefix hits
    if segment_weight:
        assert rows[2].upstream == rows[0].upstream and reused > 0, (rows[2].upstream, segments)
    else:
        assert rows[2].upstream != rows[0].upstream and reused == 0, (rows[2].upstream, segments)
