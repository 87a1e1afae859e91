"""KVCOMM end to end with SmolLM2: an unmodified OpenAI-client loop of three agents ->
gateway (names the placeholders, app id) -> embedded engine. In the paper's mode anchors
learn on the first question and predict the second; in the default mode an answer's first
reader computes it and the next reader is served that reader's KV. Reuse must show in the
response, the request row and the span."""

from __future__ import annotations

import json
import time

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine_ext.config import AnchorConfig, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine

MODEL = "smollm2"
AGENTS = ("You are the solver. Answer in one short sentence.",
          "You are the critic. Say in one short sentence whether the solver is right.",
          "You are the judge. Give the final answer in one short sentence.")
# The first question is the longer one: its anchor is eligible for the second.
QUESTIONS = (("A farmer has seventeen sheep and all but nine of them run away through a hole in the fence. "
              "How many sheep does the farmer have left in the field afterwards?"),
             "Which is heavier, a kilogram of feathers or a kilogram of iron bars? Explain the answer briefly.")

pytestmark = pytest.mark.slow


def _server(smollm2_dir, run_server, new_samples: str):
    reuse = ReuseConfig(default_method="kvcomm", anchors=AnchorConfig(new_samples=new_samples))  # type: ignore[arg-type]
    llm = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=256 * 2**20, reuse=reuse), model_name=MODEL)
    return run_server(llm, MODEL)


@pytest.fixture(scope="module")
def srv(smollm2_dir, run_server):
    """The paper's mode: a new sample is predicted from other samples' anchors."""
    with _server(smollm2_dir, run_server, "predict") as server:
        yield server


def _run_workflow(client: openai.OpenAI, question: str) -> list:
    """Each agent reads the question and every answer before its own, as AutoGen sends them."""
    answers: list[tuple[str, str]] = []
    responses = []
    for i, system in enumerate(AGENTS):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        messages += [{"role": "user", "name": name, "content": text} for name, text in answers]
        r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48, messages=messages)
        responses.append(r)
        answers.append((f"agent{i}", r.choices[0].message.content))
    return responses


def test_anchors_learned_on_one_question_predict_the_next(srv, start_gateway):
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    gw = start_gateway([srv.base_url], tracer_provider=provider)
    with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=300) as client:
        first = _run_workflow(client, QUESTIONS[0])
        second = _run_workflow(client, QUESTIONS[1])

    critic_first = first[1].model_extra["kv_transfer_params"]["kvrelay_reuse"]
    question = next(s for s in critic_first["segments"] if s["name"] == "user_question")
    assert question["method"] == "dense" and question["kvcomm"]["anchor"] == "new", critic_first

    critic = second[1]
    report = critic.model_extra["kv_transfer_params"]["kvrelay_reuse"]
    question = next(s for s in report["segments"] if s["name"] == "user_question")
    assert question["method"] == "kvcomm", json.dumps(question)
    # One anchor per chunk: each chunk of the question predicted from the earlier question's.
    assert question["kvcomm"]["anchor"] == "hit"
    assert question["kvcomm"]["anchors_used"] == question["kvcomm"]["chunks_predicted"] == question["kvcomm"]["chunks"]
    assert question["tokens_reused"] > 10
    cached = critic.usage.prompt_tokens_details.cached_tokens
    assert cached >= question["tokens_reused"]

    rows = gw.rows(6, timeout=30)  # ordered by start: the critic of the second question is the fifth
    row = rows[4]
    assert (row.status, row.cached_tokens, row.completion_tokens) == ("ok", cached, critic.usage.completion_tokens)
    deadline = time.monotonic() + 5
    while len(spans.get_finished_spans()) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    critic_spans = [s for s in spans.get_finished_spans()
                    if s.attributes.get("kvrelay.request.id") == row.id]
    assert len(critic_spans) == 1
    assert critic_spans[0].attributes["gen_ai.usage.cache_read.input_tokens"] == cached


def test_by_default_an_answers_first_reader_computes_it_and_the_next_reader_gets_that_kv(smollm2_dir, run_server,
                                                                                      start_gateway):
    with _server(smollm2_dir, run_server, "readers") as server:
        gw = start_gateway([server.base_url])
        with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=300) as client:
            _run_workflow(client, QUESTIONS[0])
            second = _run_workflow(client, QUESTIONS[1])

    critic, judge = (r.model_extra["kv_transfer_params"]["kvrelay_reuse"] for r in second[1:])
    question = next(s for s in critic["segments"] if s["name"] == "user_question")
    assert question["method"] == "kvcomm" and question["kvcomm"]["anchor"] == "shift", json.dumps(question)
    answers = [s for s in critic["segments"] if s["kind"] == "placeholder" and s["name"] != "user_question"]
    assert [(s["method"], s["kvcomm"]["anchor"]) for s in answers] == [("dense", "new")], json.dumps(critic)
    solver = answers[0]["name"]
    placed = next(s for s in judge["segments"] if s["name"] == solver)
    assert placed["method"] == "kvcomm" and placed["kvcomm"]["anchor"] == "reader", json.dumps(judge)
    assert placed["tokens_reused"] > 10
