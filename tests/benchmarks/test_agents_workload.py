"""The agents bench's pieces without a model: rendering a captured prompt with this
replay's answers, the order a run's requests are sent in, and the inference scores."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.agents.scoring import Record, observed_from, rand_index, score
from benchmarks.agents.workload import Quote, load, render

ANSWER_A = "The plan is to buy bread and milk."
ANSWER_B = "I will repair the mill today."
TASK = "Plan the village day."


def _capture(tmp_path: Path) -> Path:
    """Two agents answer in parallel, then a reader quotes both answers and the task."""
    header = {"workload": "town", "framework": "plain", "description": "d",
              "runs": {"r1": {"task": TASK, "concurrent_group": None}}}
    reader = f"Task: {TASK}\n\nA said: {ANSWER_A}\nB said: {ANSWER_B}  \nWhat next?"
    a_at, b_at = reader.index(ANSWER_A), reader.index(ANSWER_B)
    records = [
        _record(0, "a", 0.0, 1.0, [{"role": "user", "content": TASK}], ANSWER_A),
        _record(1, "b", 0.1, 1.2, [{"role": "user", "content": TASK}], ANSWER_B + "  "),
        _record(2, "reader", 1.5, 2.0, [{"role": "system", "content": "You read."}, {"role": "user", "content": reader}],
                "Let us meet.", quotes=[
                    {"message": 1, "part": None, "start": 6, "end": 6 + len(TASK), "kind": "question", "sources": []},
                    {"message": 1, "part": None, "start": a_at, "end": a_at + len(ANSWER_A), "kind": "output",
                     "sources": [0], "form": "exact"},
                    {"message": 1, "part": None, "start": b_at, "end": b_at + len(ANSWER_B) + 2, "kind": "output",
                     "sources": [1], "form": "exact"}]),
    ]
    path = tmp_path / "town.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [header, *records]) + "\n")
    return path


def _record(seq, agent, t0, t1, messages, answer, quotes=()):
    return {"seq": seq, "app": "town", "run": "r1", "agent": agent, "round": None, "t_start": t0, "t_end": t1,
            "path": "/v1/chat/completions", "headers": {"user-agent": "test"}, "dropped": ["parallel_tool_calls"],
            "body": {"model": "x", "messages": messages, "max_tokens": 16, "parallel_tool_calls": False},
            "response": {"content": answer, "tool_calls": None, "finish_reason": "stop", "scripted": False},
            "quotes": list(quotes)}


def test_render_puts_this_replay_s_answers_where_the_capture_quoted_them(tmp_path):
    workload = load(_capture(tmp_path))
    reader = workload.requests[2]
    body, quotes = render(reader, {("town", 0): "Short.", ("town", 1): "Much longer answer from B.\n"})
    text = body["messages"][1]["content"]
    assert text == f"Task: {TASK}\n\nA said: Short.\nB said: Much longer answer from B.\n\nWhat next?"
    assert [text[q.start:q.end] for q in quotes] == [TASK, "Short.", "Much longer answer from B.\n"]
    assert "parallel_tool_calls" not in body  # the recording engine refused it
    assert reader.body["messages"][1]["content"] != text  # the capture itself is untouched


def test_render_without_answers_reproduces_the_capture(tmp_path):
    reader = load(_capture(tmp_path)).requests[2]
    body, quotes = render(reader, {})
    assert body["messages"] == reader.body["messages"]
    assert [(q.start, q.end) for q in quotes] == [(q.start, q.end) for q in reader.quotes]


def test_a_request_waits_only_for_what_had_ended_before_it_was_sent(tmp_path):
    (run,) = load(_capture(tmp_path)).runs
    a, b, reader = run.requests
    assert run.waits_for(a) == [] and run.waits_for(b) == []  # sent together
    assert run.waits_for(reader) == [a, b]


def test_rand_index_counts_agreeing_pairs():
    assert rand_index(["x", "x", "y"], [1, 1, 2]) == 1.0
    assert rand_index(["x", "x", "y"], [1, 2, 3]) == 2 / 3  # one same-session pair split
    assert rand_index(["x", "x", "y", "y"], [1, 1, 1, 1]) == 2 / 6  # everything merged


def test_scores_read_the_gateway_s_records_against_the_labels(tmp_path):
    from benchmarks.agents.replay import Outcome

    workload = load(_capture(tmp_path))
    outcomes = {}
    for request in workload.requests:
        body, quotes = render(request, {})
        outcomes[request.key] = Outcome(request.key, body, tuple(quotes), "x", 200, None, f"req-{request.seq}",
                                        10, 0, 2, 0.1, 0.2, 0.0, 0.2)
    quotes = workload.requests[2].quotes
    segments = [{"kind": "placeholder", "message_index": 1, "char_start": q.start, "char_end": q.end,
                 "name": "user_question" if q.kind == "question" else "agent_a_current",
                 "source_request": f"req-{q.sources[0]}" if q.sources else None} for q in quotes]
    segments[2]["source_request"] = "req-0"  # B's answer attributed to A: a wrong placeholder
    records = {
        "req-0": Record("s1", "a", {"segments": [], "workflow": {"next": ["b"]}}),
        "req-1": Record("s1", "b", {"segments": [], "workflow": {"next": ["reader"]}}),
        "req-2": Record("s2", "reader", {"segments": segments}),
    }
    scores = score([workload], observed_from(outcomes, records))
    assert (scores.placeholder_precision, scores.placeholder_recall) == (2 / 3, 2 / 3)
    assert scores.session_rand == 1 / 3  # the reader split from its session
    assert scores.agent_rand == 1.0
    # a and b ran together: the reader ran next after each, and only b's plan named it
    assert scores.next_agent_acc == 0.5
    assert scores.round_acc == 1.0 and scores.scored == 3


def test_quotes_at_new_offsets_keep_their_kind_and_source(tmp_path):
    reader = load(_capture(tmp_path)).requests[2]
    _, quotes = render(reader, {("town", 0): "A."})
    assert [(q.kind, q.sources) for q in quotes] == [("question", ()), ("output", (0,)), ("output", (1,))]
    assert all(isinstance(q, Quote) for q in quotes)


def test_replay_renders_live_keeps_the_app_s_order_and_times_the_stream(tmp_path):
    """Against a fake streaming engine that answers each request with its agent's name:
    the reader goes out only after both writers answered, and quotes their live answers."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from benchmarks.agents.replay import Replay
    from tests.gateway.support import LoopbackServer

    seen: list[dict] = []

    async def chat(request):
        body = await request.json()
        seen.append(body)
        answer = f"live answer number {len(seen)} of this replay"

        async def events():
            await asyncio.sleep(0.05)
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": answer}}]}) + "\n\n"
            usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"x-kvrelay-request-id": f"req-{len(seen)}"})

    server = LoopbackServer(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]))
    try:
        (run,) = load(_capture(tmp_path)).runs
        outcomes = Replay(server.url, "m", [run], concurrency=1).run()
    finally:
        server.stop()
    reader = outcomes[("town", 2)]
    first_two = {outcomes[("town", 0)].text, outcomes[("town", 1)].text}
    assert first_two == {"live answer number 1 of this replay", "live answer number 2 of this replay"}
    text = reader.body["messages"][1]["content"]
    assert all(answer in text for answer in first_two)  # sent after both, with their live answers
    assert {text[q.start:q.end] for q in reader.quotes if q.kind == "output"} == first_two
    assert seen[2]["stream"] is True and seen[2]["temperature"] == 0.0 and seen[2]["model"] == "m"
    assert (reader.prompt_tokens, reader.cached_tokens, reader.completion_tokens) == (10, 4, 3)
    assert reader.request_id == "req-3" and reader.ok
    assert 0.04 < reader.ttft_s <= reader.latency_s
