"""The engine's OpenAI-compatible server end to end on loopback, with the tiny Llama:
the official `openai` client, SSE streaming, usage, prefix-cache accounting,
kv_transfer_params, concurrency, error statuses and bodies, client disconnects."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from engine_ext.sampling import SamplingParams
from tests.helpers import make_engine, slow_with_abort_spy

MODEL = "tiny-llama"
NUM_BLOCKS = 24  # 384 tokens of KV; the model's context is 512


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    llm = make_engine(llama_dir, num_blocks=NUM_BLOCKS, name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def ref(llama_dir):
    """A second engine on the same weights, driven directly, as the expected-output oracle."""
    return make_engine(llama_dir, num_blocks=64, name=MODEL)


@pytest.fixture(autouse=True)
def _idle_between_tests(request):
    yield
    if "srv" in request.fixturenames:
        server = request.getfixturevalue("srv")
        assert server.wait_idle(10), "a test left work or referenced KV blocks behind"


@pytest.fixture
def client(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        yield c


def chat_ids(ref, messages) -> list[int]:
    return ref.tokenizer.encode(ref.tokenizer.render_chat(messages))


def expected(ref, ids: list[int], max_tokens: int, **kw):
    ref.kv.pool.reset_cache()
    seq = ref.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))
    return seq.detokenizer.text, seq.finish_reason, len(ids), len(seq.output_token_ids)


def msgs(text: str, system: str | None = None):
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": "user", "content": text}]


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# -- basics ---------------------------------------------------------------------------------


def test_health_and_models(srv, http, client):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = http.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == 512
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_non_streaming(client, ref):
    messages = msgs("What is the capital of France?", system="Be brief.")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    text, reason, n_prompt, n_out = expected(ref, chat_ids(ref, messages), 12, ignore_eos=True)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert text  # the tiny model does produce text
    assert choice.finish_reason == reason == "length"
    assert resp.usage.prompt_tokens == n_prompt
    assert resp.usage.completion_tokens == n_out == 12
    assert resp.usage.total_tokens == n_prompt + 12


def test_max_completion_tokens_and_eos_stop(client, ref):
    messages = msgs("Good morning! How are you today?")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                          temperature=0)
    text, reason, _, n_out = expected(ref, chat_ids(ref, messages), 5)
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == reason
    assert resp.usage.completion_tokens == n_out


def _stream_chat(client, messages, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw))
    return chunks


def test_chat_streaming_equals_non_streaming(client, ref):
    messages = msgs("Write a short poem about the moon.")
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = _stream_chat(client, messages, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = chunks[1:-1]
    assert len(body) >= 2  # the text really arrives in pieces
    assert all(c.choices[0].finish_reason is None for c in body)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content
    assert streamed == expected(ref, chat_ids(ref, messages), 20, ignore_eos=True)[0]
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert not last.choices[0].delta.content
    assert last.usage is None


def test_stream_wire_format_and_done(http):
    body = {"model": MODEL, "messages": msgs("Hello"), "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"][0]["delta"] == {}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_stream_include_usage(client, ref):
    messages = msgs("Alice met Bob at the station.")
    chunks = _stream_chat(client, messages, max_tokens=9, temperature=0, extra_body={"ignore_eos": True},
                          stream_options={"include_usage": True})
    *rest, usage_chunk = chunks
    assert usage_chunk.choices == []
    _, _, n_prompt, n_out = expected(ref, chat_ids(ref, messages), 9, ignore_eos=True)
    assert usage_chunk.usage.prompt_tokens == n_prompt
    assert usage_chunk.usage.completion_tokens == n_out == 9
    assert usage_chunk.usage.total_tokens == n_prompt + 9
    assert rest[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in rest)


def test_completions_non_streaming_and_streaming(client, ref):
    prompt = "The engine schedules requests in batches"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=15, temperature=0,
                                     extra_body={"ignore_eos": True})
    text, reason, n_prompt, _ = expected(ref, ref.tokenizer.encode(prompt), 15, ignore_eos=True)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.choices[0].text == text
    assert resp.choices[0].finish_reason == reason
    assert resp.usage.prompt_tokens == n_prompt
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=15, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_completions_with_token_id_prompts(client, ref):
    ids = ref.tokenizer.encode("Numbers like 1 2 3")
    text = expected(ref, ids, 6, ignore_eos=True)[0]
    for prompt in (ids, [ids]):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == text
        assert resp.usage.prompt_tokens == len(ids)


def test_stop_strings(client, ref):
    messages = msgs("Please summarise the following document.")
    text = expected(ref, chat_ids(ref, messages), 24, ignore_eos=True)[0]
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          stop=stop, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == text[:cut]
    assert resp.choices[0].finish_reason == "stop"
    chunks = _stream_chat(client, messages, max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                          extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_over_http(client):
    messages = msgs("Computers compute; teachers teach")

    def run(seed):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=1.5,
                                              seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_cached_tokens_on_repeated_long_prompt(client, ref):
    long_text = "Memory is measured in blocks; each block holds sixteen tokens of keys and values. " * 3
    messages = msgs(long_text)
    n_prompt = len(chat_ids(ref, messages))
    assert n_prompt > 40
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n_prompt
    assert second.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16 > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    chunks = _stream_chat(client, messages, max_tokens=3, temperature=0, stream_options={"include_usage": True})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16


def _client_params(echoed: dict) -> dict:
    """The caller's own entries: the engine adds its TTFT breakdown beside them."""
    assert echoed["kvrelay_ttft"]["ttft_s"] > 0
    return {k: v for k, v in echoed.items() if k != "kvrelay_ttft"}


def test_kv_transfer_params_echoed_without_the_plan(http):
    plan = {"kvrelay": {"version": 1, "segments": [{"message": 0, "start": 0, "end": 5}]}}
    params = {"connector": {"remote_block_ids": [1, 2]}}  # a caller's own entry comes back; its plan never does
    body = {"model": MODEL, "messages": msgs("Hello there"), "max_tokens": 3, "temperature": 0,
            "kv_transfer_params": {**plan, **params}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert _client_params(r.json()["kv_transfer_params"]) == params
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2,
                                          "kv_transfer_params": {**plan, **params}})
    assert _client_params(r.json()["kv_transfer_params"]) == params
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    data = [e for e in events if e != "[DONE]"]
    final = [e for e in data if e["choices"] and e["choices"][0]["finish_reason"] is not None]
    assert len(final) == 1
    assert _client_params(final[0]["kv_transfer_params"]) == params
    # without the field nothing is echoed
    r = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "kv_transfer_params"})
    assert "kv_transfer_params" not in r.json()


def test_eight_concurrent_streams_match_solo_runs(srv, client, monkeypatch):
    topics = ["the moon", "sea shells", "Paris", "water", "Alice and Bob", "numbers", "agents", "memory"]
    convs = [msgs(f"Tell me about {t}.") for t in topics]
    solo = [client.chat.completions.create(model=MODEL, messages=m, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
            for m in convs]
    assert len(set(solo)) > 1

    steps: list[int] = []
    original = srv.llm.scheduler.schedule

    def spy():
        out = original()
        steps.append(sum(1 for c in out.chunks if c.is_decode))
        return out

    async def one(ac, m):
        stream = await ac.chat.completions.create(model=MODEL, messages=m, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        parts, reason = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, m) for m in convs))

    step = srv.llm.step

    def paced_step(interrupt=None):  # keep each request alive long enough for all eight to overlap
        time.sleep(0.005)
        return step(interrupt)

    monkeypatch.setattr(srv.llm, "step", paced_step)
    monkeypatch.setattr(srv.llm.scheduler, "schedule", spy)
    results = asyncio.run(main())
    monkeypatch.undo()
    assert [r[0] for r in results] == solo
    assert all(r[1] == "length" for r in results)
    assert max(steps) >= 4  # the streams really were batched together


# -- errors ---------------------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, code=None, param=None, type_="invalid_request_error"):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] == type_
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_invalid_json(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")


@pytest.mark.parametrize("patch,param", [
    ({"messages": None}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stream": "yes please"}, "stream"),
    ({"model": None}, "model"),
])
def test_validation_errors(http, patch, param):
    body = {**GOOD, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


@pytest.mark.parametrize("patch,param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_unsupported_features_are_refused(http, patch, param):
    assert_error(http.post("/v1/chat/completions", json={**GOOD, **patch}), 400, param=param)


def test_image_content_part_is_refused(http):
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    assert_error(http.post("/v1/chat/completions", json={**GOOD, "messages": [{"role": "user", "content": content}]}), 400)
    # text parts alone are fine
    r = http.post("/v1/chat/completions", json={**GOOD, "messages": [{"role": "user", "content": content[:1]}]})
    assert r.status_code == 200


def test_unknown_model(http, client):
    err = assert_error(http.post("/v1/chat/completions", json={**GOOD, "model": "gpt-4o"}), 404,
                       code="model_not_found", param="model")
    assert "gpt-4o" in err["message"]
    assert_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=GOOD["messages"])
    with pytest.raises(openai.NotFoundError):  # also when streaming: the status comes before any byte
        client.chat.completions.create(model="gpt-4o", messages=GOOD["messages"], stream=True)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_context(http, stream):
    long_text = " ".join(["sixteen"] * 600)
    r = http.post("/v1/chat/completions", json={**GOOD, "messages": msgs(long_text), "stream": stream})
    assert_error(r, 400, code="context_length_exceeded")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 600, "stream": stream})
    assert_error(r, 400, code="context_length_exceeded")


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_over_context(http, stream):
    r = http.post("/v1/chat/completions", json={**GOOD, "max_tokens": 600, "stream": stream})
    assert_error(r, 400, code="context_length_exceeded")


@pytest.mark.parametrize("stream", [False, True])
def test_request_that_can_never_fit_the_kv_budget(http, stream, client):
    # prompt + 450 fits the 512-token context but not the 384 tokens of KV
    r = http.post("/v1/chat/completions", json={**GOOD, "max_tokens": 450, "stream": stream})
    assert_error(r, 400, code="kv_budget_exceeded", param="max_tokens")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=450)
    assert err.value.status_code == 400
    assert err.value.code == "kv_budget_exceeded"


def test_completion_prompt_errors(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 100000]}), 400, param="prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True}), 400, param="echo")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"], temperature=5)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=GOOD["messages"], n=2)
    assert err.value.param == "n"


# -- client disconnects ---------------------------------------------------------------------


@pytest.fixture
def slow_engine(srv, monkeypatch):
    """Slow each engine step down (so a long request outlives the client) and record aborts."""
    return slow_with_abort_spy(srv.llm, monkeypatch, step_s=0.02)


def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "messages": msgs("Tell me a very long story."), "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def test_stream_client_disconnect_aborts_and_frees_blocks(srv, slow_engine):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=_long_body(True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
            assert srv.llm.has_work
    started = time.monotonic()
    assert srv.wait_idle(5), "the abandoned stream kept running or kept its KV blocks"
    assert time.monotonic() - started < 5
    assert len(slow_engine) == 1  # it was aborted, not run to its 300 tokens (~6 s)
    pool = srv.llm.kv.pool
    assert pool.num_free == pool.num_blocks


def test_non_streaming_client_timeout_aborts_and_frees_blocks(srv, slow_engine):
    with httpx.Client(base_url=srv.base_url, timeout=0.6) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=_long_body(False))
    assert srv.wait_idle(5), "the abandoned request kept running or kept its KV blocks"
    assert len(slow_engine) == 1


def test_server_still_serves_after_disconnects(client, ref):
    messages = msgs("Hello again")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == expected(ref, chat_ids(ref, messages), 5, ignore_eos=True)[0]


def test_many_disconnects_in_parallel(srv, slow_engine):
    def abandon():
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            with c.stream("POST", "/v1/chat/completions", json=_long_body(True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and "content" in line:
                        break

    threads = [threading.Thread(target=abandon) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert srv.wait_idle(8)
    assert len(slow_engine) == 4
