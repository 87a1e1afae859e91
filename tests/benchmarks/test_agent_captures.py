"""The committed agent-framework captures (tests/data/agents/, the long family's in
tests/data/agents/long/) and the recorder that made them.

The captures are data the agents benchmark replays and scores against: their schema,
order and labels are checked here, and the labels are recomputed from the raw capture.
The recorder is exercised in-process against a tiny stdlib upstream, so none of this
needs a model (or the frameworks' venv).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from openai import BadRequestError, NotFoundError, OpenAI

AGENTS_DIR = Path(__file__).resolve().parents[1] / "data" / "agents"
CAPTURE_DIR = AGENTS_DIR / "capture"
APPS = ["autogen_roundrobin", "autogen_selector", "autogen_tool", "langgraph_pipeline", "langgraph_react",
        "openai_agents", "kvcomm_team", "village_sep", "village_plain"]
LONG_APPS = ["board_autogen", "board_openai", "village_long"]  # tests/data/agents/long
BOARDS = ["board_autogen", "board_openai"]
LONG_MAX_TOKENS = 128
HEADER_KEYS = {"workload", "framework", "description", "model", "runs"}
RECORD_KEYS = {"seq", "app", "run", "agent", "round", "t_start", "t_end", "path", "headers", "body", "dropped",
               "response", "quotes"}
RESPONSE_KEYS = {"content", "tool_calls", "finish_reason", "scripted"}
QUOTE_KEYS = {"message", "part", "start", "end", "kind", "sources", "form"}


def _load(name: str) -> ModuleType:
    """A capture script as a module (the capture directory is no package)."""
    spec = importlib.util.spec_from_file_location(f"agent_capture_{name}", CAPTURE_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


label = _load("label")
recorder = _load("recorder")


def _capture(app: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    directory = AGENTS_DIR / "long" if app in LONG_APPS else AGENTS_DIR
    return label.read_capture(directory / f"{app}.jsonl")


def _text(record: dict[str, Any], message: int, part: int | None) -> str:
    content = record["body"]["messages"][message]["content"]
    return content if part is None else content[part]["text"]


def _form(text: str, form: str) -> str:
    return text if form == "exact" else text.strip()


# ---------------------------------------------------------------------------------------
# The committed captures
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("app", APPS + LONG_APPS)
def test_capture_schema_and_order(app: str) -> None:
    header, records = _capture(app)
    assert set(header) == HEADER_KEYS and header["workload"] == app
    assert header["model"] == "SmolLM2-135M-Instruct"
    package, _, version = header["framework"].partition("==")
    assert package and version
    assert records and [r["seq"] for r in records] == list(range(len(records)))
    for record in records:
        assert set(record) == RECORD_KEYS, record["seq"]
        assert record["app"] == app and record["run"] in header["runs"]
        assert record["round"] is None or isinstance(record["round"], str)
        assert record["path"] == "/v1/chat/completions"
        assert 0 <= record["t_start"] <= record["t_end"]
        assert "authorization" not in record["headers"] and "host" not in record["headers"]
        assert isinstance(record["body"]["messages"], list) and record["body"]["messages"]
        assert all(field in record["body"] for field in record["dropped"])
        response = record["response"]
        assert set(response) == RESPONSE_KEYS
        assert isinstance(response["finish_reason"], str)
        if response["scripted"]:
            assert response["tool_calls"] and response["finish_reason"] == "tool_calls"
        else:
            assert isinstance(response["content"], str)
        for quote in record["quotes"]:
            assert set(quote) == QUOTE_KEYS
            assert quote["kind"] in ("output", "question", "tool_result") and quote["form"] in ("exact", "strip")
            assert all(source < record["seq"] for source in quote["sources"])


@pytest.mark.parametrize("app", APPS)
def test_capture_runs_cover_repeats_and_concurrency(app: str) -> None:
    header, records = _capture(app)
    runs = header["runs"]
    assert len(runs) >= 4
    assert {r["run"] for r in records} == set(runs), "every registered run sent requests"
    tasks = [info["task"] for info in runs.values()]
    assert len(set(tasks)) >= 3 and len(set(tasks)) < len(tasks), "three tasks and a repeated one"
    groups = [info["concurrent_group"] for info in runs.values() if info["concurrent_group"] is not None]
    assert any(groups.count(g) >= 2 for g in groups), "a pair of runs ran concurrently"
    # The concurrent runs really overlapped in time.
    for group in set(groups):
        members = [run for run, info in runs.items() if info["concurrent_group"] == group]
        spans = [(min(r["t_start"] for r in records if r["run"] == m),
                  max(r["t_end"] for r in records if r["run"] == m)) for m in members]
        assert max(start for start, _ in spans) < min(end for _, end in spans), group


@pytest.mark.parametrize("app", APPS + LONG_APPS)
def test_capture_quotes_are_the_texts_they_name(app: str) -> None:
    header, records = _capture(app)
    by_seq = {r["seq"]: r for r in records}
    for record in records:
        for quote in record["quotes"]:
            span = _text(record, quote["message"], quote["part"])[quote["start"]:quote["end"]]
            assert span, quote
            if quote["kind"] == "question":
                assert quote["sources"] == []
                assert span == _form(header["runs"][record["run"]]["task"], quote["form"])
            elif quote["kind"] == "output":
                assert quote["sources"]
                for source in quote["sources"]:
                    earlier = by_seq[source]
                    assert earlier["run"] == record["run"] and earlier["t_end"] <= record["t_start"]
                    assert span == _form(earlier["response"]["content"], quote["form"])
            else:
                assert quote["sources"]
                for source in quote["sources"]:
                    call_ids = {c["id"] for c in by_seq[source]["response"]["tool_calls"] or []}
                    carried = [label.tool_text(m) for r in records
                               if r["seq"] <= record["seq"] and r["run"] == record["run"]
                               for m in r["body"]["messages"] if m.get("tool_call_id") in call_ids]
                    assert span in {_form(text, quote["form"]) for text in carried}, quote


@pytest.mark.parametrize("app", APPS + LONG_APPS)
def test_capture_labels_regenerate(app: str) -> None:
    header, records = _capture(app)
    committed = [r["quotes"] for r in records]
    stripped = [{**r, "quotes": []} for r in records]
    quotes, notes = label.label_capture(header, stripped)
    assert quotes == committed
    assert notes.unresolved_tool_ids == []


def _systems(app: str) -> set[str]:
    return {m["content"] for r in _capture(app)[1] for m in r["body"]["messages"] if m["role"] == "system"}


def test_captures_share_a_system_prompt_across_apps() -> None:
    assert _systems("village_sep") & _systems("village_plain")
    assert len(_systems("board_autogen") & _systems("board_openai")) == 5  # the same five personas


def test_the_short_family_is_the_top_level_directory() -> None:
    """`load_all()` of the short family globs tests/data/agents/*.jsonl: the long family
    must stay out of it."""
    assert sorted(p.stem for p in AGENTS_DIR.glob("*.jsonl")) == sorted(APPS)
    assert sorted(p.stem for p in (AGENTS_DIR / "long").glob("*.jsonl")) == sorted(LONG_APPS)


@pytest.mark.parametrize("app", LONG_APPS)
def test_long_capture_runs_are_sequential_distinct_long_tasks(app: str) -> None:
    """Six or more runs, each a fresh session with its own task, one after another; every
    task is a long text (a 3,000-4,200 character passage, or ~2,300 characters of town
    notes) and every answer was allowed 128 tokens."""
    header, records = _capture(app)
    runs = header["runs"]
    assert len(runs) >= 6 and {r["run"] for r in records} == set(runs)
    tasks = [info["task"] for info in runs.values()]
    assert len(set(tasks)) == len(tasks) and all(len(task) >= 2000 for task in tasks)
    assert all(info["concurrent_group"] is None for info in runs.values())
    spans = sorted((min(r["t_start"] for r in records if r["run"] == run),
                    max(r["t_end"] for r in records if r["run"] == run)) for run in runs)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), "runs overlapped"
    assert all(r["body"].get("max_tokens") == LONG_MAX_TOKENS for r in records)


@pytest.mark.parametrize("app", BOARDS)
def test_board_agent_k_reads_the_passage_and_the_answers_before_it(app: str) -> None:
    """Five agents, one turn each, on a 3,000-4,200 character passage; agent k's prompt
    quotes the task (the passage and its question) once and reads every answer of agents
    1..k-1 (a quote of its own unless it is nested in a longer one, label rule 4)."""
    header, records = _capture(app)
    passages = set()
    for run, info in header["runs"].items():
        passage = info["task"].split("\n\n", 1)[1].split("\n\nQuestion: ")[0]
        assert 3000 <= len(passage) <= 4200
        passages.add(len(passage))
        mine = [r for r in records if r["run"] == run]
        assert len(mine) == 5 and len({r["agent"] for r in mine}) == 5
        for k, record in enumerate(mine):
            assert [q["kind"] for q in record["quotes"]].count("question") == 1
            text = "\n".join(m["content"] for m in record["body"]["messages"] if isinstance(m["content"], str))
            answers = [r["response"]["content"].strip() for r in mine[:k] if r["response"]["content"].strip()]
            assert all(answer in text for answer in answers), (run, k)
            assert not answers or any(q["kind"] == "output" for q in record["quotes"]), (run, k)
    assert len(passages) == len(header["runs"]), "every passage has a length of its own"


# ---------------------------------------------------------------------------------------
# The labeller's rules
# ---------------------------------------------------------------------------------------

def _record(seq: int, messages: list[dict[str, Any]], content: str | None = None, t: float = 0.0,
            tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"seq": seq, "run": "r1", "t_start": t, "t_end": t + 0.5, "body": {"messages": messages},
            "response": {"content": content, "tool_calls": tool_calls}, "quotes": []}


def test_label_rules_short_strip_longest_and_duplicates() -> None:
    header = {"runs": {"r1": {"task": "Plan the picnic for Saturday."}}}
    answer = "  Bring sandwiches and lemonade.\n"
    records = [
        _record(0, [{"role": "user", "content": "Plan the picnic for Saturday."}], answer, t=0),
        _record(1, [{"role": "user", "content": "x"}], answer, t=1),
        _record(2, [{"role": "user", "content": "ok"}], "ok", t=2),
        _record(3, [{"role": "user", "content": "Notes: Bring sandwiches and lemonade. ok"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [{"type": "text", "text": answer}]}], "done", t=3),
    ]
    quotes, _ = label.label_capture(header, records)
    assert quotes[0] == [{"message": 0, "part": None, "start": 0, "end": 29, "kind": "question", "sources": [],
                          "form": "exact"}]
    assert quotes[3] == [
        {"message": 0, "part": None, "start": 7, "end": 37, "kind": "output", "sources": [0, 1], "form": "strip"},
        {"message": 1, "part": None, "start": 0, "end": 2, "kind": "output", "sources": [2], "form": "exact"},
        {"message": 2, "part": 0, "start": 0, "end": len(answer), "kind": "output", "sources": [0, 1],
         "form": "exact"},
    ]


def test_label_tool_results_and_priority() -> None:
    header = {"runs": {"r1": {"task": "How many mugs are left?"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "count", "arguments": "{}"}}
    result = "There are 214 blue mugs left in the store room."
    records = [
        _record(0, [{"role": "user", "content": "How many mugs are left?"}], None, t=0, tool_calls=[call]),
        _record(1, [{"role": "user", "content": "How many mugs are left?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": result}], result, t=1),
        _record(2, [{"role": "user", "content": f"Earlier: {result}"}], "fine", t=2),
    ]
    quotes, notes = label.label_capture(header, records)
    assert {"message": 2, "part": None, "start": 0, "end": len(result), "kind": "tool_result", "sources": [0],
            "form": "exact"} in quotes[1]
    # The answer copied the tool result: the tool result (its origin) wins the span.
    assert quotes[2] == [{"message": 0, "part": None, "start": 9, "end": 9 + len(result), "kind": "tool_result",
                          "sources": [0], "form": "exact"}]
    assert len(notes.same_span_other_kind) == 1


# ---------------------------------------------------------------------------------------
# The recorder, in-process, against a fake upstream
# ---------------------------------------------------------------------------------------

class FakeUpstream(BaseHTTPRequestHandler):
    """An engine stand-in: answers every chat with a fixed text, refuses `logprobs` and
    `logit_bias` as the engine does (400 naming the field), and keeps what it was sent."""
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, dict[str, Any]]] = []
    ANSWER = "Paris is the capital of France, and it is lovely."

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return  # quiet: the test reads what it needs from `seen`

    def _send(self, status: int, obj: dict[str, Any]) -> None:
        payload = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append((self.path, body))
        for field in ("logprobs", "logit_bias"):
            if body.get(field):
                self._send(400, {"error": {"message": "unsupported", "type": "invalid_request_error",
                                           "param": field, "code": None}})
                return
        self._send(200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": self.ANSWER},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18}})


@pytest.fixture
def rec(tmp_path: Path) -> Iterator[Any]:
    FakeUpstream.seen = []
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), FakeUpstream)
    # A short poll interval: shutdown() waits for the next poll.
    threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    server = recorder.make_server(f"http://127.0.0.1:{upstream.server_address[1]}")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
    upstream.shutdown()
    upstream.server_close()


def _client(server: Any, agent: str = "a1", round_: str = "-") -> OpenAI:
    return OpenAI(base_url=f"{server.url}/tag/app1/r1/{agent}/{round_}/v1", api_key="secret", max_retries=0)


def _post(server: Any, path: str, data: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(server.url + path, data=json.dumps(data).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _save(server: Any, path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    _post(server, "/_save", {"workload": "app1", "framework": "openai==0", "description": "d",
                             "model": "m", "path": str(path)})
    return label.read_capture(path)


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_recorder_strips_the_tag_and_records(rec: Any, tmp_path: Path) -> None:
    _post(rec, "/_run", {"app": "app1", "run": "r1", "task": "capital", "concurrent_group": None})
    reply = _client(rec, round_="2").chat.completions.create(model="m", messages=MESSAGES, temperature=0,
                                                             max_tokens=5)
    assert reply.choices[0].message.content == FakeUpstream.ANSWER
    assert _client(rec).models.list().data[0].id == "m"
    path, forwarded = FakeUpstream.seen[0]
    assert path == "/v1/chat/completions" and forwarded["stream"] is False
    header, records = _save(rec, tmp_path / "c.jsonl")
    assert header["runs"] == {"r1": {"task": "capital", "concurrent_group": None}}
    [record] = records
    assert (record["app"], record["run"], record["agent"], record["round"]) == ("app1", "r1", "a1", "2")
    assert record["body"] == {"messages": MESSAGES, "model": "m", "max_tokens": 5, "temperature": 0}
    assert "authorization" not in record["headers"] and record["headers"]["content-type"] == "application/json"
    assert record["response"] == {"content": FakeUpstream.ANSWER, "tool_calls": None, "finish_reason": "stop",
                                  "scripted": False}
    assert record["dropped"] == [] and record["t_start"] <= record["t_end"]


def test_recorder_scripts_tool_calls(rec: Any, tmp_path: Path) -> None:
    _post(rec, "/_script", {"app": "app1", "run": "r1", "agent": "a1",
                            "steps": [{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}},
                                                      {"name": "now", "arguments": {}}]}, None]})
    client = _client(rec)
    first = client.chat.completions.create(model="m", messages=MESSAGES)
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_r1_a1_0_0", "add", {"a": 1, "b": 2}), ("call_r1_a1_0_1", "now", {})]
    assert FakeUpstream.seen == []  # a scripted answer never reaches the model
    second = client.chat.completions.create(model="m", messages=MESSAGES)
    assert second.choices[0].message.content == FakeUpstream.ANSWER
    _, records = _save(rec, tmp_path / "c.jsonl")
    assert [r["response"]["scripted"] for r in records] == [True, False]
    assert records[0]["response"]["tool_calls"][1]["function"] == {"name": "now", "arguments": "{}"}


def test_recorder_synthesises_sse(rec: Any, tmp_path: Path) -> None:
    _post(rec, "/_script", {"app": "app1", "run": "r1", "agent": "tools",
                            "steps": [{"tool_calls": [{"name": "add", "arguments": {"a": 1}}]}]})
    chunks = list(_client(rec).chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == FakeUpstream.ANSWER
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11
    forwarded = FakeUpstream.seen[0][1]
    assert forwarded["stream"] is False and "stream_options" not in forwarded

    tool_chunks = list(_client(rec, agent="tools").chat.completions.create(model="m", messages=MESSAGES, stream=True))
    deltas = [tc for c in tool_chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == "call_r1_tools_0_0" and deltas[0].function.name == "add"
    assert "".join(d.function.arguments or "" for d in deltas) == '{"a": 1}'
    assert tool_chunks[-1].choices[0].finish_reason == "tool_calls"
    _, records = _save(rec, tmp_path / "c.jsonl")
    assert records[0]["body"]["stream"] is True and records[0]["body"]["stream_options"] == {"include_usage": True}


def test_recorder_drops_only_what_the_upstream_refuses(rec: Any, tmp_path: Path) -> None:
    reply = _client(rec).chat.completions.create(model="m", messages=MESSAGES, logprobs=True,
                                                 logit_bias={"42": 1.0}, parallel_tool_calls=False, tools=[
                                                     {"type": "function", "function": {"name": "f",
                                                                                       "parameters": {}}}])
    assert reply.choices[0].message.content == FakeUpstream.ANSWER
    final = FakeUpstream.seen[-1][1]
    assert "logprobs" not in final and "logit_bias" not in final and final["parallel_tool_calls"] is False
    _, [record] = _save(rec, tmp_path / "c.jsonl")
    assert sorted(record["dropped"]) == ["logit_bias", "logprobs"]
    assert record["body"]["logprobs"] is True and record["body"]["logit_bias"] == {"42": 1.0}


def test_recorder_refuses_untagged_paths_and_failed_captures(rec: Any, tmp_path: Path) -> None:
    bad = OpenAI(base_url=f"{rec.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(NotFoundError, match="tag path"):
        bad.chat.completions.create(model="m", messages=MESSAGES)
    _post(rec, "/_script", {"app": "app1", "run": "r1", "agent": "a1", "steps": [{"tool_calls": []}]})
    with pytest.raises(BadRequestError, match="tool_calls"):
        _client(rec).chat.completions.create(model="m", messages=MESSAGES)
    with pytest.raises(urllib.error.HTTPError, match="409"):
        _save(rec, tmp_path / "c.jsonl")
    assert not (tmp_path / "c.jsonl").exists()
