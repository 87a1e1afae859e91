"""What clients see when the engine fails: a failed step fails its requests with a 500 and
the server keeps serving; a stopped engine answers 503."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import make_engine

MODEL = "tiny"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


@pytest.fixture
def srv(llama_dir, run_server):
    llm = make_engine(llama_dir, num_blocks=16, name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


def _fail_next_steps(llm, n: int) -> list[int]:
    calls = [0]
    run = llm.runner.run

    def flaky(step, interrupt=None):
        calls[0] += 1
        if calls[0] <= n:
            raise RuntimeError("simulated kernel failure")
        return run(step, interrupt)

    llm.runner.run = flaky
    return calls


def test_failed_step_returns_500_and_server_recovers(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        good = http.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]["content"]
        assert srv.llm.kv.pool.num_cached > 0  # the first request published full blocks
        _fail_next_steps(srv.llm, 1)
        r = http.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "server_error"
        assert "simulated kernel failure" in err["message"]
        assert srv.wait_idle(5)
        assert srv.llm.kv.pool.num_cached == 0  # possibly corrupt cached blocks were forgotten
        assert http.get("/health").status_code == 200
        again = http.post("/v1/chat/completions", json=BODY)
        assert again.status_code == 200
        assert again.json()["choices"][0]["message"]["content"] == good


def test_failed_step_fails_a_stream_that_has_not_started(srv):
    _fail_next_steps(srv.llm, 1)
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={**BODY, "stream": True})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
    assert srv.wait_idle(5)


def test_failure_mid_stream_ends_the_stream_with_an_error_event(srv):
    """Once a 200 and some chunks have been sent, a failed step cannot change the status:
    the stream must end with an OpenAI-style error event (what the OpenAI API and vLLM send,
    and what the openai SDK turns into an APIError), not a truncated chunked body."""
    calls = [0]
    run = srv.llm.runner.run

    def flaky(step, interrupt=None):
        calls[0] += 1
        if calls[0] == 4:  # prefill, two decodes, then the failure
            raise RuntimeError("simulated kernel failure")
        return run(step, interrupt)

    srv.llm.runner.run = flaky
    lines = []
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            try:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
            except httpx.RemoteProtocolError as exc:
                pytest.fail(f"stream cut without an error event after {lines!r}: {exc}")
    assert srv.wait_idle(5)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1
    assert "simulated kernel failure" in errors[0]["error"]["message"]
    assert errors[0]["error"]["type"] == "server_error"


def test_stopped_engine_answers_503(srv):
    srv.async_engine.stop()
    assert not srv.async_engine.is_alive
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        r = http.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "service_unavailable"
