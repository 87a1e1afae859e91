"""The official `openai` client -> gateway -> the embedded engine (tiny random Llama) on
loopback: answers, streams, usage and the records they leave."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.helpers import make_engine, slow_with_abort_spy

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Hello, who are you?"}]
PROMPT = "The quick brown fox"
HEX64 = re.compile(r"^[0-9a-f]{64}$")


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    llm = make_engine(llama_dir, num_blocks=32, name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


@pytest.fixture
def gw(srv, start_gateway):
    gateway = start_gateway([srv.base_url])
    yield gateway
    assert srv.wait_idle(10), "a request left work or KV blocks behind in the engine"


@pytest.fixture
def client(gw):
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


GEN = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}


def assert_private(row) -> None:
    assert row.prompt_text is None and row.completion_text is None
    assert HEX64.match(row.prompt_sha256)
    assert row.prompt_chars > 0
    assert HEX64.match(row.completion_sha256)


def test_chat_unary_and_stream_agree_and_are_recorded(gw, client, srv):
    unary = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GEN)
    text = unary.choices[0].message.content
    assert text and unary.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}, **GEN))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    usage = usage_chunks[0].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (unary.usage.prompt_tokens, 8)

    # a stream that did not ask for usage: no usage chunk, the record has the tokens anyway
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GEN))
    assert all(c.choices for c in plain)
    assert all(c.usage is None for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == text

    rows = gw.rows(3)
    assert len(rows) == 3
    for row, stream in zip(rows, (False, True, True), strict=True):
        assert (row.status, row.http_status, row.stream) == ("ok", 200, stream)
        assert (row.endpoint, row.model, row.upstream) == ("/v1/chat/completions", MODEL, srv.base_url)
        assert (row.prompt_tokens, row.completion_tokens) == (unary.usage.prompt_tokens, 8)
        assert row.completion_chars == len(text)
        assert_private(row)
    assert rows[0].ttft_ms is None and rows[0].first_token_at is None
    for row in rows[1:]:
        assert row.ttft_ms is not None and 0 < row.ttft_ms <= row.latency_ms
    assert rows[1].completion_sha256 == rows[0].completion_sha256 == rows[2].completion_sha256
    assert rows[0].prompt_sha256 == rows[1].prompt_sha256


def test_completions_unary_and_stream_agree_and_are_recorded(gw, client, srv):
    unary = client.completions.create(model=MODEL, prompt=PROMPT, **GEN)
    text = unary.choices[0].text
    assert text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GEN))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    usage = [c.usage for c in chunks if not c.choices]
    assert len(usage) == 1
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (unary.usage.prompt_tokens, 8)

    unary_row, stream_row = gw.rows(2)
    for row in (unary_row, stream_row):
        assert (row.status, row.endpoint, row.model, row.upstream) == ("ok", "/v1/completions", MODEL, srv.base_url)
        assert (row.prompt_tokens, row.completion_tokens) == (unary.usage.prompt_tokens, 8)
        assert row.prompt_chars == len(PROMPT)
        assert_private(row)
    assert (unary_row.stream, stream_row.stream) == (False, True)
    assert unary_row.ttft_ms is None
    assert stream_row.ttft_ms > 0


def test_store_content_keeps_prompt_and_completion_text(srv, start_gateway):
    gw = start_gateway([srv.base_url], store_content=True)
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=30) as client:
        text = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GEN).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, **GEN) if c.choices)
    rows = gw.rows(2)
    prompt = json.dumps(MESSAGES, sort_keys=True, ensure_ascii=False)
    for row in rows:
        assert row.prompt_text == prompt
        assert row.completion_text == text == streamed
        assert row.completion_chars == len(text)
    assert srv.wait_idle(10)


def test_engine_4xx_reaches_the_client_unchanged(gw, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
    assert info.value.status_code == 400
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.upstream) == ("client_error", 400, gw.pool.upstreams[0].url)


def test_unknown_model_is_404_from_the_gateway(gw, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    (row,) = gw.rows(1)
    assert (row.status, row.http_status, row.upstream, row.model) == ("client_error", 404, None, "no-such-model")


def test_models_lists_the_engine_model(gw, client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_client_disconnect_aborts_the_engine_request(srv, start_gateway, monkeypatch):
    aborted = slow_with_abort_spy(srv.llm, monkeypatch)
    gw = start_gateway([srv.base_url])
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    seen = 0
    with gw.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                seen += 1
                if seen == 2:
                    break
    assert srv.wait_idle(5), "the engine kept generating for a client that left"
    assert len(aborted) == 1
    (row,) = gw.rows(1)
    assert (row.status, row.http_status) == ("cancelled", 499)
    assert row.completion_tokens is None  # it never reached the usage chunk
    assert srv.llm.kv.pool.num_free == srv.llm.kv.pool.num_blocks


def test_the_engine_s_ttft_breakdown_is_kept_with_the_request(srv, start_gateway):
    gw = start_gateway([srv.base_url])
    # Greedy and past EOS (GEN): the answer is the same every run, and its content (the
    # first token the gateway times) does not depend on what sampling happens to draw.
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0) as client:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}], **GEN)
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi again."}],
                                                     stream=True, **GEN))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), "the stream carried no content"
    for row in gw.rows(2):
        report = json.loads(row.ttft_breakdown)
        assert report["ttft_s"] > 0 and report["prefill_steps"] >= 1
        seen_ms = row.ttft_ms if row.stream else row.latency_ms  # a unary call's first token comes with its last
        assert report["ttft_s"] * 1e3 <= seen_ms  # the gateway sees the engine's TTFT plus its own hop
