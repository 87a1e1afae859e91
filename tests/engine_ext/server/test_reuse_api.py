"""Segment reuse through the engine's HTTP API: plans in, per-segment report and cached
tokens out; a plan that cannot be followed never fails the request."""

from __future__ import annotations

import json

import hashlib

import httpx
import pytest

from kvrelay.wire.plan import Segment, SegmentPlan
from tests.helpers import make_engine

MODEL = "tiny-llama"
DOC = " ".join(f"fact {i} is that the sky holds {i * 7} clouds." for i in range(12))


@pytest.fixture(scope="module")
def srv(llama_dir, run_server):
    llm = make_engine(llama_dir, num_blocks=64, name=MODEL)
    with run_server(llm, MODEL) as server:
        yield server


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        yield c


def _seg(index: int, text: str, start: int, end: int, kind: str, **kw) -> dict:
    return Segment(message_index=index, char_start=start, char_end=end, kind=kind,
                   content_hash=hashlib.sha256(text[start:end].encode()).hexdigest(), **kw).model_dump(mode="json")


def body(system: str, question: str, method: str | None = None, stream: bool = False) -> dict:
    user = f"Read this.\n{DOC}\n{question}"
    doc_start = user.index(DOC)
    doc_end = doc_start + len(DOC)
    segments = [
        _seg(0, system, 0, len(system), "private"),
        _seg(1, user, 0, doc_start, "private"),
        _seg(1, user, doc_start, doc_end, "shared_block", method=method),
        _seg(1, user, doc_end, len(user), "private"),
    ]
    plan = SegmentPlan(session_id="s", agent_id="a", request_id="r", segments=segments)
    return {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "kv_transfer_params": {"kvrelay": plan.model_dump(mode="json"), "other": 1}}


def test_shared_block_is_reused_behind_another_prefix(http):
    first = http.post("/v1/chat/completions", json=body("You are the planner agent.", "What now?", method="shift")).json()
    report = first["kv_transfer_params"]["kvrelay_reuse"]
    assert first["kv_transfer_params"]["other"] == 1
    assert [s["method"] for s in report["segments"]] == ["dense"] * 4
    assert "evicted" in report["segments"][2]["reason"]

    second = http.post("/v1/chat/completions",
                       json=body("You are a critic with other duties.", "Is it true?", method="shift")).json()
    doc = second["kv_transfer_params"]["kvrelay_reuse"]["segments"][2]
    assert doc["method"] == "shift" and doc["tokens_recomputed"] == 0
    assert doc["tokens_reused"] == doc["token_end"] - doc["token_start"] > 20
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= doc["tokens_reused"]


def test_streamed_response_reports_reuse_on_the_final_chunk(http):
    http.post("/v1/chat/completions", json=body("You are the planner agent.", "What now?"))
    with http.stream("POST", "/v1/chat/completions",
                     json=body("You are a third agent.", "Why?", method="blend", stream=True)) as resp:
        chunks = [line for line in resp.iter_lines() if line.startswith("data: {")]
    final = [json.loads(c[len("data: "):]) for c in chunks if "kv_transfer_params" in c]
    assert len(final) == 1
    params = final[0]["kv_transfer_params"]
    assert [s["method"] for s in params["kvrelay_reuse"]["segments"]] and "kvrelay" not in params


def test_malformed_plan_is_ignored(http):
    payload = body("You are the planner agent.", "What now?")
    payload["kv_transfer_params"]["kvrelay"]["segments"][0]["char_end"] = 0
    resp = http.post("/v1/chat/completions", json=payload)
    assert resp.status_code == 200
    assert "kvrelay_reuse" not in resp.json()["kv_transfer_params"]
