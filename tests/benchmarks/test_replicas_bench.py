"""The replicas bench's parts: the upstream that answers captured prompts with their
captured answers, and the drops computed from the cells."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from benchmarks import BENCHMARKS
from benchmarks.agents.scoring import InferenceScores
from benchmarks.agents.workload import load_all
from benchmarks.capture_upstream import build_app
from benchmarks.replicas import Bench, Cell


def _stream(client: TestClient, messages: list) -> tuple[str, list, str]:
    text = client.post("/v1/chat/completions", json={"model": "captured", "messages": messages, "stream": True}).text
    content, calls, finish = "", [], None
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                calls += choice["delta"].get("tool_calls") or []
                finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_the_upstream_answers_each_captured_prompt_with_its_captured_answer():
    workloads = load_all(names=["autogen_tool"])
    client = TestClient(build_app(workloads))
    request = next(r for w in workloads for r in w.requests if r.response.get("tool_calls"))
    content, calls, finish = _stream(client, request.body["messages"])
    assert [c["id"] for c in calls] == [c["id"] for c in request.response["tool_calls"]] and finish == "tool_calls"
    plain = next(r for w in workloads for r in w.requests if r.response.get("content"))
    assert _stream(client, plain.body["messages"])[0] == plain.response["content"]
    assert client.get("/stats").json() == {"answered": 2, "unknown": 0}
    assert _stream(client, [{"role": "user", "content": "not captured"}])[0]
    assert client.get("/stats").json()["unknown"] == 1


def _cell(replicas: int, shared: bool, f1: float, placed: float, p99: float | None = None, repeat: int = 0) -> Cell:
    scores = InferenceScores(1.0, 1.0, f1, 0.99, 1.0, 1.0, 0.9, 0.9, None, 10)
    return Cell("short", "sqlite", replicas, shared, scores, placed, 0, 0, p99, p99, 1.0, repeat)


def test_drops_are_one_replica_minus_the_worst_of_several(tmp_path):
    bench = Bench(quick=True, log_dir=tmp_path)
    bench.cells = [_cell(1, True, 0.80, 1000), _cell(2, True, 0.78, 990, 5.0), _cell(3, True, 0.70, 900, 9.0),
                   _cell(3, False, 0.50, 700)]
    metrics = bench.result().metrics
    assert abs(metrics["placeholder_f1_drop_max"] - 0.10) < 1e-9
    assert abs(metrics["reuse_drop_max"] - 0.10) < 1e-9
    assert metrics["session_rand_drop_max"] == 0.0 and metrics["staleness_p99_ms"] == 9.0
    assert BENCHMARKS["replicas"] == "benchmarks.replicas"


def test_repeated_runs_are_averaged_before_the_drop_and_their_range_reported(tmp_path):
    bench = Bench(quick=True, log_dir=tmp_path)
    bench.cells = [_cell(1, True, 0.80, 1000), _cell(2, True, 0.70, 1000, 5.0), _cell(3, True, 0.78, 1000, 7.0),
                   _cell(3, False, 0.50, 700),
                   _cell(1, True, 0.70, 1000, repeat=1), _cell(2, True, 0.80, 1000, 6.0, repeat=1),
                   _cell(3, True, 0.70, 1000, 9.0, repeat=1), _cell(3, False, 0.52, 700, repeat=1)]
    result = bench.result()
    # Single runs would give 0.80 - 0.70 = 0.10; the means are 0.75 (one), 0.75 (two) and 0.74 (three).
    assert abs(result.metrics["placeholder_f1_drop_max"] - 0.01) < 1e-9
    assert abs(result.metrics["short_sqlite_1_placeholder_f1_range"] - 0.10) < 1e-9
    assert abs(result.metrics["short_sqlite_3_alone_placeholder_f1"] - 0.51) < 1e-9
    assert result.metrics["staleness_p99_ms"] == 9.0 and result.config["repeats"] == 2
    shown = dict((row[0], row[1]) for row in result.rows)
    assert shown["short, sqlite, 1 shared: placeholder F1 / session Rand / next agent / placed tokens, mean of 2"] \
        == "0.750 (±0.050) / 0.990 (±0.000) / 0.900 (±0.000) / 1000 (±0)"
