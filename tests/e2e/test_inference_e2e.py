"""A plain OpenAI-client multi-agent loop through the gateway: the plans the upstream sees."""

from __future__ import annotations

import json

import openai
import pytest

from kvrelay.wire.plan import SegmentPlan, read_plan

TASK = "Write a Python function that returns the n-th Fibonacci number, with tests for n = 0, 1 and 10."
SYSTEMS = {
    "planner": "You are the Planner. Break the user's task into small numbered steps for the coder.",
    "coder": "You are the Coder. Implement the plan you are given in Python, in one code block.",
    "reviewer": "You are the Reviewer. Check the code against the plan and list any defects you find.",
}
ANSWERS = {
    "planner": "1. Define fib(n) iteratively with two running values.\n2. Handle n = 0 and n = 1.\n3. Add asserts.",
    "coder": "```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```",
    "reviewer": "The code follows the plan; fib(0) == 0, fib(1) == 1 and fib(10) == 55 all hold. No defects.",
}


def ask(client: openai.OpenAI, fake, agent: str, transcript: list[dict], **kw) -> tuple[str, SegmentPlan]:
    """One agent turn, AutoGen style: the whole transcript, other agents as named users."""
    fake.behaviour.pieces = [ANSWERS[agent]]
    messages = [{"role": "system", "content": SYSTEMS[agent]}]
    for turn in transcript:
        if turn["name"] == agent:
            messages.append({"role": "assistant", "content": turn["content"]})
        else:
            messages.append({"role": "user", "name": turn["name"], "content": turn["content"]})
    answer = client.chat.completions.create(model="fake", messages=messages, **kw).choices[0].message.content
    plan = read_plan(fake.received[-1].body)
    assert plan is not None
    return answer, plan


def placeholders(plan: SegmentPlan, body: dict) -> dict[str, str]:
    """placeholder name -> the text it covers."""
    messages = body["messages"]
    return {s.name: messages[s.message_index]["content"][s.char_start:s.char_end]
            for s in plan.segments if s.kind == "placeholder"}


def run_loop(gw, fake, app: str | None = None) -> list[tuple[SegmentPlan, dict]]:
    headers = {"x-kvrelay-app": app} if app else {}
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, default_headers=headers)
    transcript = [{"name": "user", "content": TASK}]
    seen = []
    for agent in ("planner", "coder", "reviewer", "planner"):
        answer, plan = ask(client, fake, agent, transcript)
        seen.append((plan, fake.received[-1].body))
        transcript.append({"name": agent, "content": answer})
    return seen


def test_a_plain_multi_agent_loop_gets_one_session_three_agents_and_named_placeholders(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    seen = run_loop(gw, fake)
    plans = [p for p, _ in seen]
    assert len({p.session_id for p in plans}) == 1  # no header: linked through the shared texts
    planner, coder, reviewer = plans[0].agent_id, plans[1].agent_id, plans[2].agent_id
    assert len({planner, coder, reviewer}) == 3 and plans[3].agent_id == planner

    assert placeholders(plans[0], seen[0][1]) == {"user_question": TASK}
    assert placeholders(plans[1], seen[1][1]) == {"user_question": TASK, f"agent_{planner}_current": ANSWERS["planner"]}
    assert placeholders(plans[2], seen[2][1]) == {"user_question": TASK, f"agent_{planner}_current": ANSWERS["planner"],
                                                  f"agent_{coder}_current": ANSWERS["coder"]}
    last = placeholders(plans[3], seen[3][1])
    assert last[f"agent_{reviewer}_current"] == ANSWERS["reviewer"] and last[f"agent_{planner}_current"] == ANSWERS["planner"]

    by_name = {s.name: s for s in plans[2].segments if s.kind == "placeholder"}
    assert by_name[f"agent_{planner}_current"].source_request == plans[0].request_id
    assert by_name[f"agent_{coder}_current"].source_request == plans[1].request_id
    rows = {r.id: r for r in gw.rows(4)}
    assert {rows[p.request_id].session_id for p in plans} == {plans[0].session_id}
    assert rows[plans[1].request_id].agent_id == coder


def test_segments_cover_every_message_and_hash_their_text(fake_upstream, start_gateway):
    import hashlib

    fake = fake_upstream()
    gw = start_gateway([fake.url])
    for plan, body in run_loop(gw, fake):
        for index, message in enumerate(body["messages"]):
            covered = [s for s in plan.segments if s.message_index == index]
            assert "".join(message["content"][s.char_start:s.char_end] for s in covered) == message["content"]
            for s in covered:
                assert s.content_hash == hashlib.sha256(message["content"][s.char_start:s.char_end].encode()).hexdigest()


def test_the_planners_fixed_prefix_is_learned_on_its_second_request(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    plans = [p for p, _ in run_loop(gw, fake)]
    assert all(s.kind != "fixed_prefix" for s in plans[0].segments)
    fixed = [s for s in plans[3].segments if s.kind == "fixed_prefix"]
    assert [(s.message_index, s.char_start, s.char_end, s.name) for s in fixed] == \
        [(0, 0, len(SYSTEMS["planner"]), plans[0].agent_id)]


def test_two_apps_with_the_same_agents_are_never_merged(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    client_a = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, default_headers={"x-kvrelay-app": "a"})
    client_b = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, default_headers={"x-kvrelay-app": "b"})
    transcript = [{"name": "user", "content": TASK}]
    _, plan_a = ask(client_a, fake, "planner", transcript)
    _, plan_b = ask(client_b, fake, "planner", transcript)
    answer_b = ANSWERS["planner"]
    _, coder_a = ask(client_a, fake, "coder", [*transcript, {"name": "planner", "content": answer_b}])
    assert plan_a.session_id != plan_b.session_id
    assert coder_a.session_id == plan_a.session_id
    source = {s.name: s.source_request for s in coder_a.segments if s.kind == "placeholder"}
    assert source[f"agent_{plan_a.agent_id}_current"] == plan_a.request_id  # app a's planner, not app b's


def test_explicit_session_header_wins_over_content_linking(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    transcript = [{"name": "user", "content": TASK}]
    _, first = ask(client, fake, "planner", transcript)
    _, second = ask(client, fake, "coder", [*transcript, {"name": "planner", "content": ANSWERS["planner"]}],
                    extra_headers={"x-session-id": "explicit-1"})
    assert second.session_id == "explicit-1" != first.session_id


def test_recurring_delimited_blocks_become_shared_segments(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    doc = "Retrieved document: the Fibonacci sequence starts 0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55."
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    plans = []
    for question in ("Which number follows 21 in the sequence above, exactly?",
                     "What is the tenth Fibonacci number according to the document?"):
        client.chat.completions.create(model="fake", messages=[
            {"role": "user", "content": f"{doc}<TTSEP>{question}"}])
        body = fake.received[-1].body
        plans.append((read_plan(body), body))
    for plan, body in plans:
        shared = [s for s in plan.segments if s.kind == "shared_block"]
        texts = [body["messages"][s.message_index]["content"][s.char_start:s.char_end] for s in shared]
        assert doc in texts
    hashes = [{s.content_hash for s in p.segments if s.kind == "shared_block"} for p, _ in plans]
    assert hashes[0] & hashes[1]  # the same document, the same content hash


def test_a_plan_merges_with_client_kv_transfer_params(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    with gw.client() as http:
        http.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": TASK}],
                                                "kv_transfer_params": {"do_remote_prefill": True}})
    params = fake.received[-1].body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["kvrelay"]["version"] == 1


def _all_gather(gw, fake, separator: str, num_agents: int = 3, num_rounds: int = 3) -> list[list[SegmentPlan]]:
    """Generative-Agents style: each round, every agent reads all outputs of the last round."""
    import random

    rng = random.Random(7)
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0)
    systems = [f"You are villager {i}, living in a small town; you talk with your neighbours each day." for i in
               range(num_agents)]
    outputs = [f"Villager {i} opens the day: I will walk to the market and buy bread, then water my garden."
               for i in range(num_agents)]
    rounds = []
    for r in range(num_rounds):
        plans, new_outputs = [], []
        for i in range(num_agents):
            shown = outputs[:]
            rng.shuffle(shown)
            fake.behaviour.pieces = [f"Round {r}, villager {i}: having heard everyone, I decide to visit the "
                                     f"library and then help neighbour {(i + 1) % num_agents} with the harvest."]
            content = "What your neighbours said:" + separator + separator.join(shown)
            messages = [{"role": "system", "content": systems[i]}, {"role": "user", "content": content}]
            if r == 0:
                messages[1]["content"] = f"Day starts. Your own plan: {outputs[i]}"
            new_outputs.append(client.chat.completions.create(model="fake", messages=messages,
                                                              extra_headers={"x-session-id": "town"})
                               .choices[0].message.content)
            plans.append(read_plan(fake.received[-1].body))
        outputs = new_outputs
        rounds.append(plans)
    return rounds


def test_all_gather_rounds_are_detected_with_size_and_index(fake_upstream, start_gateway):
    for separator in ("\n\n", "<TTSEP>"):
        fake = fake_upstream()
        gw = start_gateway([fake.url])
        rounds = _all_gather(gw, fake, separator)
        assert all(p.round is None for p in rounds[0])  # nobody read earlier outputs yet
        # Each reads the last round in its own shuffled order, a composed view: a round at once.
        assert [p.round.index for p in rounds[1]] == [0, 1, 2]
        assert [p.round.index for p in rounds[2]] == [0, 1, 2]
        ids = []
        for plans in rounds[1:]:
            members = [p for p in plans if p.round is not None]
            assert {p.round.size for p in members} == {3}
            assert len({p.round.id for p in members}) == 1
            ids.append(members[0].round.id)
        assert len(set(ids)) == 2


def test_all_requests_of_a_round_go_to_the_same_upstream_even_under_load(fake_upstream, start_gateway):
    fakes = [fake_upstream(), fake_upstream()]
    gw = start_gateway([f.url for f in fakes])
    home = gw.pool.upstreams[0]
    home.in_flight = 50  # looks overloaded: a plain session request would move off it
    try:
        gw.pool.homes.settle("town", home)  # make it the session's home
        assert gw.pool.candidates("fake", "town", hold=True)[0] is home
        assert gw.pool.candidates("fake", "town")[0] is not home
    finally:
        home.in_flight = 0


class _Pair:
    """Two fake upstreams seen as one by `_all_gather`: the same answers from both, and
    `received` is the one that got the latest request."""

    def __init__(self, fakes, after_first_round) -> None:
        self.fakes = fakes
        self.behaviour = self
        self._seen = [0, 0]
        self._after_first_round = after_first_round

    @property
    def pieces(self):
        return self.fakes[0].behaviour.pieces

    @pieces.setter
    def pieces(self, value) -> None:
        for fake in self.fakes:
            fake.behaviour.pieces = value

    @property
    def received(self):
        grew = next(i for i, f in enumerate(self.fakes) if len(f.received) > self._seen[i])
        self._seen[grew] = len(self.fakes[grew].received)
        if sum(self._seen) == 3:  # the first round (no round yet: nobody has read anybody) is done
            self._after_first_round()
        return self.fakes[grew].received


@pytest.mark.parametrize("opted_in", [True, False])
def test_only_an_approximate_round_is_held_on_an_overloaded_home(fake_upstream, start_gateway, opted_in):
    """Placed answers and collective prefill share KV only on the round's replica, so an
    opted-in round stays there past the load guard; an exact round shares nothing beyond
    prefix hits, and goes where the load guard sends it."""
    fakes = [fake_upstream(), fake_upstream()]
    rules = {"rules": [{"method": "blend"}]} if opted_in else {}
    gw = start_gateway([f.url for f in fakes], approximation=rules)
    home, other = gw.pool.upstreams
    gw.pool.homes.settle("town", home)

    def overload() -> None:
        home.in_flight = 50  # from the second day on, the town's home looks overloaded

    try:
        _all_gather(gw, _Pair(fakes, overload), "<TTSEP>")
    finally:
        home.in_flight = 0
    rows = gw.rows(9)
    plans = [json.loads(r.plan) for r in rows]
    assert [bool(p.get("round")) for p in plans] == [False] * 3 + [True] * 6
    assert {r.upstream for r in rows[:3]} == {home.url}
    assert {r.upstream for r in rows[3:]} == ({home.url} if opted_in else {other.url})


def test_the_step_graph_of_a_sequential_loop(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    plans = [p for p, _ in run_loop(gw, fake)]
    planner, coder, reviewer = (plans[i].agent_id for i in range(3))
    assert plans[1].workflow.steps_to_execution[coder] == 0
    assert plans[1].workflow.next == []  # nothing has read the coder yet: no successor known
    # at the planner's second request the loop is known: the coder reads the planner (1 step),
    # the reviewer waits for both (AND: max(0, 1) + 1)
    assert plans[3].workflow.steps_to_execution == {planner: 0, coder: 1, reviewer: 2}
    assert plans[3].workflow.next == [coder]
    graph = gw.state.inference.app("default").graph
    assert graph.aggregation(reviewer) == "and" and graph.aggregation(coder) == "or"
    assert (planner, coder, "dataflow") in graph.edges() and (coder, reviewer, "dataflow") in graph.edges()
    assert (reviewer, planner, "dataflow") in graph.edges()
    steps = graph.steps_to_execution(coder)
    assert steps[reviewer] == 1 and steps[planner] >= 1


def test_all_gather_agents_learn_and_aggregation(fake_upstream, start_gateway):
    fake = fake_upstream()
    gw = start_gateway([fake.url])
    rounds = _all_gather(gw, fake, "\n\n")
    graph = gw.state.inference.app("default").graph
    agents = [p.agent_id for p in rounds[0]]
    assert len(set(agents)) == 3
    # every villager read the fresh outputs of all the others before each of its runs
    assert all(graph.aggregation(a) == "and" for a in agents)
    assert "flowchart LR" in graph.mermaid() and all(a in graph.mermaid() for a in agents)


def test_with_a_round_hold_the_requests_of_a_round_leave_together(fake_upstream, start_gateway):
    from concurrent.futures import ThreadPoolExecutor

    fake = fake_upstream(pieces=["Villager answer: the market first, then the library, then the harvest."])
    gw = start_gateway([fake.url], inference={"round_hold_ms": 20})
    client = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0,
                           default_headers={"x-session-id": "town"})
    outputs = [f"Villager {i} opens the day: I will walk to the market and buy bread, then water my garden."
               for i in range(3)]
    for i, text in enumerate(outputs):  # round 0: each villager's own plan becomes its output
        fake.behaviour.pieces = [text]
        client.chat.completions.create(model="fake", messages=[
            {"role": "system", "content": f"You are villager {i}, living in a small town by the river."},
            {"role": "user", "content": "Day starts. What is your plan?"}])

    def member(i: int) -> None:
        client.chat.completions.create(model="fake", messages=[
            {"role": "system", "content": f"You are villager {i}, living in a small town by the river."},
            {"role": "user", "content": "What your neighbours said:\n\n" + "\n\n".join(outputs)}])

    for i in range(3):  # one by one, each with its own answer: this first round shows the app runs rounds
        fake.behaviour.pieces = [f"Villager {i} heard everyone: the market first, then the library, then the harvest."]
        member(i)
    outputs = [f"Villager {i}, second day: the bakery is closed, so I help at the mill and then fish by the bridge."
               for i in range(3)]
    for i, text in enumerate(outputs):
        fake.behaviour.pieces = [text]
        client.chat.completions.create(model="fake", messages=[
            {"role": "system", "content": f"You are villager {i}, living in a small town by the river."},
            {"role": "user", "content": "A new day starts. What is your plan?"}])
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(member, range(3)))
    assert gw.state.round_hold is not None and gw.state.round_hold.num_released_together == 2
