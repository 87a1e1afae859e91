"""`kvrelay bench cluster`'s plumbing on the tiny model: two one-core engines behind the
gateway, every routing policy on the same prompts, real processes. Exact routing never
changes an answer, and every metric the bench promises is written."""

from __future__ import annotations

import json
import sqlite3

import pytest

import benchmarks.cluster as bench_cluster
from benchmarks import run_benchmark


@pytest.mark.slow
def test_cluster_bench_routes_the_same_prompts_by_every_policy(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_cluster, "QUICK_RUNS", {"kvcomm_team": 2})
    monkeypatch.setattr(bench_cluster, "QUICK_MAX_TOKENS", 4)
    monkeypatch.setattr(bench_cluster, "REPLAYS", 1)
    out = tmp_path / "cluster.json"

    result = run_benchmark("cluster", quick=True, json_path=out, model=str(llama_dir))

    payload = json.loads(out.read_text())
    assert payload["name"] == "cluster" and payload["metrics"] == result.metrics
    metrics = result.metrics
    assert payload["config"]["levels"] == [2] and payload["config"]["requests"] == 20
    for policy in bench_cluster.POLICIES:
        assert metrics[f"errors_{policy}_2"] == 0, policy
        assert metrics[f"greedy_match_{policy}_2"] == 1.0, policy  # the same prompts, the same answers
    for name in ("hit_rate_ratio_vs_best", "ttft_p50_ratio_vs_best", "ttft_p50_ratio_vs_session"):
        assert metrics[name] == metrics[f"{name}_2"] and metrics[name] > 0
    assert metrics["greedy_match_min"] == 1.0
    assert metrics["hit_rate_cache_aware_2"] > 0  # a session's agents find their earlier turns' blocks
    # The simulator: fitted to the render replay, checked against each policy, then at scale.
    assert payload["config"]["sim_costs"]["prefill_s_per_token"] > 0 and metrics["sim_cost_factor"] > 0
    for replicas in (2, *bench_cluster.SIM_REPLICAS):
        for policy in bench_cluster.POLICIES:
            assert metrics[f"sim_ttft_p50_ms_{policy}_{replicas}"] > 0, (policy, replicas)
            assert 0 <= metrics[f"sim_hit_rate_{policy}_{replicas}"] < 1, (policy, replicas)
    errors = [abs(metrics[f"sim_ttft_p50_ms_{p}_2"] - metrics[f"ttft_p50_ms_{p}_2"]) / metrics[f"ttft_p50_ms_{p}_2"]
              for p in bench_cluster.POLICIES]
    assert metrics["sim_vs_real_error"] == pytest.approx(max(errors))
    assert metrics["sim_ttft_p50_ratio_vs_least_loaded_64"] == pytest.approx(
        metrics["sim_ttft_p50_ms_least_loaded_64"] / metrics["sim_ttft_p50_ms_cache_aware_64"])


def test_the_long_family_opts_in_and_replays_every_policy_live(tmp_path, monkeypatch, llama_dir):
    """The long captures, opted into KVCOMM: no prompt is rendered once for all (each
    policy quotes its own answers), and no greedy match is scored. Engines are replaced
    by a recorder: the captures' prompts are longer than the tiny model's context."""
    from contextlib import contextmanager

    from benchmarks.agents.bench import Cell
    from benchmarks.agents.replay import Outcome

    clusters: list[str] = []
    replays: list[tuple[str, object]] = []

    @contextmanager
    def cluster(self, policy, kv_tokens):
        clusters.append(policy)
        yield policy

    def replay(self, url, level, prompts):
        replays.append((url, prompts))
        cached = {"cache_aware": 0.6, "session": 0.5}.get(url, 0.2)
        outcomes = {r.key: Outcome(r.key, r.body, (), "x", 200, None, None, 1000, int(1000 * cached), 4,
                                   0.5 if url == "cache_aware" else 1.0, 1.0, 0.0, 1.0)
                    for run in self.runs for r in run.requests}
        return Cell(outcomes)

    simulated: list[int] = []
    monkeypatch.setattr(bench_cluster.ClusterBench, "_cluster", cluster)
    monkeypatch.setattr(bench_cluster.ClusterBench, "_replay", replay)
    monkeypatch.setattr(bench_cluster.ClusterBench, "_trace", lambda self, rendered: [])
    monkeypatch.setattr(bench_cluster.ClusterBench, "_simulate", lambda self, level: simulated.append(level))
    monkeypatch.setattr(bench_cluster, "REPLAYS", 1)
    result = bench_cluster.run(quick=True, model=str(llama_dir), family="long")

    assert result.config["family"] == "long" and result.config["method"] == "kvcomm"
    assert result.config["sessions"] == 4 and result.config["requests"] == 20  # two runs of each board
    assert clusters == [bench_cluster.RENDER, *bench_cluster.POLICIES]
    assert all(prompts is None for _, prompts in replays)  # live: each policy quotes its own answers
    metrics = result.metrics
    assert metrics["hit_rate_ratio_vs_best"] == pytest.approx(0.6 / 0.2)
    assert metrics["ttft_p50_ratio_vs_best"] == pytest.approx(2.0)
    assert metrics["ttft_p50_ratio_vs_session"] == pytest.approx(2.0)
    assert not any(k.startswith("greedy_match") for k in metrics)
    assert simulated == [4]  # the simulator runs on the level's trace (tests/benchmarks/test_cluster_sim.py)
    with pytest.raises(ValueError, match="no family 'tiny'"):
        bench_cluster.run(quick=True, model=str(llama_dir), family="tiny")


def test_the_long_family_gateway_is_opted_in_by_a_rule():
    bench = bench_cluster.ClusterBench.__new__(bench_cluster.ClusterBench)
    bench.long = True
    assert json.loads(bench._gateway_env("cache_aware", "s")["KVRELAY_APPROXIMATION__RULES"]) == [
        {"method": "kvcomm"}]
    bench.long = False
    assert "KVRELAY_APPROXIMATION__RULES" not in bench._gateway_env("cache_aware", "s")


def test_the_simulator_reads_the_texts_each_request_places_from_the_recorded_plans(tmp_path, smollm2_dir):
    """The render replay's gateway recorded each request's plan: its placeholder and shared
    texts become the simulated request's placed texts, at their token positions, with the
    request whose answer each one is; exact segments and the request's own text do not."""
    from benchmarks.agents.replay import Outcome
    from engine_ext.tokenizer import Tokenizer
    from kvrelay.wire.plan import Segment, SegmentPlan

    passage, answer = "The passage every agent reads. " * 20, "The writer's answer."
    messages = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": passage + answer}]

    def segment(kind, start, end, method="kvcomm", source=None):
        return Segment(message_index=1, char_start=start, char_end=end, kind=kind, content_hash=("a" if kind == "shared_block" else "b") * 64,
                       name="n" if kind == "placeholder" else None, source_request=source, method=method)

    plan = SegmentPlan(session_id="s", agent_id="critic", request_id="req-2", segments=[
        segment("shared_block", 0, len(passage)), segment("placeholder", len(passage), len(passage + answer),
                                                           source="req-1")])
    exact = plan.model_copy(update={"request_id": "req-3",
                                    "segments": [s.model_copy(update={"method": None}) for s in plan.segments]})
    with sqlite3.connect(tmp_path / f"{bench_cluster.RENDER}.sqlite") as db:
        db.execute("CREATE TABLE requests (id TEXT, plan TEXT)")
        db.executemany("INSERT INTO requests VALUES (?, ?)", [(p.request_id, p.model_dump_json()) for p in (plan, exact)])
    bench = bench_cluster.ClusterBench.__new__(bench_cluster.ClusterBench)
    bench.log_dir = tmp_path
    tokenizer = Tokenizer(smollm2_dir)
    placed_of = bench._placed_of(tokenizer)

    def outcome(request_id):
        return Outcome(("w", 0), {"messages": messages}, (), "", 200, None, request_id, 0, 0, 1, 0.1, 0.1, 0.0, 0.1)

    texts = placed_of(outcome("req-2"), {"req-1": 0, "req-2": 1})
    head = len(tokenizer.encode(tokenizer.render_chat(messages[:1], add_generation_prompt=False)))
    assert [(t.key[0], t.source, t.anchored) for t in texts] == [("a", None, False), ("b", 0, True)]
    assert texts[0].tokens == len(tokenizer.encode(passage)) and texts[1].tokens == len(tokenizer.encode(answer))
    assert head < texts[0].start < head + 8  # after the system message, at the user turn's start
    assert texts[0].start + texts[0].tokens - 2 <= texts[1].start <= texts[0].start + texts[0].tokens + 8
    assert placed_of(outcome("req-3"), {}) == ()  # exact: nothing placed
    assert placed_of(outcome("req-unknown"), {}) == ()


def test_the_vllm_cluster_needs_the_vllm_venv(tmp_path, monkeypatch):
    import benchmarks.cluster_vllm as bench_cluster_vllm

    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    monkeypatch.setenv("KVRELAY_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(ValueError, match="make vllm-venv"):
        bench_cluster_vllm.run(quick=True)


def test_the_vllm_cluster_starts_a_replica_per_core_that_holds_the_longest_request(tmp_path, monkeypatch, llama_dir):
    """Each replica: its own core and port, the level's budget raised to the longest
    request (vLLM refuses a prompt its cache cannot hold), killed with the stack; the
    gateway sends vLLM no plans and still routes by the policy."""
    from contextlib import ExitStack

    import benchmarks.cluster_vllm as bench_cluster_vllm

    started: list[object] = []

    class Server:
        def __init__(self, python, model_dir, port, log_path, **options):
            self.port, self.options, self.killed = port, options, False
            self.url = f"http://127.0.0.1:{port}"

        def start(self):
            started.append(self)

        def wait_ready(self, deadline):
            pass

        def kill(self):
            self.killed = True

    monkeypatch.setattr(bench_cluster_vllm, "VllmServer", Server)
    monkeypatch.setattr(bench_cluster, "QUICK_RUNS", {"kvcomm_team": 2})
    bench = bench_cluster_vllm.VllmClusterBench(True, str(llama_dir), tmp_path, tmp_path / "python")
    with ExitStack() as stack:
        urls = bench._engines(stack, "cache_aware", 100, "secret")
        assert urls == [s.url for s in started] and len(set(urls)) == bench_cluster.NUM_REPLICAS
        assert [s.options["cpus"] for s in started] == ["0", "1"]
        for server in started:
            blocks = server.options["num_blocks"]
            assert (blocks - 1) * bench_cluster_vllm.BLOCK >= bench.longest > 100
            assert server.options["max_model_len"] >= bench.longest and not server.killed
    assert all(server.killed for server in started)
    env = bench._gateway_env("cache_aware", "secret")
    assert env["KVRELAY_INFERENCE__REUSE"] == "false" and env["KVRELAY_ROUTING__POLICY"] == "cache_aware"
