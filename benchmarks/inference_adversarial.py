"""The adversarial run of `kvrelay bench inference`: planning cost with a huge app and
hostile prompts, and what it does to the gateway's event loop.

One app holds 10,000 agents (learned through the planner from their system prompts;
`max_agents` is raised to hold them all, so agent matching works on all 10,000 rather
than on the default 1,000 kept) and a step graph of 1,000 of them: a ring with chords,
a third of its agents AND joins, taught directly as the planner would from traffic.
Each measured request is a 64k-character prompt of adversarial text (one repeated
character, a short repeated pattern, repeated words, endless words with no space, random
words, or a session's 8k-character question wrapped in padding) from a graph agent, a
known agent or a new one (which each start the question search of their session), in one
of a few sessions. Planning is measured as the gateway does it (identify, plan, attach
the plan, serialise it), and the answer is observed afterwards as the gateway does.

Event-loop lag: the same requests are planned on a real asyncio loop, back to back as a
saturated gateway would, while a ticker task sleeps 1 ms at a time and records how late
it wakes. The lag is how long planning kept every other request of every tenant waiting:
a timer that falls due during one plan waits for it and, by asyncio's order (the timer
wakes its task one loop iteration later, behind the next request already queued), often
for the next plan too, so it reads up to about two plans.

Python's full garbage collections are reported apart: this state is some 250,000
objects, and a full collection walks them all (tens of milliseconds) whatever the
planner does, about once per 25% growth of the long-lived heap. The measurement starts
from a collected heap, and the run reports how many full collections fell inside it and
the longest.
"""

from __future__ import annotations

import asyncio
import gc
import random
import string
import time
from collections import Counter
from typing import Any, NamedTuple

from kvrelay.wire.plan import attach_plan
from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import InferenceSettings

NUM_AGENTS, GRAPH_NODES, PROMPT_CHARS, QUESTION_CHARS = 10_000, 1_000, 64_000, 8_000
_NUM_SESSIONS = 4
_TICK_S = 0.001
_APP = "adversary"
_WORDS = ("plan", "step", "value", "check", "the", "of", "and", "answer", "review", "fix")


class AdversarialRun(NamedTuple):
    infer_ms: list[float]
    loop_lag_ms: list[float]
    bounded: dict[str, int]  # what the bounds cut during the measurement, by kind
    graph_edges: int
    agents: int
    full_gc_ms: list[float]  # each full garbage collection during the measurement


def _pattern(kind: int, chars: int, rng: random.Random) -> str:
    if kind == 0:
        return "a" * chars
    if kind == 1:
        return ("ab" * (chars // 2 + 1))[:chars]
    if kind == 2:
        return ("abc abd " * (chars // 8 + 1))[:chars]
    if kind == 3:
        return "".join(rng.choices(string.ascii_lowercase, k=chars))  # one endless word
    words = rng.choices(_WORDS, k=chars // 4)
    return " ".join(words)[:chars]


def _system(i: int) -> str:
    return (f"You are agent {i} of the adversary's team; agent {i} answers only for itself. "
            + "Follow the shared rules of the team carefully and report every step. " * 10)


def _headers(session: str) -> dict[str, str]:
    return {"x-kvrelay-session-id": session, "x-kvrelay-app": _APP}


def _body(system: str, user: str) -> dict[str, Any]:
    return {"model": "bench", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def _plan(inference: Inference, body: dict[str, Any], session: str, request_id: str) -> tuple[float, str]:
    """Plan one request as the gateway does; (milliseconds, agent id)."""
    start = time.perf_counter()
    result = inference.plan(identify(_headers(session), body), body, request_id, "bench")
    attach_plan(body, result.plan)
    result.plan.model_dump_json()
    return (time.perf_counter() - start) * 1e3, result.agent_id


def _setup(inference: Inference, rng: random.Random) -> tuple[list[str], list[str]]:
    """The app's 10,000 agents (each learned from two prompts, so its prefix is fixed),
    its 1,000-node step graph, and the sessions' questions; (systems, graph agents)."""
    systems = [_system(i) for i in range(NUM_AGENTS)]
    agent_ids = []
    for i, system in enumerate(systems):
        for n in range(2):
            _, agent_id = _plan(inference, _body(system, f"warm-up request {n} of agent {i}"), f"warm-{i}", f"w{i}-{n}")
        agent_ids.append(agent_id)
    graph = inference.app(_APP).graph
    nodes = agent_ids[:GRAPH_NODES]
    for i, agent in enumerate(nodes):
        sources = {nodes[i - 1]}
        if i % 3 == 0:
            sources.add(nodes[(i - 2 - rng.randrange(40)) % GRAPH_NODES])
        graph.observe(agent, sources, sources, None)  # fresh output of all: an AND join where two
    for s in range(_NUM_SESSIONS):
        question = _pattern(s, QUESTION_CHARS, rng)
        _plan(inference, _body(systems[s], question), f"adv-{s}", f"q{s}")
    return systems, nodes


def _requests(rng: random.Random, systems: list[str], count: int) -> list[tuple[dict[str, Any], str]]:
    out = []
    for n in range(count):
        pick = rng.random()
        if pick < 0.5:
            system = systems[rng.randrange(GRAPH_NODES)]
        elif pick < 0.9:
            system = systems[rng.randrange(GRAPH_NODES, NUM_AGENTS)]
        else:
            system = _system(NUM_AGENTS + n)  # an agent never seen
        session = n % _NUM_SESSIONS
        kind = rng.randrange(6)
        if kind == 5:  # the session's question, wrapped in this agent's template and padding
            question = _pattern(session, QUESTION_CHARS, random.Random(0))
            user = f"Agent {n} reviews the task: {question} Then: " + _pattern(4, PROMPT_CHARS - QUESTION_CHARS - 64, rng)
        else:
            user = _pattern(kind, PROMPT_CHARS, rng)
        out.append((_body(system, user), f"adv-{session}"))
    return out


async def _drive(inference: Inference, requests: list[tuple[dict[str, Any], str]]) -> tuple[list[float], list[float]]:
    """Plan every request on this loop, back to back, while a ticker measures the lag."""
    lags: list[float] = []
    running = True

    async def ticker() -> None:
        while running:
            start = time.perf_counter()
            await asyncio.sleep(_TICK_S)
            lags.append((time.perf_counter() - start - _TICK_S) * 1e3)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(_TICK_S)
    infer_ms = []
    for n, (body, session) in enumerate(requests):
        await asyncio.sleep(0)  # the next request: whatever else is ready runs first
        ms, agent_id = _plan(inference, body, session, f"adv-{n}")
        infer_ms.append(ms)
        await asyncio.sleep(0)
        inference.observe_response(_APP, session, agent_id, f"adv-{n}", f"Answer {n}: " + "the step is done. " * 30)
    running = False
    await task
    return infer_ms, lags


def run_adversarial(quick: bool) -> AdversarialRun:
    rng = random.Random(3)
    inference = Inference(InferenceSettings(max_agents=NUM_AGENTS))
    systems, _ = _setup(inference, rng)
    requests = _requests(rng, systems, 200 if quick else 1_000)
    gc.collect()
    before = Counter(inference.bounded)
    full_gc_ms: list[float] = []
    started: list[float] = []

    def time_full_collections(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                full_gc_ms.append((time.perf_counter() - started.pop()) * 1e3)

    gc.callbacks.append(time_full_collections)
    try:
        infer_ms, lags = asyncio.run(_drive(inference, requests))
    finally:
        gc.callbacks.remove(time_full_collections)
    app = inference.app(_APP)
    cut = dict(inference.bounded - before)
    return AdversarialRun(infer_ms, lags, cut, len(app.graph.edges()), len(app.agents), full_gc_ms)
