"""One request must never take the engine down: each poison request gets a 4xx with an
OpenAI error body naming its field, and a normal request right after it still works.

Bodies are sent as raw JSON so lone surrogates travel as the `\\ud800` escapes a client
sends (valid JSON, not encodable as UTF-8)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import make_engine

MODEL = "tiny-llama"
LONE = "\ud800"
CHAT = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
TEXT = {"model": MODEL, "max_tokens": 2, "temperature": 0, "prompt": "Hi"}


def chat(**changes) -> dict:
    return {**CHAT, **changes}


def text(**changes) -> dict:
    return {**TEXT, **changes}


def msgs(*messages: dict) -> list[dict]:
    return list(messages)


# (endpoint, body, the field the error must name)
POISON = [
    ("chat", chat(seed=2**70), "seed"),
    ("chat", chat(seed=-(2**70)), "seed"),
    ("chat", chat(seed=2**64), "seed"),
    ("chat", chat(max_tokens=2**70), "max_tokens"),
    ("chat", chat(max_completion_tokens=2**64), "max_completion_tokens"),
    ("chat", chat(top_k=2**70), "top_k"),
    ("chat", chat(n=2**70), "n"),
    ("chat", chat(logprobs=2**70), "logprobs"),
    ("chat", chat(model=MODEL + LONE), "model"),
    ("chat", chat(messages=msgs({"role": "system", "content": "Be" + LONE}, {"role": "user", "content": "Hi"})),
     "messages.0.content"),
    ("chat", chat(messages=msgs({"role": "user", "content": LONE})), "messages.0.content"),
    ("chat", chat(messages=msgs({"role": "user", "content": [{"type": "text", "text": "a" + LONE}]})),
     "messages.0.content"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi", "name": "n" + LONE})), "messages.0.name"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"},
                                {"role": "tool", "content": LONE, "tool_call_id": "c1"})), "messages.2.content"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi", "extra": {"k": [LONE]}})), "messages.0.extra"),
    ("chat", chat(stop=["x" + LONE]), "stop"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f" + LONE}}]), "tools"),
    ("chat", chat(kv_transfer_params={"note": LONE}), "kv_transfer_params"),
    ("text", text(prompt="Hi" + LONE), "prompt"),
    ("text", text(prompt=["Hi" + LONE]), "prompt"),
    ("text", text(prompt=[2**70]), "prompt"),
    ("text", text(prompt=[-1]), "prompt"),
    ("text", text(prompt=[10**9]), "prompt"),
    ("text", text(prompt=[[5, 2**64]]), "prompt"),
    ("text", text(seed=2**70), "seed"),
    ("text", text(suffix=LONE), "suffix"),
    ("text", text(kv_transfer_params={"note": float("nan")}), "kv_transfer_params"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "f", "x": float("inf")}}]), "tools"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi"}, {"role": "tool", "content": "214",
                                                                   "tool_call_id": [1, 2]})), "messages.1.tool_call_id"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": None, "tool_calls": "nope"})), "messages.1.tool_calls"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}]})), "messages.1.tool_calls"),
    ("chat", chat(messages=msgs({"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c" + LONE, "type": "function", "function": {"name": "f", "arguments": "{}"}}]})), "messages.1.tool_calls"),
]


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    llm = make_engine(llama_dir, num_blocks=24, name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


def post(http: httpx.Client, endpoint: str, body: dict, stream: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    raw = json.dumps({**body, "stream": stream})  # ensure_ascii: a lone surrogate becomes \ud800
    return http.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("endpoint", "body", "field"), POISON, ids=[f"{e}-{f}-{i}" for i, (e, _, f) in
                                                                     enumerate(POISON)])
def test_a_poison_request_is_refused_and_the_next_one_works(srv, endpoint, body, field, stream):
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = post(http, endpoint, body, stream)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] is not None and error["param"].startswith(field), error
        assert field in error["message"] or error["param"] in error["message"], error
        ok = post(http, "chat", CHAT)
        assert ok.status_code == 200, ok.text
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("temperature", [5e-324, 5.592550987874534e-69, 1e-6])
def test_a_vanishing_temperature_samples_greedily_and_fails_nothing(srv, temperature):
    """logits / 5e-324 overflows float32: such a request once failed its whole step (and
    every request batched with it). Under 1e-5 it is greedy, as temperature 0 is."""
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        greedy = post(http, "text", text(max_tokens=4, ignore_eos=True)).json()
        tiny = post(http, "text", text(max_tokens=4, ignore_eos=True, temperature=temperature))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_an_unexpected_failure_in_one_request_fails_only_that_request(srv, monkeypatch):
    """A bug the engine did not foresee, raised while one request is added, fails that
    request with an OpenAI 500 body; the engine thread goes on serving."""
    real = srv.llm.add_request

    def add_request(request, *args, **kwargs):
        if request.prompt_token_ids[-1:] == [7] and len(request.prompt_token_ids) == 3:
            raise RuntimeError("boom")
        return real(request, *args, **kwargs)

    monkeypatch.setattr(srv.llm, "add_request", add_request)
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        for stream in (False, True):
            r = post(http, "text", text(prompt=[5, 6, 7]), stream)
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["type"] == "server_error" and "boom" not in error["message"]
            assert post(http, "text", text(prompt=[5, 6, 8])).status_code == 200
        assert srv.async_engine.is_alive


def test_every_error_is_an_openai_body(srv, monkeypatch):
    """Even a failure outside the engine's own exceptions (a bug in the route) answers
    with an OpenAI error body, never plain text."""
    def broken(*_args, **_kwargs):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(type(srv.async_engine), "generate", broken)
    with httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = post(http, "chat", CHAT)
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "server_error"
