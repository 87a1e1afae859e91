"""The fidelity guard end to end: gateway -> embedded engine (tiny random Llama). An app
opted into `shift` places a shared document's KV computed behind other text; the engine
scores the probed requests densely, the gateway polls the scores and switches `shift`
off for that app, while an exact app is untouched. Then an operator re-enables it, and
a cool-down re-probe decides again. The decisions are printed (run with -s) as the
measurement of the guard on a drifting app."""

from __future__ import annotations

import json
import time

import pytest

from kvrelay.gateway.fidelity_guard import Score
from tests.gateway.support import wait_until
from tests.helpers import make_engine

MODEL = "tiny-llama"
ADMIN = "admin-" + "s3cret" * 4
DOC = ("The harbour of the old town opens at dawn; boats bring fish, salt and letters, and the market "
       "closes when the bell of the tower rings twice in the afternoon.")
GUARD = {"sample_rate": 0.05, "min_samples": 3, "poll_interval_s": 0.05, "cooldown_s": 1.0}


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    llm = make_engine(llama_dir, num_blocks=256, name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


def _ask(http, app: str, i: int):
    intro = f"Request {i} from the {app} desk, " + "please " * (i % 5)
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{intro}<TTSEP>{DOC}<TTSEP>What closes the market?"}]}
    response = http.post("/v1/chat/completions", json=body, headers={"x-kvrelay-app": app})
    assert response.status_code == 200, response.text
    return response.json()


def _settled(srv, polled: list) -> bool:
    """The last request's probe, if it made one, is scored and the gateway has read the
    score: the engine has no request and no probe pending (a probed request's answer
    reaches the client just before its job is queued), and the guard has recorded as
    many polled scores as the engine has produced."""
    probes = srv.async_engine.probes
    if srv.llm.has_work or probes.has_pending:
        return False
    _, produced = probes.results_after(1 << 62)  # the engine's last result's sequence number
    return len(polled) == produced


def _row(guard, app: str) -> dict | None:
    return next((r for r in guard.snapshot() if r["app"] == app and r["method"] == "shift"), None)


def _plan(gw, n: int) -> dict:
    return json.loads(gw.rows(n)[-1].plan)


def test_a_drifting_app_loses_shift_an_exact_app_keeps_working(srv, start_gateway):
    gw = start_gateway([srv.base_url], admin_key=ADMIN,
                       approximation={"rules": [{"method": "shift", "app": "drifting"}], "guard": GUARD})
    guard = gw.state.fidelity
    guard._rng.random = lambda: 0.0  # sample every approximate request: the test is about decisions, not sampling
    polled: list[Score] = []  # what the gateway's poller recorded (the test records some itself, below)
    record = guard.record

    def recorded(score: Score) -> None:
        record(score)
        polled.append(score)  # after the guard has decided on it: a settled check reads that decision

    guard.record = recorded
    auth = {"authorization": f"Bearer {ADMIN}"}
    decisions: list[str] = []
    n = 0
    with gw.client(timeout=60) as http:
        for i in range(3):  # the exact app: never approximate, never probed
            _ask(http, "steady", i)
            n += 1
            plan = _plan(gw, n)
            assert not plan["probe"] and {s.get("method") for s in plan["segments"]} == {None}
        for i in range(12):
            _ask(http, "drifting", i)
            n += 1
            assert wait_until(lambda: _settled(srv, polled), timeout=30)
            row = _row(guard, "drifting")
            if row is not None:
                decisions.append(f"request {i}: {row['samples']} scores, top-1 {row['top1']:.3f}, "
                                 f"KL {row['kl']:.4f} -> {row['state']}")
            if row is not None and row["state"] == "off":
                break
        assert row is not None and row["state"] == "off", decisions
        assert row["samples"] == GUARD["min_samples"], decisions  # decided at the first chance
        assert row["top1"] < 0.95 or row["kl"] > 0.02

        _ask(http, "drifting", 50)  # off: the gateway sends it exact, unprobed
        n += 1
        plan = _plan(gw, n)
        assert not plan["probe"] and "shift" not in {s.get("method") for s in plan["segments"]}
        assert _row(guard, "steady") is None and _ask(http, "steady", 9)["choices"][0]["finish_reason"] == "length"
        n += 1
        metrics = http.get("/metrics").text
        assert f'kvrelay_fidelity_state{{app="drifting",method="shift",tenant="{row["tenant"]}"}} 2.0' in metrics
        assert 'kvrelay_fidelity_switch_offs_total{method="shift"} 1.0' in metrics

        enabled = http.post("/admin/fidelity/drifting/shift/enable", headers=auth)
        assert enabled.status_code == 200, enabled.text
        decisions.append("operator re-enabled shift for drifting")
        _ask(http, "drifting", 60)
        n += 1
        assert "shift" in {s.get("method") for s in _plan(gw, n)["segments"]}

        guard.settings = guard.settings.model_copy(update={"sample_rate": 0.0})  # probation alone probes now
        for figures in ((0.5, 0.5),) * 3:  # switched off again (as probes would), to test the cool-down
            record(Score(row["tenant"], "drifting", "shift", *figures))
        assert _row(guard, "drifting")["state"] == "off"
        decisions.append("switched off again; waiting out the cool-down")
        time.sleep(GUARD["cooldown_s"] + 0.1)
        for i in range(70, 76):
            _ask(http, "drifting", i)
            n += 1
            assert _plan(gw, n)["probe"] or _row(guard, "drifting")["state"] == "off"
            assert wait_until(lambda: _settled(srv, polled), timeout=30)
            row = _row(guard, "drifting")
            decisions.append(f"after cool-down, request {i}: {row['samples']} scores, state {row['state']}")
            if row["state"] == "off":
                break
        assert row["state"] == "off" and row["switch_offs"] == 3
    print("\nfidelity guard on a drifting app (shift, tiny model):\n  " + "\n  ".join(decisions))
