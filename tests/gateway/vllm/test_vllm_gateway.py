"""The official openai client -> gateway -> two real vLLM replicas: answers and streams,
usage and cached-token accounting from vLLM's responses, session affinity across the
replicas, and failover when a replica dies. Runs last in file order: the failover test
kills a replica."""

from __future__ import annotations

import itertools
import json
import threading

import openai
import pytest

from tests.gateway.vllm.conftest import MODEL, VLLM_BLOCK, VLLM_TIMEOUTS

# ~430 tokens: vLLM's CPU backend caches whole 128-token blocks.
SYSTEM = "You are a careful travel planner. Answer in one short sentence. " * 32
CONCURRENT_TOKENS = 64
GEN = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def gw(vllm_replicas, start_gateway):
    """vLLM on one core takes seconds for a batch of long answers, and may answer a
    health check late meanwhile: the suite's 5 s first-byte and 1 s health timeouts
    would cut the answers and take the replica out of the pool."""
    return start_gateway([r.url for r in vllm_replicas], timeouts=VLLM_TIMEOUTS)


def _client(gw, session: str | None = None, reuse: str | None = None) -> openai.OpenAI:
    headers = {"x-kvrelay-session-id": session} if session else {}
    if reuse is not None:
        headers["x-kvrelay-reuse"] = reuse
    return openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=120, default_headers=headers)


def _ask(client: openai.OpenAI, question: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        **GEN, **kw)


def test_unary_and_streamed_answers_agree_and_are_recorded(gw):
    with _client(gw) as client:
        unary = _ask(client, "Where should I go in May?")
        chunks = list(_ask(client, "Where should I go in May?", stream=True, stream_options={"include_usage": True}))
    text = unary.choices[0].message.content
    assert text and unary.usage.completion_tokens == GEN["max_tokens"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens
    rows = gw.rows(2)
    assert [(r.status, r.stream, r.completion_tokens) for r in rows] == [("ok", False, 8), ("ok", True, 8)]
    assert all(r.upstream in {u.url for u in gw.pool.upstreams} for r in rows)


def test_vllm_s_cached_tokens_reach_the_client_and_the_record(gw):
    with _client(gw, "cache-session") as client:
        _ask(client, "First question?")
        second = _ask(client, "Second question?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert VLLM_BLOCK <= cached < second.usage.prompt_tokens and cached % VLLM_BLOCK == 0  # the system prompt
    assert gw.rows(2)[1].cached_tokens == cached


def test_sessions_stay_on_their_replica_and_spread_across_both(gw):
    """Two sessions start at once, so the second lands on the idle replica; every later
    request of a session goes where its first did."""
    answers: dict[str, list] = {"a": [], "b": []}

    def run(session: str) -> None:
        with _client(gw, session) as client:
            for turn in range(3):
                answers[session].append(_ask(client, f"Turn {turn} of {session}?", stream=True))
                list(answers[session][-1])

    _all_at_once(run, list(answers))
    rows = gw.rows(6)
    homes = {s: {r.upstream for r in rows if r.session_id == s} for s in answers}
    assert all(len(home) == 1 for home in homes.values()), homes
    assert homes["a"] != homes["b"]


def _villager(client: openai.OpenAI, k: int, content: str, max_tokens: int = 8, long: bool = False):
    """`long`: decode CONCURRENT_TOKENS tokens whatever the model says."""
    system = f"You are villager {k} of a small town. Reply with one sentence about your plans."
    extra = {"max_tokens": CONCURRENT_TOKENS, "extra_body": {"ignore_eos": True}} if long else {"max_tokens": max_tokens}
    return client.chat.completions.create(model=MODEL, temperature=0, **extra,
                                          messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": content}])


def _all_at_once(fn, args: list) -> None:
    threads = [threading.Thread(target=fn, args=(a,)) for a in args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)


def _peak_overlap(rows) -> int:
    """The most of these requests the gateway had open at one moment."""
    edges = sorted([(r.started_at, 1) for r in rows] + [(r.finished_at, -1) for r in rows])
    return max(itertools.accumulate(step for _, step in edges))


def test_an_opted_in_all_gather_round_stays_on_its_session_s_replica(gw):
    """Six agents speak, then read all six outputs: one first, alone, then five at once. Four requests in flight on the
    session's replica (none on the other) is enough for the load guard to move a plain
    request away (the control session shows it), but the requests of a round opted into
    placement (`blend`) share their KV only on one replica, so the gateway holds them all
    there (an exact round shares nothing but prefix hits, and is routed like any request:
    tests/e2e/test_inference_e2e.py). The concurrent requests
    decode CONCURRENT_TOKENS each, so they overlap even on a slow, busy machine (with 8
    they could finish one by one and never load the replica)."""
    plans = ["buy bread", "repair the mill", "paint the fence", "sell wool", "visit the smith", "fish"]
    with _client(gw, "town", reuse="blend") as client:
        outputs = [_villager(client, k, f"Day starts. Your plan: {plan}.", max_tokens=32).choices[0].message.content
                   for k, plan in enumerate(plans)]
        heard = "\n\n".join(outputs)
        _villager(client, 0, f"What your neighbours said:\n\n{heard}\n\nWhat next?")
        _all_at_once(lambda k: _villager(client, k, f"What your neighbours said:\n\n{heard}\n\nWhat next?",
                                         long=True), list(range(1, 6)))
    with _client(gw, "crowd") as client:
        _villager(client, 0, "Good morning.")
        _all_at_once(lambda k: _villager(client, k, f"Question {k}: what is on the market today?", long=True),
                     list(range(6)))
    rows = gw.rows(19)
    town, crowd = rows[:12], rows[12:]
    home = town[0].upstream
    readers = town[7:]
    assert _peak_overlap(readers) >= 4 and _peak_overlap(crowd[1:]) >= 5  # the load was there
    plans = [json.loads(r.plan) for r in readers]
    assert all(p["round"] is not None for p in plans), [  # short enough that pytest prints it whole
        (p["agent_id"][-4:], p["round"], sum(s["kind"] == "placeholder" for s in p["segments"]), r.status)
        for p, r in zip(plans, readers)]
    assert {r.upstream for r in town} == {home}
    assert len({r.upstream for r in crowd}) == 2  # without a round, the guard spreads the load


def test_a_killed_replica_fails_over_to_the_other(gw, vllm_replicas):
    with _client(gw, "failover") as client:
        _ask(client, "Before the failure?")
        home = gw.rows(1)[0].upstream
        next(r for r in vllm_replicas if r.url == home).kill()
        after = _ask(client, "After the failure?")
    assert after.choices[0].message.content
    rows = gw.rows(2)
    assert rows[1].status == "ok" and rows[1].upstream != home
